"""Time one callable: the median and the 20th / 80th percentiles of its duration in milliseconds.

One procedure for ``run.py`` and for the pytest-benchmark suite (``test_suites.py``), which hands
``Plan.clock`` and ``Plan.flush`` to ``benchmark.pedantic``:

- the first call (compilation, autotuning, lazy imports) is never timed; on CUDA further untimed
  calls follow until 25 ms have run (clocks ramp up);
- the number of timed rounds aims at ``target_ms`` of timed work and at least ``min_reps`` rounds,
  without spending much more than ``max_ms``;
- on CUDA each round is read on the GPU's own timeline (a CUDA event recorded and waited for
  before and after the call) after the L2 cache is flushed by zeroing a 256 MB buffer, as
  ``triton.testing.do_bench`` does. A round therefore includes the launch of the call's first
  kernel (a few microseconds, nothing next to the milliseconds of the full shapes). On CPU a round
  is wall-clock time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

QUANTILES = (0.5, 0.2, 0.8)
CUDA_WARMUP_MS = 25.0
MAX_ROUNDS = 2000
L2_FLUSH_BYTES = 256 << 20  # above the L2 of every current GPU (H100: 50 MB)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float

    def fields(self) -> dict:
        """The row fields: ``ms`` (median), ``ms_p20``, ``ms_p80``."""
        return {"ms": self.median_ms, "ms_p20": self.p20_ms, "ms_p80": self.p80_ms}

    @classmethod
    def of_seconds(cls, samples: list[float]) -> "Timing":
        ms = torch.tensor(samples, dtype=torch.float64) * 1e3
        median, p20, p80 = ms.quantile(torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        return cls(median, p20, p80)


def cuda_event_clock() -> Callable[[], float]:
    """A clock in seconds on the GPU's timeline: each reading records a CUDA event and waits for it.

    Successive readings are summed in float64 from event to event, so a long session keeps the
    resolution of one interval (``elapsed_time`` is float32 milliseconds)."""
    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        e.synchronize()
        return e

    state = {"last": event(), "seconds": 0.0}

    def cuda_event_clock() -> float:
        now = event()
        state["seconds"] += state["last"].elapsed_time(now) / 1e3
        state["last"] = now
        return state["seconds"]

    return cuda_event_clock


def l2_flush(device: torch.device) -> Callable[[], None] | None:
    """What runs before each round on CUDA: zero a buffer larger than the L2 cache. None on CPU."""
    if device.type != "cuda":
        return None
    buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)

    def flush() -> None:
        buffer.zero_()

    return flush


@dataclass(frozen=True)
class Plan:
    """How to time one callable: its clock, what runs untimed before each round, how many rounds."""

    clock: Callable[[], float]
    flush: Callable[[], None] | None
    rounds: int


def plan(fn, device: torch.device, *, target_ms: float = 100.0, min_reps: int = 5, max_ms: float = 3000.0) -> Plan:
    """Warm ``fn`` up and choose the rounds (see the module's docstring)."""
    clock = cuda_event_clock() if device.type == "cuda" else time.perf_counter
    fn()
    start = clock()
    fn()
    estimate_ms = max((clock() - start) * 1e3, 1e-3)
    if device.type == "cuda":
        for _ in range(int(CUDA_WARMUP_MS / estimate_ms)):
            fn()
    budget = min(max(target_ms, min_reps * estimate_ms), max(max_ms, estimate_ms))
    return Plan(clock, l2_flush(device), min(MAX_ROUNDS, max(1, int(budget / estimate_ms))))


def run_plan(fn, p: Plan) -> Timing:
    """Time ``p.rounds`` calls of ``fn`` (what ``benchmark.pedantic`` does with the same plan)."""
    samples = []
    for _ in range(p.rounds):
        if p.flush is not None:
            p.flush()
        start = p.clock()
        fn()
        samples.append(p.clock() - start)
    return Timing.of_seconds(samples)


def budget(size: str, *, ceiling: bool = False) -> dict:
    """The timing budget of a case (or of a ceiling measured beside it) at benchmark ``size``:
    smoke runs only check that the harness runs; ceilings are cheap calls measured many times."""
    if size == "smoke":
        return {"target_ms": 10.0, "min_reps": 1}
    if ceiling:
        return {"target_ms": 100.0, "min_reps": 3, "max_ms": 1000.0}
    return {"target_ms": 100.0 if size == "full" else 300.0, "min_reps": 5}


def measure(fn, device: torch.device, **budget) -> Timing:
    """Time ``fn()`` on ``device``; ``budget``: ``target_ms``, ``min_reps``, ``max_ms`` of :func:`plan`."""
    return run_plan(fn, plan(fn, device, **budget))


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
