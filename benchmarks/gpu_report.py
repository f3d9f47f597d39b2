"""One command for a GPU machine: install, run the gpu tests, benchmark, report (``make gpu-report``).

    python benchmarks/gpu_report.py [--minutes 9]

For a machine with torch and triton already installed and no network. In order:
1. exits with status 2 and a message if CUDA is not available;
2. ``pip install --no-deps --no-build-isolation -e .`` (the project, nothing else), then any wheels
   in ``benchmarks/wheels/`` (Liger-Kernel, Cut Cross-Entropy; see ``download_wheels.py``) with
   ``--no-deps --no-index``;
3. ``pytest -m gpu`` (stopped after 40 % of the deadline);
4. ``benchmarks/run.py --size full`` with the time left before the deadline, less a margin for
   the report (cases run most important first and the rest are recorded as not measured);
5. ``benchmarks/report.py`` on ``benchmarks/results/<device-slug>/``.
Without ``.git`` in the tree, set ``DACA_BENCH_COMMIT`` to the commit it was copied from. The exit
status is the first non-zero status of steps 2-5.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

try:
    import torch
except ImportError:  # the GPU machine brings its own torch; say so rather than print a traceback
    print(f"make gpu-report needs torch with CUDA, and {sys.executable} cannot import torch. "
          "Set GPU_PYTHON to the python that has them (make gpu-report GPU_PYTHON=...).", file=sys.stderr)
    sys.exit(2)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import COMMIT_ENV, ROOT, commit_and_dirty, device_dir  # noqa: E402

WHEELS = ROOT / "benchmarks" / "wheels"
REPORT_MARGIN_S = 60  # the last case started before the budget runs out, plus the report
TESTS_SHARE = 0.4  # the gpu tests are stopped after this share of the deadline


def install_commands(wheels: list[Path]) -> list[list[str]]:
    """The pip commands of step 2: the project without dependencies, then the local wheels."""
    pip = [sys.executable, "-m", "pip", "install", "--no-deps"]
    commands = [pip + ["--no-build-isolation", "-e", str(ROOT)]]
    if wheels:
        commands.append(pip + ["--no-index"] + [str(w) for w in wheels])
    return commands


def _step(title: str, command: list[str], timeout_s: float | None = None) -> int:
    print(f"\n== {title}: {' '.join(command)}", flush=True)
    try:
        return subprocess.run(command, cwd=ROOT, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"{title}: stopped after {timeout_s:.0f} s", file=sys.stderr)
        return 124


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=9.0, help="deadline for the whole command")
    args = parser.parse_args()
    start = time.monotonic()
    if not torch.cuda.is_available():
        print("make gpu-report needs a CUDA device, and torch here sees none "
              "(torch.cuda.is_available() is False). On a CPU machine use `make bench-quick`.", file=sys.stderr)
        sys.exit(2)
    commit, dirty = commit_and_dirty()
    print(f"CUDA device: {torch.cuda.get_device_name(0)}; commit {commit}{' (dirty tree)' if dirty else ''}")
    if commit == "unknown":
        print(f"no git here: set {COMMIT_ENV}=<commit> to stamp the rows (the report refuses unstamped rows)", file=sys.stderr)
    statuses = [_step("install", c) for c in install_commands(sorted(WHEELS.glob("*.whl")))]
    statuses.append(_step("gpu tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"],
                          timeout_s=args.minutes * 60 * TESTS_SHARE))
    budget = args.minutes * 60 - (time.monotonic() - start) - REPORT_MARGIN_S
    statuses.append(_step("benchmarks", [sys.executable, "benchmarks/run.py", "--size", "full", "--budget-s", f"{max(budget, 0):.0f}"]))
    folder = device_dir(torch.device("cuda"))
    statuses.append(_step("report", [sys.executable, "benchmarks/report.py", "--results", str(folder)]))
    print(f"\n{time.monotonic() - start:.0f} s in all; results in {folder}")
    sys.exit(next((s for s in statuses if s), 0))


if __name__ == "__main__":
    main()
