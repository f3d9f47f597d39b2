"""Peak memory of a function call: CUDA allocator statistics, or peak RSS of a fresh process on CPU.

On CPU, torch keeps no allocator statistics, so each measurement runs in its own Python process:
it warms the function up on tiny inputs (lazy imports and one-time initialisation are not the
function's memory), builds the real inputs, resets the kernel's high-water mark
(``/proc/self/clear_refs``), runs the function and reports ``VmHWM`` minus the resident size before
the call. glibc is told to serve every large block with mmap so that freed memory leaves the RSS.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent


def _resident_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def measure_in_this_process(setup, run, warmup=None) -> float:
    """MB above the pre-call footprint reached while ``run(*setup())`` executes (CPU: RSS).

    ``warmup``, if given, is a ``setup``-like callable for tiny inputs run once beforehand.
    """
    if warmup is not None:
        run(*warmup())
    inputs = setup()
    if torch.cuda.is_available() and any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run(*inputs)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")
    before = _resident_kb("VmRSS")
    run(*inputs)
    return (_resident_kb("VmHWM") - before) / 1024


def measure_cpu_subprocess(
    module: str, case: str, env: dict | None = None, args: dict | None = None, warmup_args: dict | None = None
) -> float:
    """Run ``module.CASES[case]`` (a ``(setup, run)`` pair built from ``args``) in a fresh process,
    after one warm-up call on the inputs built from ``warmup_args``."""
    code = (
        "import json, sys, importlib; sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r});"
        "from peak_memory import measure_in_this_process;"
        "m = importlib.import_module({module!r});"
        "setup, run = m.CASES[{case!r}](**json.loads({args!r}));"
        "warm = m.CASES[{case!r}](**json.loads({warmup_args!r}))[0] if {has_warmup} else None;"
        "print(json.dumps(measure_in_this_process(setup, run, warm)))"
    ).format(
        root=str(_ROOT), bench=str(_ROOT / "benchmarks"), module=module, case=case, args=json.dumps(args or {}),
        warmup_args=json.dumps(warmup_args or {}), has_warmup=warmup_args is not None,
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", **(env or {})}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"memory measurement {module}:{case} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
