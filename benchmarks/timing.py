"""Time one callable: the median and the 20th / 80th percentiles of its duration in milliseconds.

On CUDA this is ``triton.testing.do_bench``: CUDA events around each call, the L2 cache flushed
before every repetition, after warm-up calls. On CPU it is a wall-clock twin: warm-up calls, then
repetitions until a time target is met. Either way the first call (compilation, autotuning, lazy
imports) is never timed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

QUANTILES = (0.5, 0.2, 0.8)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float

    def fields(self) -> dict:
        """The row fields: ``ms`` (median), ``ms_p20``, ``ms_p80``."""
        return {"ms": self.median_ms, "ms_p20": self.p20_ms, "ms_p80": self.p80_ms}


def _quantiles(samples: list[float]) -> Timing:
    median, p20, p80 = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return Timing(median, p20, p80)


def _one_call_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def measure(fn, device: torch.device, *, target_ms: float = 100.0, min_reps: int = 5, max_ms: float = 3000.0) -> Timing:
    """Time ``fn()`` on ``device``.

    After a first untimed call, the repetitions aim at ``target_ms`` of timed work and at least
    ``min_reps`` repetitions, without spending more than about ``max_ms`` on them.
    """
    fn()
    estimate = max(_one_call_ms(fn, device), 1e-3)
    budget = min(max(target_ms, min_reps * estimate), max(max_ms, estimate))
    if device.type == "cuda":
        from triton.testing import do_bench

        median, p20, p80 = do_bench(fn, warmup=max(25.0, estimate), rep=budget, quantiles=list(QUANTILES))
        return Timing(median, p20, p80)
    reps = max(1, int(budget / estimate))
    return _quantiles([_one_call_ms(fn, device) for _ in range(reps)])


def peak_mb(fn, device: torch.device) -> float | None:
    """CUDA allocator peak of one call of ``fn`` above what was allocated before it; None on CPU
    (CPU peaks are measured in fresh processes by the ``memory_*.py`` scripts)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20
