"""Peak memory of linear_logprob forward+backward against eager ``log_softmax(hidden @ W.T).gather``
and, where trl is installed, TRL's own chunked head (``providers.trl_linear``).

    python benchmarks/memory_linear_logprob.py [--n 4096 --vocab 32000 --hidden 256]

Each case runs in a fresh process (CPU: peak RSS above the inputs; CUDA: allocator peak). The
chunked path must stay at or below a quarter of eager. Prints a table and writes result rows.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peak_memory import measure_cpu_subprocess, measure_in_this_process  # noqa: E402
from providers import available, trl_linear  # noqa: E402
from results import device_dir, environment_stamp, write_rows  # noqa: E402

from daca_kernels import linear_logprob  # noqa: E402


def _inputs(n, vocab, hidden, device="cpu", dtype="float32"):
    def setup():
        g = torch.Generator(device=device).manual_seed(0)
        dt = getattr(torch, dtype)
        h = torch.randn(n, hidden, generator=g, device=device, dtype=dt, requires_grad=True)
        w = (torch.randn(vocab, hidden, generator=g, device=device, dtype=dt) / hidden**0.5).requires_grad_()
        t = torch.randint(0, vocab, (n,), generator=g, device=device)
        return h, w, t

    return setup


def _eager(h, w, t):
    logp = torch.log_softmax((h @ w.T).float(), dim=-1).gather(1, t[:, None]).squeeze(1)
    torch.autograd.grad(logp.sum(), (h, w))


def _fused(h, w, t):
    torch.autograd.grad(linear_logprob(h, w, t).sum(), (h, w))


def _trl(h, w, t):
    torch.autograd.grad(trl_linear(h, w, t).sum(), (h, w))


CASES = {
    "eager": lambda **a: (_inputs(**a), _eager),
    "daca": lambda **a: (_inputs(**a), _fused),
    "trl": lambda **a: (_inputs(**a), _trl),
}


def providers(device: str) -> tuple[str, ...]:
    """The cases that run on ``device`` here (``trl`` only where trl is installed)."""
    return tuple(name for name in CASES if available(name, torch.device(device)))


def measure(n: int, vocab: int, hidden: int, device: str = "cpu", dtype: str = "float32",
            names: tuple[str, ...] = ("eager", "daca")) -> dict:
    """Peak MB above the inputs for each provider in ``names``."""
    args = {"n": n, "vocab": vocab, "hidden": hidden, "device": device, "dtype": dtype}
    if device == "cpu":
        # The chunked PyTorch path: the Triton interpreter would be the wrong thing to measure.
        env = {"DACA_BACKEND": "torch", "TRITON_INTERPRET": "0"}
        tiny = {**args, "n": 8, "vocab": 64, "hidden": 8}
        return {name: measure_cpu_subprocess("memory_linear_logprob", name, env, args, tiny) for name in names}
    return {name: measure_in_this_process(*CASES[name](**args)) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = parser.parse_args()
    peaks = measure(a.n, a.vocab, a.hidden, a.device, a.dtype, providers(a.device))
    ratio = peaks["daca"] / peaks["eager"]
    logits_mb = a.n * a.vocab * torch.tensor([], dtype=getattr(torch, a.dtype)).element_size() / 2**20
    print(f"linear_logprob fwd+bwd peak memory above inputs, N={a.n} V={a.vocab} H={a.hidden} {a.dtype} on {a.device}")
    print(f"  (one [N, V] logits tensor in {a.dtype} = {logits_mb:.0f} MB)")
    for name, mb in peaks.items():
        print(f"  {name:6s} {mb:9.1f} MB ({mb / peaks['eager']:.3f} of eager)")
    print(f"  daca / eager = {ratio:.3f} ({'within' if ratio <= 0.25 else 'ABOVE'} the 1/4 bound)")
    device = torch.device(a.device)
    stamp = environment_stamp(device)
    shape = f"N={a.n},V={a.vocab},H={a.hidden}"
    rows = [
        {"op": "linear_logprob", "mode": "fwd+bwd memory", "provider": name, "shape": shape, "dtype": a.dtype,
         "peak_mb": round(mb, 1), "peak_formula": "peak bytes above inputs (CPU: process RSS high-water mark)", **stamp}
        for name, mb in peaks.items()
    ]
    print(f"  rows written to {write_rows(rows, device_dir(device))}")
    if ratio > 0.25:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
