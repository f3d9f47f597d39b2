"""Run the benchmark suites and write their rows.

    python benchmarks/run.py --size quick                 # CPU shapes (make bench-quick)
    python benchmarks/run.py --size full --budget-s 300   # GPU shapes (make bench, make gpu-report)

Times every case of ``bench_*.py`` in order of priority with ``timing.measure`` and, right before
and right after each one, the ceiling it is held to (``ceilings.py``: the better of the two is
kept): a machine's rate drifts during a run, so each row carries its own ceiling, and the run's ceiling rows summarise all their measurements. A case
that fails (out of memory, a provider's API that changed) is recorded as skipped with the reason;
once ``--budget-s`` seconds have passed the remaining cases are recorded as skipped too. The rows
of this run replace ``<results>/<device-slug>/rows.jsonl`` (the ``memory_*.py`` scripts add theirs
afterwards). On a CPU the benchmarks measure the chunked PyTorch path, never the Triton interpreter.

The same cases run under pytest-benchmark, whose saved runs can be compared with each other
(``pytest benchmarks/ --benchmark-only``; see ``test_suites.py``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_logprob  # noqa: E402
import bench_sampling  # noqa: E402
import bench_stratified  # noqa: E402
import torch  # noqa: E402
from case import SIZES, Case  # noqa: E402
from ceilings import around, judged, summary  # noqa: E402
from results import RESULTS_DIR, device_dir, environment_stamp, write_rows  # noqa: E402
from timing import budget, measure, peak_mb  # noqa: E402

SUITES = (bench_logprob, bench_sampling, bench_stratified)


def _skipped(case: Case, reason: str) -> dict:
    return {"op": case.op, "mode": case.mode, "provider": case.provider, "shape": case.shape, "dtype": case.dtype,
            "skipped": reason}


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_case(case: Case, device: torch.device, size: str):
    """``(timing, CUDA peak MB)`` of ``case``, its inputs freed before returning."""
    call = case.setup()
    try:
        return measure(call, device, **budget(size)), peak_mb(call, device)
    finally:
        call = None
        _free(device)


def cases(size: str, device: torch.device, only: set[str] | None = None) -> list[Case]:
    """The cases of every suite at ``size`` (only the ops in ``only``), most important first."""
    return sorted((c for suite in SUITES for c in suite.cases(size, device) if only is None or c.op in only),
                  key=lambda c: c.priority)


def run(size: str, device: torch.device, budget_s: float | None, only: set[str] | None = None) -> list[dict]:
    """Measure the cases of ``size`` on ``device``, each between two measurements of its ceiling; returns the rows
    (unstamped): the cases' rows, then one summary row per ceiling."""
    start = time.monotonic()
    rows, measured_ceilings = [], []
    todo = cases(size, device, only)
    for i, case in enumerate(todo):
        label = f"[{i + 1}/{len(todo)}] {case.op} {case.mode} {case.provider} {case.shape} {case.dtype}"
        if budget_s is not None and time.monotonic() - start > budget_s:
            rows.append(_skipped(case, f"time budget of {budget_s:.0f} s spent"))
            continue
        try:
            (timing, peak), ceiling = around(case, device, size, lambda case=case: _time_case(case, device, size))
            measured_ceilings.append(ceiling)
            rows.append(judged(case, timing, ceiling, peak))
            print(f"{label}: {timing.median_ms:.3f} ms ({rows[-1]['pct_of_ceiling']:.1f}% of "
                  f"{ceiling['provider']} ceiling)", flush=True)
        except Exception as error:  # noqa: BLE001 - one broken provider must not stop the run
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
            rows.append(_skipped(case, reason))
            print(f"{label}: skipped ({reason})", flush=True)
            if not isinstance(error, torch.cuda.OutOfMemoryError):
                traceback.print_exc(limit=3)
        finally:
            _free(device)
    ceiling_rows = summary(measured_ceilings)
    for c in ceiling_rows:
        unit = "TFLOP/s" if "tflops" in c else "GB/s"
        print(f"ceiling {c['provider']}: {c['measurements']} measurements, {c['rate_min']:.3g} to {c['rate_max']:.3g} {unit}")
    return rows + ceiling_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this many seconds")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="rows go to <results>/<device-slug>/")
    parser.add_argument("--only", nargs="*", help="ops to run (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    stamp = environment_stamp(device)
    print(f"{stamp['device']}, commit {stamp['commit']}{' (DIRTY TREE)' if stamp['dirty'] else ''}, size {args.size}", flush=True)
    rows = run(args.size, device, args.budget_s, set(args.only) if args.only else None)
    path = write_rows([{**r, **stamp, "size": args.size} for r in rows], device_dir(device, args.results), replace_all=True)
    measured = sum("skipped" not in r for r in rows)
    print(f"{measured} rows measured, {len(rows) - measured} skipped; written to {path}")


if __name__ == "__main__":
    main()
