"""Test configuration: run the Triton kernels under the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any module defining a ``@triton.jit`` kernel is imported;
daca_kernels imports its kernels lazily, so setting it here (before the tests import anything that
launches a kernel) is enough.
"""
import os
import sys
from contextlib import contextmanager

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("DACA_BACKEND", None)

import gpu_device  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_report_header(config):
    """Names the one known bad pairing for the interpreter: triton before 3.7 reads a one-element numpy
    array with ``int()``, which numpy 2.4 refuses, so every kernel whose loop bound is an argument fails
    with "only 0-dimensional arrays can be converted to Python scalars" (compiled kernels are unaffected)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import numpy
        import triton
    except ImportError:  # without triton the ops run their PyTorch path
        return None

    def major_minor(version):
        return tuple(int(part) for part in version.split(".")[:2])

    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (f"triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__}: "
                "install numpy<2.4 (or triton>=3.7) for the kernel tests")
    return None


def pytest_configure(config):
    """Under pytest-xdist, each worker (and every process it starts) gets its share of the cores as
    torch threads. Left at one thread per core each, the workers oversubscribe the machine, and the
    OpenMP threads of one small op wait on each other: a 32-wide linear goes from microseconds to
    milliseconds, a tiny model's forward from 10 ms to a second."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA or gpu_device.ON_CPU:
        return  # ON_CPU: the gpu tests' bodies run on CPU, as a check of their logic (see gpu_device.py)
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Run a test once through the Triton kernels and once through the chunked PyTorch path."""
    monkeypatch.setenv("DACA_BACKEND", request.param)
    return request.param


@pytest.fixture
def torch_path_one_thread(monkeypatch):
    """The chunked PyTorch path on one thread, for tests that train tiny models: their matrices are
    far too small to share, and on a loaded 2-core machine two threads contend (a 32-wide linear
    goes from microseconds to milliseconds)."""
    monkeypatch.setenv("DACA_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def poison_allocations(monkeypatch):
    """Fill every fresh float tensor with NaN (and int tensors with a huge value) while active,
    so a kernel that forgets to write an output element is caught."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype not in (torch.bool,) and not t.is_complex():
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(real_new_empty(self, *a, **k)))


class _HostRead(AssertionError):
    pass


@pytest.fixture
def no_host_reads(monkeypatch):
    """Index ranges guarded on the device as on CUDA (here on the CPU); inside the returned context
    every tensor-to-host read the ops could use fails: the guarded path must not wait for the device."""
    from daca_kernels import validation

    monkeypatch.setattr(validation, "GUARDED_ON_DEVICE", ("cuda", "cpu"))

    def refuse(*args, **kwargs):
        raise _HostRead("a host read of a tensor on the device-guarded path")

    @contextmanager
    def refused():
        with pytest.MonkeyPatch.context() as patch:
            for name in ("__bool__", "item", "tolist"):
                patch.setattr(torch.Tensor, name, refuse)
            for name in ("unique", "unique_consecutive", "nonzero"):
                patch.setattr(torch, name, refuse)
            yield

    return refused


# What reads a tensor's values to the host (a device synchronisation on a GPU), when called from
# Python: the conversions, the data-dependent shapes, and indexing by a bool mask.
_READING_METHODS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "unique")
_READING_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "masked_select")


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0 for p in parts)


@pytest.fixture
def count_host_reads(monkeypatch):
    """Index ranges guarded on the device as on CUDA (here on the CPU), as for ``no_host_reads``;
    inside the returned context every tensor-to-host read is recorded, as the list of the
    ``(file, function)`` frames of the package that led to it (innermost first), in the list the
    context yields."""
    from daca_kernels import validation

    monkeypatch.setattr(validation, "GUARDED_ON_DEVICE", ("cuda", "cpu"))
    package = os.path.dirname(validation.__file__)

    @contextmanager
    def counting():
        reads = []

        def record():
            frame, stack = sys._getframe(2), []
            while frame is not None:
                if frame.f_code.co_filename.startswith(package):
                    stack.append((os.path.relpath(frame.f_code.co_filename, package), frame.f_code.co_name))
                frame = frame.f_back
            reads.append(stack)

        def counted(real, reads_if=None):
            def read(*args, **kwargs):
                if reads_if is None or reads_if(*args):
                    record()
                return real(*args, **kwargs)
            return read

        with pytest.MonkeyPatch.context() as patch:
            for name in _READING_METHODS:
                patch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
            for name in _READING_FUNCTIONS:
                patch.setattr(torch, name, counted(getattr(torch, name)))
            patch.setattr(torch.Tensor, "__getitem__",
                          counted(torch.Tensor.__getitem__, lambda tensor, index: _bool_index(index)))
            yield reads

    return counting
