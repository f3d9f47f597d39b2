"""The mask kernel, and SML against the one-step estimator on an LM head.

    DACA_BENCH_QUICK=1 pytest benchmarks/bench_stratified.py   # small CPU shapes
    pytest benchmarks/bench_stratified.py                      # LLaDA-shaped head (GPU)

``stratified_mask`` (providers: ``daca`` = the default dispatch, Triton on a GPU; ``torch`` = the
chunked PyTorch path; ``reference`` where its ``O(L^2)`` ranking fits), d1's prompt masking on
(p = 0.15). Bytes: read ids, maskable and prompt, write strata and the K copies:
``B*L*(s + 1 + 1 + 8) + K*B*L*s`` (``s`` = bytes per id).

Estimators on a head (``V, H``) behind a backbone that is only an embedding lookup, so the time is
the head's: ``one_step_eager`` (full ``[B, L, V]`` logits, ``log_softmax``, gather: what trainers
do today), ``one_step`` (``one_step_logprob``) and ``sml_k4`` (``stratified_logprob``, K = 4).
FLOPs count the useful head work on the ``N = B*C`` completion rows: ``2*N*V*H`` forward,
``6*N*V*H`` forward+backward (eager also multiplies the prompt rows, and the fused path
recomputes logits in backward: extra work each pays, not counted).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from conftest import DEVICE, peak_mb, rounds, shapes, timed
from daca_kernels import one_step_logprob, stratified_logprob, stratified_mask
from daca_kernels.masked_lm import MaskedLM

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
PROMPT_MASK_PROB = 0.15

MASK_SHAPES = shapes(quick=[(8, 512, 4), (32, 1024, 4)], full=[(64, 1024, 4), (256, 2048, 4), (64, 4096, 8)])
# (B, L, C, V, H); full: LLaDA's head, N = B*C = 4096 and 16384 completion rows after a 64-token prompt.
HEAD_SHAPES = shapes(
    quick=[(4, 128, 96, 4096, 128), (4, 128, 96, 32000, 128)],
    full=[(16, 320, 256, 126464, 4096), (64, 320, 256, 126464, 4096)],
)


class _Backend:
    """Force ``DACA_BACKEND`` for the duration of a call (None: the default dispatch)."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.old = os.environ.get("DACA_BACKEND")
        if self.name is not None:
            os.environ["DACA_BACKEND"] = self.name

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("DACA_BACKEND", None)
        else:
            os.environ["DACA_BACKEND"] = self.old


MASK_PROVIDERS = {"daca": None, "torch": "torch", "reference": "reference"}


@pytest.mark.parametrize("provider", list(MASK_PROVIDERS))
@pytest.mark.parametrize("batch,length,num_strata", MASK_SHAPES)
def test_stratified_mask(benchmark, record, provider, batch, length, num_strata):
    if provider == "torch" and DEVICE.type == "cpu":
        pytest.skip("on CPU the default dispatch is the torch path")
    if provider == "reference" and batch * length * length > 1 << 26:
        pytest.skip("the reference's pairwise ranking does not fit at this shape")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, 126000, (batch, length), generator=g, device=DEVICE)
    completion = torch.zeros(batch, length, dtype=torch.bool, device=DEVICE)
    completion[:, length // 4:] = True

    def call():
        with _Backend(MASK_PROVIDERS[provider]):
            return stratified_mask(ids, completion, num_strata, 7, 126336, prompt_mask_prob=PROMPT_MASK_PROB)

    call = timed(call)
    benchmark.pedantic(call, **rounds(quick=3, full=20))
    s = ids.element_size()
    record.add(
        benchmark, op="stratified_mask", mode="fwd", provider=provider, shape=f"B={batch},L={length},K={num_strata}",
        dtype=ids.dtype, bytes=batch * length * (s + 1 + 1 + 8) + num_strata * batch * length * s,
        formula="B*L*(s+10) + K*B*L*s", peak_mb=peak_mb(call),
    )


def _head_model(vocab, hidden_size):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    embedding = nn.Embedding(vocab, hidden_size, device=DEVICE, dtype=DTYPE)
    head = nn.Linear(hidden_size, vocab, bias=False, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(vocab, hidden_size, generator=g, device=DEVICE))
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=g, device=DEVICE) / hidden_size**0.5)
    module = nn.ModuleDict({"embedding": embedding, "head": head})
    return MaskedLM(lambda ids, _: embedding(ids), head.weight, None, vocab - 1, module=module)


def _eager_one_step(lm, ids, completion):
    logits = lm.module["head"](lm.hidden(ids.masked_fill(completion, lm.mask_id), None))
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    return logp * completion


ESTIMATORS = {
    "one_step_eager": _eager_one_step,
    "one_step": lambda lm, ids, c: one_step_logprob(lm, ids, c, seed=0),
    "sml_k4": lambda lm, ids, c: stratified_logprob(lm, ids, c, num_strata=4, seed=0),
}


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("provider", list(ESTIMATORS))
@pytest.mark.parametrize("batch,length,completion_length,vocab,hidden_size", HEAD_SHAPES)
def test_estimator_head(benchmark, record, provider, mode, batch, length, completion_length, vocab, hidden_size):
    lm = _head_model(vocab, hidden_size)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    ids = torch.randint(0, vocab - 1, (batch, length), generator=g, device=DEVICE)
    completion = torch.zeros(batch, length, dtype=torch.bool, device=DEVICE)
    completion[:, length - completion_length:] = True
    estimator = ESTIMATORS[provider]
    params = list(lm.module.parameters())
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return estimator(lm, ids, completion)
    else:
        def call():
            return torch.autograd.grad(estimator(lm, ids, completion).sum(), params)
    call = timed(call)
    benchmark.pedantic(call, **rounds(quick=3, full=10))
    n = batch * completion_length
    record.add(
        benchmark, op="estimator_head", mode=mode, provider=provider,
        shape=f"B={batch},L={length},C={completion_length},V={vocab},H={hidden_size}", dtype=DTYPE,
        flops=(2 if mode == "fwd" else 6) * n * vocab * hidden_size,
        formula="2*N*V*H, N=B*C" if mode == "fwd" else "6*N*V*H, N=B*C", peak_mb=peak_mb(call),
    )
