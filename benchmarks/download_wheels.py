"""Fetch the comparison providers' wheels for an offline GPU machine (``make gpu-wheels``).

    python benchmarks/download_wheels.py [--dest benchmarks/wheels]

Run on a machine that reaches the package index: downloads the Liger-Kernel and Cut Cross-Entropy
wheels without their dependencies (the GPU machine already has torch and triton) into an ignored
folder that travels with the tree; ``make gpu-report`` installs whatever wheels it finds there with
``--no-deps --no-index``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PACKAGES = ("liger-kernel", "cut-cross-entropy")
DEFAULT_DEST = Path(__file__).resolve().parent / "wheels"


def download_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest), *PACKAGES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    sys.exit(subprocess.run(download_command(args.dest)).returncode)


if __name__ == "__main__":
    main()
