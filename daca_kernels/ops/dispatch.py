"""Which implementation an op runs on: the one place that reads ``backend=`` and ``DACA_BACKEND``.

Every public op takes ``backend=None|"triton"|"torch"|"reference"``. None means the
``DACA_BACKEND`` environment variable (read at each call, in the op's Python wrapper) and, when it
is unset or empty, the device rule: a CUDA tensor goes to the Triton kernels; a CPU tensor goes to
them when the Triton interpreter is on (``TRITON_INTERPRET=1`` set before the kernels are
imported), otherwise to the chunked PyTorch path. On CUDA the kernels need triton
[`CUDA_TRITON_FLOOR`][daca_kernels.ops.dispatch.CUDA_TRITON_FLOOR] or newer (the releases whose ahead-of-time sm_80 / sm_90 compile is
checked); with an older triton (3.2 and 3.3, which torch 2.6 and 2.7 pin) CUDA tensors take the
chunked PyTorch path, said once in a warning. ``"triton"`` and ``"torch"`` run the op's
registered custom op, which receives the resolved name and picks its launchers by it;
``"reference"`` runs the op's function in [`daca_kernels.ops.reference_backend`][daca_kernels.ops.reference_backend] (the plain
PyTorch references of ``daca_kernels.reference``, autograd included). [`run`][daca_kernels.ops.dispatch.run] is the only
place that chooses between them.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from daca_kernels.ops import reference_backend
from daca_kernels.validation import check_choice

BACKENDS = ("triton", "torch", "reference")
BACKEND_ENV = "DACA_BACKEND"

Result = TypeVar("Result")


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Read once at import: torch.compile(fullgraph=True) cannot trace importlib.util.find_spec (torch 2.11).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return TRITON_INSTALLED


# The oldest triton whose compiles for CUDA GPUs the project checks (the interpreter, which runs the
# kernels' semantics on CPU tensors, is tested on older releases too).
CUDA_TRITON_FLOOR = (3, 4)


def _triton_version() -> tuple[int, int] | None:
    for distribution in ("triton", "pytorch-triton"):
        try:
            text = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        parts = text.split("+")[0].split(".")
        try:
            return int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            return None
    return None


# Read once at import, as TRITON_INSTALLED.
TRITON_VERSION = _triton_version() if TRITON_INSTALLED else None
_warned_old_triton = False


def triton_compiles_for_cuda() -> bool:
    """Whether the installed triton is one the kernels are compiled with on CUDA (unknown versions are
    assumed new)."""
    return TRITON_INSTALLED and (TRITON_VERSION is None or TRITON_VERSION >= CUDA_TRITON_FLOOR)


def _old_triton_reason() -> str:
    have = ".".join(map(str, TRITON_VERSION or ()))
    floor = ".".join(map(str, CUDA_TRITON_FLOOR))
    return f"the Triton kernels need triton >= {floor} on CUDA (installed: {have})"


def _triton_serves(device: torch.device) -> bool:
    global _warned_old_triton
    if not triton_installed():
        return False
    if device.type == "cuda":
        if triton_compiles_for_cuda():
            return True
        if not _warned_old_triton:
            _warned_old_triton = True
            warnings.warn(f"{_old_triton_reason()}: CUDA tensors use the chunked PyTorch path", stacklevel=3)
        return False
    return device.type == "cpu" and interpreter_on()


def requested_backend(backend: str | None) -> str | None:
    """``backend`` if given (a ValueError naming it unless it is one of [`BACKENDS`][daca_kernels.ops.dispatch.BACKENDS]), else the
    one ``DACA_BACKEND`` names, or None when that is unset or empty."""
    if backend is not None:
        return check_choice(backend, "backend", BACKENDS)
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """``"triton"``, ``"torch"`` or ``"reference"`` for tensors on ``device``: ``backend``, else
    ``DACA_BACKEND``, else the device rule (see the module docstring)."""
    chosen = requested_backend(backend)
    if chosen == "triton" and not _triton_serves(device):
        if device.type == "cuda" and triton_installed():
            raise RuntimeError(f"backend 'triton' cannot run on cuda tensors here: {_old_triton_reason()}")
        raise RuntimeError(
            f"backend 'triton' cannot run on {device.type} tensors here "
            "(needs CUDA, or TRITON_INTERPRET=1 for CPU tensors, and triton installed)"
        )
    if chosen is not None:
        return chosen
    return "triton" if _triton_serves(device) else "torch"


def run(op: str, backend: str | None, device: torch.device, fused: Callable[..., Result], *args, **fused_only) -> Result:
    """Op ``op`` on the implementation of ``backend`` ([`resolve_backend`][daca_kernels.ops.dispatch.resolve_backend] for ``device``):
    ``fused(name, *args, **fused_only)`` for ``name`` ``"triton"`` or ``"torch"`` (the op's custom
    op, told which launchers to use; ``fused_only``: settings of that path alone, such as chunk
    sizes), ``reference_backend.<op>(*args)`` for ``"reference"``. Both take the checked
    arguments of the public op and return what it returns."""
    name = resolve_backend(device, backend)
    if name == "reference":
        return getattr(reference_backend, op)(*args)
    return fused(name, *args, **fused_only)


def triton_module(name: str, device: torch.device) -> ModuleType:
    """Import ``daca_kernels.kernels.<name>`` on first use and check it can serve ``device``.

    The import is deferred so that ``TRITON_INTERPRET`` may be set after ``import daca_kernels``
    but before the first kernel launch.
    """
    module = importlib.import_module(f"daca_kernels.kernels.{name}")
    interpreted = importlib.import_module("daca_kernels.kernels.launch").INTERPRETED
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(
            f"daca_kernels.kernels.{name} was imported without TRITON_INTERPRET=1 and cannot run on "
            "CPU tensors; set the variable before the first kernel launch or use backend='torch'"
        )
    if device.type == "cuda" and interpreted:
        raise RuntimeError(
            f"daca_kernels.kernels.{name} was imported under TRITON_INTERPRET=1 and cannot run on "
            "CUDA tensors in this process"
        )
    return module
