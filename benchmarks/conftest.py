"""pytest configuration of the benchmark suite (``pytest benchmarks/ --benchmark-only``, see
``test_suites.py``): its options, and the same environment as ``run.py``."""
import os
import sys
from pathlib import Path

# On a CPU the benchmarks measure the chunked PyTorch path, never the Triton interpreter.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402
import torch  # noqa: E402
from case import SIZES  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("daca benchmarks")
    group.addoption("--bench-size", choices=SIZES, default=None,
                    help="case shapes: smoke, quick (the default without CUDA) or full (the default with CUDA)")
    group.addoption("--bench-device", default=None, help="cuda or cpu (default: cuda when available)")


def bench_device(config) -> torch.device:
    return torch.device(config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu"))


def bench_size(config) -> str:
    return config.getoption("--bench-size") or ("full" if bench_device(config).type == "cuda" else "quick")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    return bench_device(request.config)


@pytest.fixture(scope="session")
def size(request) -> str:
    return bench_size(request.config)
