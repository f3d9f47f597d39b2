"""Shared fixtures of the benchmark suites (pytest-benchmark).

``DACA_BENCH_QUICK=1`` selects the small CPU shapes (``make bench-quick``); otherwise the full
shapes of DESIGN 5 run (meant for a GPU). ``DACA_BENCH_SMOKE=1`` (used by the test suite so the
benchmarks cannot rot) runs the first quick shape once per case, without ``torch.compile``.
Each suite records rows through ``record``; at the end of the session they are merged into
``benchmarks/results/<device>.jsonl`` (or ``$DACA_BENCH_RESULTS``) with the ceilings measured in
the same run.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ceilings  # noqa: E402
from results import environment_stamp, write_rows  # noqa: E402

SMOKE = os.environ.get("DACA_BENCH_SMOKE", "0") == "1"
QUICK = SMOKE or os.environ.get("DACA_BENCH_QUICK", "0") == "1"
RESULTS = Path(os.environ.get("DACA_BENCH_RESULTS", str(Path(__file__).resolve().parent / "results")))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _significant(value: float) -> float:
    return float(f"{value:.4g}")


class Recorder:
    """Collects rows; ``add`` turns a pytest-benchmark result and a bytes/FLOPs count into a row."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[dict] = []
        self._ceilings: dict | None = None

    @property
    def ceilings(self) -> dict:
        if self._ceilings is None:
            self._ceilings = ceilings.measure(self.device, QUICK)
        return self._ceilings

    def add(self, benchmark, *, op, mode, provider, shape, dtype, bytes=None, flops=None, formula, peak_mb=None):
        ms = benchmark.stats.stats.median * 1e3
        row = {"op": op, "mode": mode, "provider": provider, "shape": shape, "dtype": str(dtype).replace("torch.", ""),
               "ms": _significant(ms), "formula": formula, "peak_mb": peak_mb, "bytes": bytes, "flops": flops}
        if bytes is not None:
            row["gbps"] = _significant(bytes / ms / 1e6)
            row["ceiling"] = f"copy {self.ceilings['copy_gbps']:.1f} GB/s"
            row["pct_of_ceiling"] = _significant(100 * row["gbps"] / self.ceilings["copy_gbps"])
        if flops is not None:
            row["tflops"] = _significant(flops / ms / 1e9)
            row["ceiling"] = f"{self.ceilings['matmul_dtype']} matmul {self.ceilings['matmul_tflops']:.2f} TFLOP/s"
            row["pct_of_ceiling"] = _significant(100 * row["tflops"] / self.ceilings["matmul_tflops"])
        self.rows.append(row)


@pytest.fixture(scope="session")
def record():
    recorder = Recorder(DEVICE)
    yield recorder
    if recorder.rows:
        stamp = environment_stamp(DEVICE)
        path = write_rows([{**r, **stamp} for r in recorder.rows], DEVICE, RESULTS)
        print(f"\n{len(recorder.rows)} benchmark rows written to {path}")


def shapes(quick: list, full: list) -> list:
    """The shapes a suite runs in this mode."""
    return quick[:1] if SMOKE else (quick if QUICK else full)


def rounds(quick: int, full: int) -> dict:
    """pytest-benchmark ``pedantic`` arguments for this mode."""
    if SMOKE:
        return {"rounds": 1, "warmup_rounds": 0}
    return {"rounds": quick, "warmup_rounds": 1} if QUICK else {"rounds": full, "warmup_rounds": 3}


def timed(fn):
    """Wrap ``fn`` so each call waits for the device (GPU timings are otherwise launch times)."""

    def run():
        out = fn()
        ceilings.synchronize(DEVICE)
        return out

    return run


def peak_mb(fn) -> float | None:
    """Allocator peak of one call above the current allocation (CUDA only; None on CPU)."""
    if DEVICE.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
