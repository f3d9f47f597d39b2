"""gather_logprob and linear_logprob against eager PyTorch, torch.compile and Liger-Kernel.

    DACA_BENCH_QUICK=1 pytest benchmarks/bench_logprob.py   # small CPU shapes
    pytest benchmarks/bench_logprob.py                      # DESIGN 5 shapes (GPU)

Bytes and FLOPs are counted explicitly (``s`` = bytes per logit element):
- gather fwd: read the N selected rows once: ``N*V*s``; fwd+bwd adds the backward's read and
  write of those rows: ``3*N*V*s`` (targets, outputs and log-sum-exp are O(N), left out).
- linear fwd: ``2*N*V*H`` FLOPs; fwd+bwd: ``6*N*V*H`` (forward + the two gradient GEMMs; the
  chunked op's recompute of the logits is extra work it pays, not counted as useful FLOPs).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import DEVICE, SMOKE, peak_mb, rounds, shapes, timed
from daca_kernels import gather_logprob, linear_logprob

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None

GATHER_SHAPES = shapes(
    quick=[(256, 4096), (256, 32000)],
    full=[(n, v) for v in (32000, 126464, 152064) for n in (4096, 16384, 32768)],
)
LINEAR_SHAPES = shapes(
    quick=[(512, 4096, 256), (512, 32000, 256)],
    full=[(n, v, 4096) for v in (32000, 126464, 152064) for n in (4096, 16384)],
)
PROVIDERS = ["daca", "eager"] + ([] if SMOKE else ["compile"]) + (["liger"] if HAS_LIGER and DEVICE.type == "cuda" else [])


def eager_gather(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def eager_linear(hidden, weight, targets):
    return eager_gather(hidden @ weight.T, targets)


def daca_gather(logits, targets):
    return gather_logprob(logits, targets)


_compiled = {}


def compiled(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


def liger_gather(logits, targets):
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

    # Liger's op (no backward) takes [B, L + 1, V] logits of which the first L rows are scored:
    # the inputs are allocated with one spare row so this is a view, not a copy.
    padded = logits.as_strided((1, logits.shape[0] + 1, logits.shape[1]), (0, logits.shape[1], 1))
    return fused_selective_log_softmax(padded, targets[None], temperature=1.0)[0]


def liger_linear(hidden, weight, targets):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return -LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, targets)


GATHER = {"daca": daca_gather, "eager": eager_gather, "compile": compiled(eager_gather), "liger": liger_gather}
LINEAR = {"daca": linear_logprob, "eager": eager_linear, "compile": compiled(eager_linear), "liger": liger_linear}


def _gather_inputs(n, vocab, requires_grad):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    # One spare row after the N scored ones (see liger_gather); every provider reads rows 0..N-1.
    storage = (torch.randn(n + 1, vocab, generator=g, device=DEVICE) * 3).to(DTYPE)
    logits = storage[:n].requires_grad_(requires_grad)
    return logits, torch.randint(0, vocab, (n,), generator=g, device=DEVICE)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n,vocab", GATHER_SHAPES)
def test_gather_logprob(benchmark, record, provider, mode, n, vocab):
    if provider == "liger" and mode == "fwd+bwd":
        pytest.skip("Liger's selective log-softmax has no backward")
    fn = GATHER[provider]
    logits, targets = _gather_inputs(n, vocab, requires_grad=mode == "fwd+bwd")
    if mode == "fwd":
        call = timed(lambda: fn(logits, targets))
    else:
        call = timed(lambda: torch.autograd.grad(fn(logits, targets).sum(), logits))
    benchmark.pedantic(call, **rounds(quick=3, full=20))
    element = logits.element_size()
    record.add(
        benchmark, op="gather_logprob", mode=mode, provider=provider, shape=f"N={n},V={vocab}", dtype=DTYPE,
        bytes=(1 if mode == "fwd" else 3) * n * vocab * element,
        formula="N*V*s" if mode == "fwd" else "3*N*V*s", peak_mb=peak_mb(call),
    )


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n,vocab,hidden_size", LINEAR_SHAPES)
def test_linear_logprob(benchmark, record, provider, mode, n, vocab, hidden_size):
    fn = LINEAR[provider]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    grad = mode == "fwd+bwd"
    hidden = torch.randn(n, hidden_size, generator=g, device=DEVICE).to(DTYPE).requires_grad_(grad)
    weight = (torch.randn(vocab, hidden_size, generator=g, device=DEVICE) / hidden_size**0.5).to(DTYPE).requires_grad_(grad)
    targets = torch.randint(0, vocab, (n,), generator=g, device=DEVICE)
    if mode == "fwd":
        call = timed(lambda: fn(hidden, weight, targets))
    else:
        call = timed(lambda: torch.autograd.grad(fn(hidden, weight, targets).sum(), (hidden, weight)))
    benchmark.pedantic(call, **rounds(quick=3, full=10))
    record.add(
        benchmark, op="linear_logprob", mode=mode, provider=provider, shape=f"N={n},V={vocab},H={hidden_size}",
        dtype=DTYPE, flops=(2 if mode == "fwd" else 6) * n * vocab * hidden_size,
        formula="2*N*V*H" if mode == "fwd" else "6*N*V*H", peak_mb=peak_mb(call),
    )
