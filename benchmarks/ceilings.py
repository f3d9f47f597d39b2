"""The ceilings of the device, measured in the same run as the rows they judge.

- copy: a device-to-device copy, read + write bytes over the time (GB/s). GPU: 1 GiB; CPU: 256 MiB
  (well past the last-level cache).
- matmul: a square matmul, ``2*n^3`` FLOPs over the time (TFLOP/s). GPU: bfloat16 at n = 8192;
  CPU: float32 at n = 2048, where this project's 2-core development machine's BLAS is at its
  plateau (about 190 GFLOP/s there; 1024 gives about 130, 3072 about 165).

A row counted in bytes is judged against ``copy``, a row counted in FLOPs against ``matmul``.
"""
from __future__ import annotations

import torch

from case import Work
from timing import Timing, measure


def _copy(device: torch.device) -> tuple[Work, Timing]:
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), device, target_ms=500, min_reps=10)
    return Work(f"2*bytes, bytes={nbytes}", 2 * nbytes), timing


def _matmul(device: torch.device) -> tuple[str, Work, Timing, str]:
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timing = measure(lambda: a @ b, device, target_ms=500, min_reps=10)
    return f"n={size}", Work("2*n^3", 2 * size**3), timing, str(dtype).removeprefix("torch.")


def measure_ceilings(device: torch.device) -> list[dict]:
    """Row fields of the two ceilings: ``op="ceiling"``, provider ``copy`` / ``matmul``, with their
    timings and rates (``gbps`` or ``tflops``)."""
    copy_work, copy_time = _copy(device)
    shape, mm_work, mm_time, mm_dtype = _matmul(device)
    return [
        {"op": "ceiling", "mode": "fwd", "provider": "copy", "shape": f"bytes={copy_work.value // 2}", "dtype": "float32",
         "bytes_formula": copy_work.formula, "bytes": copy_work.value, **copy_time.fields(),
         "gbps": copy_work.value / copy_time.median_ms / 1e6},
        {"op": "ceiling", "mode": "fwd", "provider": "matmul", "shape": shape, "dtype": mm_dtype,
         "flops_formula": mm_work.formula, "flops": mm_work.value, **mm_time.fields(),
         "tflops": mm_work.value / mm_time.median_ms / 1e9},
    ]
