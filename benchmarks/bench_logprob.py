"""gather_logprob and linear_logprob against eager PyTorch, torch.compile, Liger-Kernel, Cut
Cross-Entropy and TRL's own (see ``providers.py``).

Full shapes (a GPU, bfloat16): LLaDA's head, V = 126,464 and H = 4,096, with N = 4k to 32k
selected rows, then V = 32,000 and 152,064. Quick shapes (a CPU, float32) are small.

Useful work, counted explicitly (``s`` = bytes per logit element):
- gather fwd: one read of the N selected rows, ``N*V*s`` (read only: held to the read ceiling);
  fwd+bwd adds the backward's read and
  write of those rows, ``3*N*V*s`` (targets, outputs and softmax statistics are O(N), left out).
- linear fwd: ``2*N*V*H`` FLOPs; fwd+bwd: ``6*N*V*H`` (forward and the two gradient GEMMs; a
  fused op's recomputation of the logits in backward is extra work it pays, not counted).
- head_gemm (GPU only): one vocabulary chunk of ``linear_logprob``'s fused forward, the Triton
  kernel that computes the chunk's logits and their block statistics (``daca``), against the
  library's GEMM of the same product (``library``, bfloat16 out): ``2*N*C*H`` FLOPs, C the chunk's
  head rows. Its ``daca`` row's share of the matmul ceiling is the rate of Triton's GEMM against
  the library's, which ``python -m daca_kernels.tools.roofline --triton-gemm-fraction`` takes in
  place of its assumption.
"""
from __future__ import annotations

import torch
from case import Case, Work, head_gemms, pick
from providers import LINEAR, available, gather_providers

from daca_kernels.tools.roofline import LLADA

MODES = ("fwd", "fwd+bwd")
GATHER_PROVIDERS = ("daca", "daca_torch", "eager", "compile", "liger", "trl")
LINEAR_PROVIDERS = ("daca", "daca_torch", "eager", "compile", "liger", "cce", "trl")


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _gather_setup(fn, mode, n, vocab, dtype, device):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        # One spare row after the N scored ones (see providers.liger_gather_fwd).
        storage = (torch.randn(n + 1, vocab, generator=g, device=device) * 3).to(dtype)
        logits = storage[:n].requires_grad_(mode == "fwd+bwd")
        targets = torch.randint(0, vocab, (n,), generator=g, device=device)
        if mode == "fwd":
            return lambda: fn(logits, targets)
        return lambda: torch.autograd.grad(fn(logits, targets).sum(), logits)

    return setup


def _linear_setup(fn, mode, n, vocab, hidden_size, dtype, device):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        grad = mode == "fwd+bwd"
        hidden = torch.randn(n, hidden_size, generator=g, device=device).to(dtype).requires_grad_(grad)
        weight = (torch.randn(vocab, hidden_size, generator=g, device=device) / hidden_size**0.5).to(dtype)
        weight.requires_grad_(grad)
        targets = torch.randint(0, vocab, (n,), generator=g, device=device)
        if mode == "fwd":
            return lambda: fn(hidden, weight, targets)
        return lambda: torch.autograd.grad(fn(hidden, weight, targets).sum(), (hidden, weight))

    return setup


def _head_gemm_setup(provider, n, chunk, hidden_size, dtype, device):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(n, hidden_size, generator=g, device=device).to(dtype)
        weight = (torch.randn(chunk, hidden_size, generator=g, device=device) / hidden_size**0.5).to(dtype)
        if provider == "library":
            out = torch.empty(n, chunk, dtype=dtype, device=device)
            return lambda: torch.matmul(hidden, weight.T, out=out)
        from daca_kernels.kernels.linear_logprob import head_stats_parts

        targets = torch.randint(0, chunk, (n,), generator=g, device=device)
        return lambda: head_stats_parts(hidden, weight, None, targets, 1.0, False)

    return setup


def cases(size: str, device: torch.device) -> list[Case]:
    dtype = _dtype(device)
    element = torch.empty((), dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    smoke = size == "smoke"
    llada = [(n, 126464) for n in (4096, 16384, 32768)]
    others = [(n, v) for v in (32000, 152064) for n in (4096, 16384, 32768)]
    gather_shapes = pick(size, smoke=[(16, 512)], quick=[(512, 32000), (2048, 32000)], full=llada + others)
    linear_shapes = pick(size, smoke=[(16, 512, 32)], quick=[(512, 32000, 256), (2048, 32000, 256)],
                         full=[(n, v, 4096) for n, v in llada + others])
    out = []
    if device.type == "cuda" and torch.version.hip is None and not smoke:
        # One chunk of the head the static model takes (daca_kernels.tools.roofline): LLaDA's.
        n, chunk, hidden_size = LLADA.rows, LLADA.vocab_chunk, LLADA.hidden
        for provider in ("daca", "library"):
            out.append(Case("head_gemm", "fwd", provider, f"N={n},C={chunk},H={hidden_size}", name,
                            _head_gemm_setup(provider, n, chunk, hidden_size, dtype, device),
                            flops=Work("2*N*C*H", 2 * n * chunk * hidden_size), priority=0.05,
                            gemms=((n, chunk, hidden_size),)))
    for rank, (n, vocab) in enumerate(gather_shapes):
        for mode in MODES:
            fns = gather_providers(mode)
            for provider in GATHER_PROVIDERS:
                if not available(provider, device, smoke=smoke):
                    continue
                out.append(Case(
                    "gather_logprob", mode, provider, f"N={n},V={vocab}", name,
                    _gather_setup(fns[provider], mode, n, vocab, dtype, device),
                    bytes=Work("N*V*s" if mode == "fwd" else "3*N*V*s", (1 if mode == "fwd" else 3) * n * vocab * element,
                               read_only=mode == "fwd"),
                    priority=rank,
                ))
    for rank, (n, vocab, hidden_size) in enumerate(linear_shapes):
        for mode in MODES:
            for provider in LINEAR_PROVIDERS:
                if not available(provider, device, smoke=smoke):
                    continue
                out.append(Case(
                    "linear_logprob", mode, provider, f"N={n},V={vocab},H={hidden_size}", name,
                    _linear_setup(LINEAR[provider], mode, n, vocab, hidden_size, dtype, device),
                    flops=Work("2*N*V*H" if mode == "fwd" else "6*N*V*H", (2 if mode == "fwd" else 6) * n * vocab * hidden_size),
                    priority=rank + 0.1, gemms=head_gemms(n, vocab, hidden_size, mode),
                ))
    return out
