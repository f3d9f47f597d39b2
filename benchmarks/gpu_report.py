"""One command for a GPU machine: install, run the gpu tests, benchmark, report (``make gpu-report``).

    python benchmarks/gpu_report.py [--minutes 9]

For a machine with torch, triton, transformers and pytest already installed and no network; the
project itself is not installed (an editable install needs setuptools' ``wheel`` support, which
such an image may lack): every step runs with the repository first on ``PYTHONPATH``. In order:
1. exits with status 2 and a message if CUDA is not available;
2. installs any wheels in ``benchmarks/wheels/`` (Liger-Kernel, Cut Cross-Entropy; see
   ``download_wheels.py``) with ``--no-deps --no-index``;
3. ``pytest -m gpu`` on the test files that hold gpu tests (stopped after 40 % of the deadline). A
   file whose module-level imports need a package that is not installed here (hypothesis, say) is
   left out with a line naming the package, so one missing test dependency does not stop the rest;
4. ``benchmarks/run.py --size full`` with the time left before the deadline, less a margin for
   the report (cases run most important first and the rest are recorded as not measured);
5. ``benchmarks/report.py`` on ``benchmarks/results/<device-slug>/`` (without matplotlib: no charts).
Without ``.git`` in the tree, set ``DACA_BENCH_COMMIT`` to the commit it was copied from. The exit
status is the first non-zero status of steps 2-5.

``--cpu-check`` runs the same steps on a machine without CUDA, to check a GPU image's software stack
(its torch, triton and transformers) before a GPU is at hand: the wheel commands are printed, not run;
the gpu tests run with ``DACA_GPU_TESTS_ON_CPU=1`` (their bodies on CPU under the Triton interpreter
at small sizes, see ``tests/gpu_device.py``); the benchmarks run at ``--size smoke`` on CPU into a
temporary folder (``--results`` to keep them) and the report is written there, accepting rows from a
dirty tree. It measures nothing.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
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
TESTS = ROOT / "tests"
REPORT_MARGIN_S = 60  # the last case started before the budget runs out, plus the report
TESTS_SHARE = 0.4  # the gpu tests are stopped after this share of the deadline


def install_commands(wheels: list[Path]) -> list[list[str]]:
    """The pip commands of step 2: the local wheels, without dependencies or an index."""
    if not wheels:
        return []
    return [[sys.executable, "-m", "pip", "install", "--no-deps", "--no-index"] + [str(w) for w in wheels]]


def _imports(path: Path) -> set[str]:
    """The top-level names ``path`` imports at module level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _missing(path: Path, tests: Path, seen: set[Path]) -> set[str]:
    """The packages that ``path``, or a test helper it imports, needs and that cannot be found here."""
    seen.add(path)
    missing = set()
    for name in _imports(path):
        helper = tests / f"{name}.py"
        if not helper.exists() and (tests / name / "__init__.py").exists():
            helper = tests / name / "__init__.py"  # a helper package (tests/families)
        if helper.exists():
            missing |= set() if helper in seen else _missing(helper, tests, seen)
        elif name not in ("daca_kernels", "integration") and importlib.util.find_spec(name) is None:
            missing.add(name)
    return missing


def gpu_test_files(tests: Path = TESTS) -> tuple[list[Path], dict[Path, list[str]]]:
    """The test files holding gpu tests whose imports (with the helpers they and ``conftest.py``
    import) are all installed here, and the others with the packages they miss."""
    candidates = sorted(p for p in tests.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    runnable, left_out = [], {}
    for path in candidates:
        seen: set[Path] = set()
        missing = _missing(path, tests, seen) | _missing(tests / "conftest.py", tests, seen)
        if missing:
            left_out[path] = sorted(missing)
        else:
            runnable.append(path)
    return runnable, left_out


def _step(title: str, command: list[str], timeout_s: float | None = None, env: dict | None = None) -> int:
    print(f"\n== {title}: {' '.join(command)}", flush=True)
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        return subprocess.run(command, cwd=ROOT, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"{title}: stopped after {timeout_s:.0f} s", file=sys.stderr)
        return 124


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=9.0, help="deadline for the whole command (not with --cpu-check)")
    parser.add_argument("--cpu-check", action="store_true", help="the same steps on CPU, measuring nothing (see above)")
    parser.add_argument("--results", type=Path, default=None,
                        help="with --cpu-check: where the smoke rows and report go (default: a temporary folder)")
    args = parser.parse_args()
    if args.cpu_check:
        with tempfile.TemporaryDirectory() as scratch:
            sys.exit(report(args.minutes, torch.device("cpu"), args.results or Path(scratch)))
    if not torch.cuda.is_available():
        print("make gpu-report needs a CUDA device, and torch here sees none "
              "(torch.cuda.is_available() is False). On a CPU machine use `make bench-quick`.", file=sys.stderr)
        sys.exit(2)
    sys.exit(report(args.minutes, torch.device("cuda"), None))


def report(minutes: float, device: torch.device, cpu_results: Path | None) -> int:
    """Steps 2-5 on ``device``; ``cpu_results`` set: the ``--cpu-check`` variant writing there. Returns
    the exit status."""
    start = time.monotonic()
    cpu_check = cpu_results is not None
    commit, dirty = commit_and_dirty()
    where = "CPU check: the steps on CPU, nothing measured" if cpu_check else f"CUDA device: {torch.cuda.get_device_name(0)}"
    print(f"{where}; commit {commit}{' (dirty tree)' if dirty else ''}")
    print(f"torch {torch.__version__}, triton {_version('triton')}, transformers {_version('transformers')}, python {sys.version.split()[0]}")
    if commit == "unknown":
        print(f"no git here: set {COMMIT_ENV}=<commit> to stamp the rows (the report refuses unstamped rows)", file=sys.stderr)
    installs = install_commands(sorted(WHEELS.glob("*.whl")))
    if cpu_check:
        statuses = []
        for command in installs:
            print(f"\n== install wheels (not run by --cpu-check): {' '.join(command)}")
    else:
        statuses = [_step("install wheels", c) for c in installs]
    files, left_out = gpu_test_files()
    for path, missing in left_out.items():
        print(f"gpu tests: {path.relative_to(ROOT)} left out: needs {', '.join(missing)} (not installed here)")
    if files:
        statuses.append(_step("gpu tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                            *(str(p.relative_to(ROOT)) for p in files)],
                              timeout_s=None if cpu_check else minutes * 60 * TESTS_SHARE,
                              env={"DACA_GPU_TESTS_ON_CPU": "1"} if cpu_check else None))
    else:
        print("gpu tests: no test file can run here", file=sys.stderr)
        statuses.append(1)
    if cpu_check:
        sizing = ["--size", "smoke", "--device", "cpu", "--results", str(cpu_results)]
    else:
        budget = minutes * 60 - (time.monotonic() - start) - REPORT_MARGIN_S
        sizing = ["--size", "full", "--budget-s", f"{max(budget, 0):.0f}"]
    statuses.append(_step("benchmarks", [sys.executable, "benchmarks/run.py", *sizing]))
    folder = device_dir(device, cpu_results) if cpu_check else device_dir(device)
    statuses.append(_step("report", [sys.executable, "benchmarks/report.py", "--results", str(folder),
                                     *(["--allow-dirty"] if cpu_check else [])]))
    print(f"\n{time.monotonic() - start:.0f} s in all; results in {folder}")
    return next((s for s in statuses if s), 0)


def _version(package: str) -> str:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    main()
