"""Benchmark rows on disk: ``benchmarks/results/<device-slug>/rows.jsonl``, one JSON object a line.

Every row carries the stamp of the run that made it: device name, torch and triton versions,
commit and whether the source that was measured had uncommitted changes (``dirty``: changed,
staged or untracked files under ``daca_kernels/`` and ``benchmarks/``, results excepted; a
demo's outputs or a notebook elsewhere in the tree do not make a measurement dirty). A tree copied without ``.git`` takes its commit from
``DACA_BENCH_COMMIT`` (a trailing ``-dirty`` marks it dirty). Writing rows replaces the rows of an
earlier run that have the same (op, mode, provider, shape, dtype) and keeps the others.
"""
from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: report.py reads rows without torch's import time
    import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the scripts under benchmarks/ run with only their own folder on the path
    sys.path.insert(0, str(ROOT))
from integration import provenance  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
ROWS_FILE = "rows.jsonl"
KEY = ("op", "mode", "provider", "shape", "dtype")
STAMP_FIELDS = ("device", "torch", "triton", "commit", "dirty", "timestamp", "size", "command")
COMMIT_ENV = "DACA_BENCH_COMMIT"
# What a benchmark measures: the package and the harness (git pathspecs, relative to ROOT).
MEASURED_SOURCE = provenance.BENCH_SOURCE


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_dir(device: torch.device, root: Path = RESULTS_DIR) -> Path:
    """The results folder of ``device`` under ``root``."""
    return root / device_slug(device_name(device))


def commit_and_dirty(root: Path = ROOT) -> tuple[str, bool]:
    """The short commit of the tree and whether its measured source differs from that commit
    (``integration.provenance``, which every results file's stamp comes from)."""
    return provenance.commit_and_dirty(MEASURED_SOURCE, root)


def environment_stamp(device: torch.device) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    sha, dirty = commit_and_dirty()
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": sha,
        "dirty": dirty,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": provenance.command_line(),
    }


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(rows: list[dict], directory: Path, *, replace_all: bool = False) -> Path:
    """Write ``rows`` to ``directory/rows.jsonl``, replacing the rows with the same key (all rows
    with ``replace_all``); returns the file's path."""
    if not rows:
        raise ValueError("rows must not be empty")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ROWS_FILE
    fresh = {tuple(r.get(k) for k in KEY) for r in rows}
    kept = [] if replace_all else [r for r in load_rows(path) if tuple(r.get(k) for k in KEY) not in fresh]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept + rows))
    return path


def rows_from_benchmark_json(path: Path) -> list[dict]:
    """The rows of a pytest-benchmark file (``--benchmark-json``, or a run saved under
    ``.benchmarks/``): each case's row and stamp travel in its ``extra_info`` (``test_suites.py``),
    followed by one summary row per ceiling over the ceilings measured beside the cases."""
    from ceilings import summary

    data = json.loads(Path(path).read_text())
    rows, measured_ceilings = [], []
    for bench in data.get("benchmarks", []):
        info = dict(bench.get("extra_info") or {})
        ceiling = info.pop("ceiling_measurement", None)
        if "op" not in info:
            continue
        rows.append(info)
        if ceiling is not None:
            measured_ceilings.append({**ceiling, **{k: info[k] for k in STAMP_FIELDS if k in info}})
    return rows + summary(measured_ceilings)
