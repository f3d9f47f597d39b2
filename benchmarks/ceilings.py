"""Measured ceilings of the device the benchmarks run on: copy bandwidth and matmul rate.

Achieved GB/s and TFLOP/s are reported next to these, measured in the same run.
"""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, *, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy of ``nbytes``: read + write bytes over the time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / ms / 1e6


def matmul_tflops(device: torch.device, size: int, dtype: torch.dtype) -> float:
    """Square ``size`` matmul in ``dtype``: 2 * size^3 FLOPs over the time."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device)
    return 2 * size**3 / ms / 1e9


def measure(device: torch.device, quick: bool) -> dict:
    if device.type == "cuda":
        return {
            "copy_gbps": copy_bandwidth_gbps(device, 2 << 30),
            "matmul_tflops": matmul_tflops(device, 8192, torch.bfloat16),
            "matmul_dtype": "bfloat16",
        }
    return {
        "copy_gbps": copy_bandwidth_gbps(device, (64 if quick else 256) << 20),
        "matmul_tflops": matmul_tflops(device, 512 if quick else 1024, torch.float32),
        "matmul_dtype": "float32",
    }
