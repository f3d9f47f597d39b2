"""The ceilings of the device, measured beside every case they judge.

- copy: a device-to-device copy, read + write bytes over the time (GB/s).
- read: a sum over the same buffer, read bytes over the time (GB/s). A kernel that only reads
  streams faster than a copy, which also writes (on an H100 by several percent), so a row counted
  as read-only bytes (``Work.read_only``) is held to this one; other byte rows to ``copy``.
- matmul: a square matmul, ``2*n^3`` FLOPs over the time (TFLOP/s); rows counted in FLOPs.

Sizes: GPU 1 GiB buffers and a bfloat16 matmul at n = 8192; CPU 256 MiB (well past the last-level
cache) and float32 at n = 2048, where this project's 2-core development machine's BLAS is at its
plateau (about 190 GFLOP/s there; 1024 gives about 130, 3072 about 165). Smoke runs (the test
suite's check that the harness runs) use toy sizes, so their percentages mean nothing.

A machine's rate drifts with its temperature, its clocks and its neighbours, so the ceiling a row
is held to is measured right after that row, with the same timing procedure (``timing.py``).
"""
from __future__ import annotations

import statistics

import torch
from case import Case, Work
from timing import Timing, budget, measure

NAMES = ("copy", "read", "matmul")
UNIT = {"copy": "gbps", "read": "gbps", "matmul": "tflops"}


def held_to(case: Case) -> str:
    """The name of the ceiling that judges ``case``."""
    if case.flops is not None:
        return "matmul"
    return "read" if case.bytes.read_only else "copy"


def _buffer_bytes(device: torch.device, size: str) -> int:
    if size == "smoke":
        return 8 << 20
    return (1 << 30) if device.type == "cuda" else (256 << 20)


def measure_ceiling(name: str, device: torch.device, size: str) -> dict:
    """One measurement of ceiling ``name``: a row with ``op="ceiling"``, ``provider=name``, its
    timing, its counted work and its rate (``gbps`` or ``tflops``)."""
    if name == "matmul":
        n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
        n = 256 if size == "smoke" else n
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        shape, work, fn = f"n={n}", Work("2*n^3", 2 * n**3), lambda: a @ b
    else:
        nbytes, dtype = _buffer_bytes(device, size), torch.float32
        src = torch.full((nbytes // 4,), 1.0, dtype=dtype, device=device)
        shape = f"bytes={nbytes}"
        if name == "copy":
            dst = torch.empty_like(src)
            work, fn = Work(f"2*bytes, bytes={nbytes}", 2 * nbytes), lambda: dst.copy_(src)
        elif name == "read":
            work, fn = Work(f"bytes, bytes={nbytes}", nbytes, read_only=True), src.sum
        else:
            raise ValueError(f"name must be one of {NAMES}, got {name!r}")
    timing = measure(fn, device, **budget(size, ceiling=True))
    kind = "flops" if name == "matmul" else "bytes"
    return {"op": "ceiling", "mode": "fwd", "provider": name, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
            f"{kind}_formula": work.formula, kind: work.value, **timing.fields(),
            UNIT[name]: work.value / timing.median_ms / (1e6 if kind == "bytes" else 1e9)}


def judged(case: Case, timing: Timing, ceiling: dict, peak: float | None = None) -> dict:
    """The row of ``case``: its timing, its counted work and rate, and the ceiling measured beside
    it (``ceiling``, ``ceiling_rate`` in the row's unit, ``pct_of_ceiling``)."""
    row = {"op": case.op, "mode": case.mode, "provider": case.provider, "shape": case.shape, "dtype": case.dtype,
           **timing.fields(), "peak_mb": peak}
    if case.steps_per_call > 1:
        row["ms_per_step"] = timing.median_ms / case.steps_per_call
    if case.bytes is not None:
        row.update(bytes_formula=case.bytes.formula, bytes=case.bytes.value, gbps=case.bytes.value / timing.median_ms / 1e6)
    else:
        row.update(flops_formula=case.flops.formula, flops=case.flops.value, tflops=case.flops.value / timing.median_ms / 1e9)
    name = held_to(case)
    if ceiling["provider"] != name:
        raise ValueError(f"{case.name} is held to the {name} ceiling, not {ceiling['provider']}")
    rate = ceiling[UNIT[name]]
    row.update(ceiling=name, ceiling_rate=rate, pct_of_ceiling=100 * row[UNIT[name]] / rate)
    return row


def summary(measurements: list[dict]) -> list[dict]:
    """One row per ceiling over all its measurements in a run: the measurement with the median
    rate, with ``measurements`` (how many), ``rate_min`` and ``rate_max``."""
    rows = []
    for name in NAMES:
        taken = sorted((m for m in measurements if m["provider"] == name), key=lambda m: m[UNIT[name]])
        if taken:
            middle = taken[(len(taken) - 1) // 2]
            rows.append({**middle, "measurements": len(taken), "rate_min": taken[0][UNIT[name]],
                         "rate_max": taken[-1][UNIT[name]], "rate_median": statistics.median(m[UNIT[name]] for m in taken)})
    return rows
