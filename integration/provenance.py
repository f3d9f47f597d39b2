"""Where a committed result comes from: the commit of the code that made it and the command.

Every results file under ``integration/results/`` and ``benchmarks/results/`` carries a stamp: the
markdown reports a line ([`stamp_line`][integration.provenance.stamp_line], read back by
[`read_stamp`][integration.provenance.read_stamp]), the JSON files the
fields of [`stamp`][integration.provenance.stamp]. The commit is ``git rev-parse HEAD`` (12 hex digits) with ``-dirty`` when
the measured source (the package and the harness that made the file, results excepted) had
uncommitted changes; a tree copied without ``.git`` takes it from ``DACA_RESULTS_COMMIT`` (or
``DACA_BENCH_COMMIT``), else ``unknown``. This module imports nothing heavy: the benchmark report
reads stamps without importing torch.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMIT_ENVS = ("DACA_RESULTS_COMMIT", "DACA_BENCH_COMMIT")
# What the reference loop's results measure, and what the benchmarks measure (git pathspecs).
LOOP_SOURCE = ("daca_kernels", "integration", ":(exclude)integration/results")
BENCH_SOURCE = ("daca_kernels", "benchmarks", ":(exclude)benchmarks/results", ":(exclude)benchmarks/wheels")
STAMP_PATTERN = re.compile(r"Made by `(?P<command>[^`]+)` at commit `(?P<commit>[0-9a-f]{7,40}|unknown)(?P<dirty>-dirty)?`")


def _git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def commit_and_dirty(measured: tuple[str, ...] = LOOP_SOURCE, root: Path = ROOT) -> tuple[str, bool]:
    """The short commit of the tree and whether its ``measured`` source differs from that commit."""
    for name in COMMIT_ENVS:
        declared = os.environ.get(name)
        if declared:
            return declared.removesuffix("-dirty")[:12], declared.endswith("-dirty")
    try:
        sha = _git("rev-parse", "--short=12", "HEAD", root=root)
        changes = _git("status", "--porcelain", "--", *measured, root=root)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True
    return sha, bool(changes)


def command_line() -> str:
    """The command that started this process, as typed: ``python -m module args`` or ``python path args``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        script = Path(sys.argv[0]).resolve()
        try:
            script = script.relative_to(ROOT)
        except ValueError:
            pass
        head = ["python", str(script)]
    return shlex.join(head + sys.argv[1:])


def machine() -> str:
    """The CPU model and core count (or the platform's processor name)."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core {name}"


def stamp(command: str | None = None, measured: tuple[str, ...] = LOOP_SOURCE) -> dict:
    """The stamp of a result made now: ``commit`` (with ``-dirty``), ``command``, ``date`` (UTC) and
    ``machine``."""
    sha, dirty = commit_and_dirty(measured)
    return {"commit": sha + ("-dirty" if dirty else ""), "command": command or command_line(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "machine": machine()}


def stamp_line(command: str | None = None, measured: tuple[str, ...] = LOOP_SOURCE) -> str:
    """The markdown line of [`stamp`][integration.provenance.stamp], the one [`read_stamp`][integration.provenance.read_stamp] reads
    back."""
    s = stamp(command, measured)
    dirty = " (with uncommitted changes to the code it measures)" if s["commit"].endswith("-dirty") else ""
    return f"Made by `{s['command']}` at commit `{s['commit']}`{dirty} on {s['date']}, {s['machine']}."


def read_stamp(text: str) -> dict | None:
    """``{"command", "commit", "dirty"}`` of the first stamp line in ``text``, or None."""
    match = STAMP_PATTERN.search(text)
    if match is None:
        return None
    return {"command": match["command"], "commit": match["commit"], "dirty": match["dirty"] is not None}
