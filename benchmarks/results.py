"""Benchmark result rows, stamped with the device, library versions and commit.

Each run writes ``benchmarks/results/<device-slug>.jsonl`` and ``.csv``. Rows of an earlier run on
the same device are kept unless this run measured the same (op, mode, provider, shape, dtype).
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import platform
import re
import subprocess
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KEY = ("op", "mode", "provider", "shape", "dtype")
FIELDS = [
    "op", "mode", "provider", "shape", "dtype", "ms", "gbps", "tflops", "pct_of_ceiling",
    "ceiling", "peak_mb", "bytes", "flops", "formula", "device", "torch", "triton", "commit", "timestamp",
]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}"


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment_stamp(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": commit(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(rows: list[dict], device: torch.device, directory: Path = RESULTS_DIR) -> Path:
    """Merge ``rows`` into this device's results file; returns the JSONL path."""
    if not rows:
        raise ValueError("rows must not be empty")
    directory.mkdir(parents=True, exist_ok=True)
    stem = device_slug(device_name(device))
    jsonl = directory / f"{stem}.jsonl"
    fresh = {tuple(r[k] for k in KEY) for r in rows}
    kept = [r for r in load_rows(jsonl) if tuple(r.get(k) for k in KEY) not in fresh]
    merged = kept + rows
    jsonl.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in merged))
    with open(directory / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged)
    return jsonl
