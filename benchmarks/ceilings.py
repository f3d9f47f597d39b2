"""The ceilings of the device, measured beside every case they judge.

- copy: a device-to-device copy, read + write bytes over the time (GB/s).
- read: a sum over the same buffer, read bytes over the time (GB/s). A kernel that only reads
  streams faster than a copy, which also writes (on an H100 by several percent), so a row counted
  as read-only bytes (``Work.read_only``) is held to this one; other byte rows to ``copy``.
- matmul: the best rate, ``2*m*n*k`` FLOPs over the time (TFLOP/s), over several products: two
  square ones and the products the case itself makes (``Case.gemms``); rows counted in FLOPs.

Sizes: GPU 1 GiB buffers and bfloat16 squares at n = 4096 and 8192; CPU 256 MiB (well past the
last-level cache) and float32 squares at n = 1024 and 2048 (this project's 2-core development
machine's BLAS gives about 130 and 190 GFLOP/s there). No one shape is the fastest for every BLAS
and load: a case's own products (a head's ``[N, H] @ [H, V]`` with H = 256, say) can run faster
than a square one, so a ceiling that leaves them out is not an upper bound of what the case can
reach. Smoke runs (the test suite's check that the harness runs) use toy sizes, so their
percentages mean nothing.

A machine's rate drifts with its temperature, its clocks and its neighbours, so the ceiling a row
is held to is measured around that row, right before and right after it, with the same timing
procedure (``timing.py``), and the better of the two is kept (:func:`around`). A row above 100 % of
a ceiling measured so is a counting bug.
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


def matmul_shapes(device: torch.device, size: str, gemms=()) -> list[tuple[int, int, int]]:
    """The ``(m, n, k)`` products the matmul ceiling is the best of: two squares and ``gemms``."""
    n = 256 if size == "smoke" else 8192 if device.type == "cuda" else 2048
    shapes = [(n, n, n)] if size == "smoke" else [(n // 2, n // 2, n // 2), (n, n, n)]
    return shapes + [tuple(g) for g in dict.fromkeys(gemms) if tuple(g) not in shapes]


def _matmul(m: int, n: int, k: int, device: torch.device, size: str) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    work = Work("2*m*n*k", 2 * m * n * k)
    timing = measure(lambda: torch.matmul(a, b, out=out), device, **budget(size, ceiling=True))
    return {"op": "ceiling", "mode": "fwd", "provider": "matmul", "shape": f"m={m},n={n},k={k}",
            "dtype": str(dtype).removeprefix("torch."), "flops_formula": work.formula, "flops": work.value,
            **timing.fields(), "tflops": work.value / timing.median_ms / 1e9}


def measure_ceiling(name: str, device: torch.device, size: str, gemms=()) -> dict:
    """One measurement of ceiling ``name``: a row with ``op="ceiling"``, ``provider=name``, its
    timing, its counted work and its rate (``gbps`` or ``tflops``). The matmul ceiling is the best of
    :func:`matmul_shapes` (``gemms``: the case's own products); its row names that shape and lists
    every shape's rate in ``candidates``."""
    if name == "matmul":
        measured = [_matmul(m, n, k, device, size) for m, n, k in matmul_shapes(device, size, gemms)]
        return {**max(measured, key=lambda r: r["tflops"]),
                "candidates": {r["shape"]: r["tflops"] for r in measured}}
    nbytes, dtype = _buffer_bytes(device, size), torch.float32
    src = torch.full((nbytes // 4,), 1.0, dtype=dtype, device=device)
    if name == "copy":
        dst = torch.empty_like(src)
        work, fn = Work(f"2*bytes, bytes={nbytes}", 2 * nbytes), lambda: dst.copy_(src)
    elif name == "read":
        work, fn = Work(f"bytes, bytes={nbytes}", nbytes, read_only=True), src.sum
    else:
        raise ValueError(f"name must be one of {NAMES}, got {name!r}")
    timing = measure(fn, device, **budget(size, ceiling=True))
    return {"op": "ceiling", "mode": "fwd", "provider": name, "shape": f"bytes={nbytes}", "dtype": "float32",
            "bytes_formula": work.formula, "bytes": work.value, **timing.fields(), "gbps": work.value / timing.median_ms / 1e6}


def around(case: Case, device: torch.device, size: str, run_case):
    """Measure the ceiling that judges ``case``, then ``run_case()``, then the ceiling again;
    returns ``(run_case()'s value, the better ceiling measurement)`` (its ``around`` lists both
    rates, before and after)."""
    before = measure_ceiling(held_to(case), device, size, case.gemms)
    value = run_case()
    return value, better(before, measure_ceiling(held_to(case), device, size, case.gemms))


def better(before: dict, after: dict) -> dict:
    """The better of two measurements of one ceiling, with ``around``: both rates, before and after."""
    unit = UNIT[before["provider"]]
    return {**max(before, after, key=lambda r: r[unit]), "around": [before[unit], after[unit]]}


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
