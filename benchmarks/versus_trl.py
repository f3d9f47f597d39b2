"""linear_logprob against TRL's own chunked head (``trl.kernels.ChunkedLogProbFunction``), side by side:
time of the forward and of the forward+backward, and peak memory of the forward+backward, at the
same shapes in one run, with the ratios.

    python benchmarks/versus_trl.py [--shape 4096,32000,256 --shape 2048,126464,256] [--dtype float32]

Times come from ``timing.measure`` in this process, alternating the two providers shape by shape;
peak memory from ``memory_linear_logprob`` (each case in a fresh process on CPU: RSS above the
inputs; CUDA: allocator peak). On a CPU this compares the chunked PyTorch path of
``linear_logprob`` with TRL's torch fallback (TRL's Triton fold runs on CUDA only). TRL is called
as its trainer calls it: vocabulary tiles of 32,768 (``providers.TRL_VOCAB_CHUNK``) and token tiles
of 4,096 rows. Prints a markdown table; writes no rows.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# On a CPU the chunked PyTorch path, never the Triton interpreter.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from memory_linear_logprob import _inputs, measure  # noqa: E402
from providers import LINEAR  # noqa: E402
from results import device_name  # noqa: E402
from timing import measure as time_call  # noqa: E402

PROVIDERS = ("daca", "trl")


def _call(provider: str, mode: str, inputs):
    hidden, weight, targets = inputs
    fn = LINEAR[provider]
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(hidden, weight, targets)
    else:
        def call():
            return torch.autograd.grad(fn(hidden, weight, targets).sum(), (hidden, weight))
    return call


def compare(n: int, vocab: int, hidden: int, device: str, dtype: str) -> dict:
    """``{(provider, "fwd" | "fwd+bwd"): median ms}`` and ``{(provider, "peak"): MB}``."""
    out = {}
    inputs = _inputs(n, vocab, hidden, device, dtype)()
    for mode in ("fwd", "fwd+bwd"):
        for provider in PROVIDERS:
            out[provider, mode] = time_call(_call(provider, mode, inputs), torch.device(device),
                                            target_ms=1000, min_reps=5, max_ms=10000).median_ms
    del inputs
    peaks = measure(n, vocab, hidden, device, dtype, PROVIDERS)
    out.update(((provider, "peak"), mb) for provider, mb in peaks.items())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="N,V,H (repeatable; default 4096,32000,256 and 2048,126464,256)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in (a.shape or ["4096,32000,256", "2048,126464,256"])]
    if a.device == "cpu":
        os.environ["DACA_BACKEND"] = "torch"
    print(f"linear_logprob against TRL's ChunkedLogProbFunction on {device_name(torch.device(a.device))}, "
          f"{a.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| N | V | H | fwd ms daca | fwd ms trl | trl/daca | fwd+bwd ms daca | fwd+bwd ms trl | trl/daca "
          "| peak MB daca | peak MB trl | trl/daca |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, vocab, hidden in shapes:
        r = compare(n, vocab, hidden, a.device, a.dtype)
        cells = []
        for key in ("fwd", "fwd+bwd", "peak"):
            cells += [f"{r['daca', key]:.1f}", f"{r['trl', key]:.1f}", f"{r['trl', key] / r['daca', key]:.2f}"]
        print(f"| {n} | {vocab} | {hidden} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
