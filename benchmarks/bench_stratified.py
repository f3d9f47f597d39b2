"""The mask kernel, and SML against the one-step estimator on an LM head.

``stratified_mask`` (providers: ``daca`` = the default dispatch, Triton on a GPU; ``daca_torch``
= the chunked PyTorch path, GPU runs only; ``reference`` = the plain reference through
``DACA_BACKEND=reference``, where its ``O(L^2)`` ranking fits), d1's prompt masking on (p = 0.15).
Bytes: read ids, maskable and prompt, write strata and the K copies: ``B*L*(s+10) + K*B*L*s``
(``s`` = bytes per id).

Estimators on a head (``V, H``) behind a backbone that is only an embedding lookup, so the time is
the head's: ``one_step_eager`` (full ``[B, L, V]`` logits, ``log_softmax``, gather: what trainers
do today), ``one_step`` (``one_step_logprob``) and ``sml_k4`` (``stratified_logprob``, K = 4).
FLOPs count the useful head work on the ``N = B*C`` completion rows: ``2*N*V*H`` forward,
``6*N*V*H`` forward+backward (eager also multiplies the prompt rows, and the fused path
recomputes logits in backward: extra work each pays, not counted). SML's K passes each send only
their stratum's rows through the head, N rows in all, so its useful head work is the same.
"""
from __future__ import annotations

import torch
from case import Case, Work, head_gemms, pick
from providers import available, forced_backend
from torch import nn

from daca_kernels import one_step_logprob, stratified_logprob, stratified_mask
from daca_kernels.models.masked_lm import MaskedLM

PROMPT_MASK_PROB = 0.15
NUM_STRATA = 4
MASK_BACKENDS = {"daca": None, "daca_torch": "torch", "reference": "reference"}


def _mask_setup(backend, batch, length, num_strata, device):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, 126000, (batch, length), generator=g, device=device)
        completion = torch.zeros(batch, length, dtype=torch.bool, device=device)
        completion[:, length // 4:] = True

        def call():
            with forced_backend(backend):
                return stratified_mask(ids, completion, num_strata, 7, 126336, prompt_mask_prob=PROMPT_MASK_PROB)

        return call

    return setup


def _head_model(vocab, hidden_size, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    embedding = nn.Embedding(vocab, hidden_size, device=device, dtype=dtype)
    head = nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(vocab, hidden_size, generator=g, device=device))
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=g, device=device) / hidden_size**0.5)
    module = nn.ModuleDict({"embedding": embedding, "head": head})
    return MaskedLM(lambda ids, _: embedding(ids), head.weight, None, vocab - 1, module=module)


def _eager_one_step(lm, ids, completion):
    logits = lm.module["head"](lm.hidden(ids.masked_fill(completion, lm.mask_id), None))
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    return logp * completion


ESTIMATORS = {
    "one_step_eager": _eager_one_step,
    "one_step": lambda lm, ids, c: one_step_logprob(lm, ids, c, seed=0),
    "sml_k4": lambda lm, ids, c: stratified_logprob(lm, ids, c, num_strata=NUM_STRATA, seed=0),
}


def _estimator_setup(estimator, mode, batch, length, completion_length, vocab, hidden_size, dtype, device):
    def setup():
        lm = _head_model(vocab, hidden_size, dtype, device)
        g = torch.Generator(device=device).manual_seed(1)
        ids = torch.randint(0, vocab - 1, (batch, length), generator=g, device=device)
        completion = torch.zeros(batch, length, dtype=torch.bool, device=device)
        completion[:, length - completion_length:] = True
        params = list(lm.module.parameters())
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    return estimator(lm, ids, completion)
        else:
            def call():
                return torch.autograd.grad(estimator(lm, ids, completion).sum(), params)
        return call

    return setup


def cases(size: str, device: torch.device) -> list[Case]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mask_shapes = pick(size, smoke=[(2, 64, 4)], quick=[(8, 512, 4), (32, 1024, 4)],
                       full=[(64, 1024, 4), (256, 2048, 4), (64, 4096, 8)])
    # (B, L, C, V, H); full: LLaDA's head, N = B*C = 4096 and 16384 completion rows after a 64-token prompt.
    head_shapes = pick(size, smoke=[(2, 16, 8, 512, 32)], quick=[(4, 128, 96, 32000, 128), (16, 128, 96, 32000, 128)],
                       full=[(16, 320, 256, 126464, 4096), (64, 320, 256, 126464, 4096)])
    out = []
    for rank, (batch, length, num_strata) in enumerate(mask_shapes):
        for provider, backend in MASK_BACKENDS.items():
            if provider == "daca_torch" and not available(provider, device):
                continue
            if provider == "reference" and batch * length * length > 1 << 26:
                continue  # the reference's pairwise ranking does not fit at this shape
            s = 8  # int64 ids
            out.append(Case(
                "stratified_mask", "fwd", provider, f"B={batch},L={length},K={num_strata}", "int64",
                _mask_setup(backend, batch, length, num_strata, device),
                bytes=Work("B*L*(s+10) + K*B*L*s", batch * length * (s + 10) + num_strata * batch * length * s),
                priority=rank + 0.5,
            ))
    for rank, (batch, length, completion_length, vocab, hidden_size) in enumerate(head_shapes):
        n = batch * completion_length
        for mode in ("fwd", "fwd+bwd"):
            for provider, estimator in ESTIMATORS.items():
                factor = 2 if mode == "fwd" else 6
                out.append(Case(
                    "estimator_head", mode, provider,
                    f"B={batch},L={length},C={completion_length},V={vocab},H={hidden_size}", str(dtype).removeprefix("torch."),
                    _estimator_setup(estimator, mode, batch, length, completion_length, vocab, hidden_size, dtype, device),
                    flops=Work(f"{factor}*N*V*H, N=B*C", factor * n * vocab * hidden_size),
                    priority=rank + 0.2, gemms=head_gemms(n, vocab, hidden_size, mode),
                ))
    return out
