"""Which implementation an op runs on.

A CUDA tensor goes to the Triton kernels. A CPU tensor goes to them when the Triton interpreter
is on (``TRITON_INTERPRET=1`` set before the kernels are imported), otherwise to the chunked
PyTorch path. ``DACA_BACKEND=triton|torch|reference`` forces one path for debugging and
benchmarking; ``reference`` runs the plain PyTorch references of ``daca_kernels.reference``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

BACKENDS = ("triton", "torch", "reference")
BACKEND_ENV = "DACA_BACKEND"


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Read once at import: torch.compile(fullgraph=True) cannot trace importlib.util.find_spec (torch 2.11).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return TRITON_INSTALLED


def _triton_serves(device: torch.device) -> bool:
    if not triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreter_on()


def forced_backend() -> str | None:
    """The backend named by ``DACA_BACKEND``, or None when it is unset or empty."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def resolve_backend(device: torch.device) -> str:
    """``"triton"``, ``"torch"`` or ``"reference"`` for tensors on ``device``."""
    forced = forced_backend()
    if forced == "triton" and not _triton_serves(device):
        raise RuntimeError(
            f"{BACKEND_ENV}=triton but Triton cannot run on {device.type} tensors here "
            "(needs CUDA, or TRITON_INTERPRET=1 for CPU tensors, and triton installed)"
        )
    if forced is not None:
        return forced
    return "triton" if _triton_serves(device) else "torch"


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
            "CPU tensors; set the variable before the first kernel launch or use DACA_BACKEND=torch"
        )
    if device.type == "cuda" and interpreted:
        raise RuntimeError(
            f"daca_kernels.kernels.{name} was imported under TRITON_INTERPRET=1 and cannot run on "
            "CUDA tensors in this process"
        )
    return module
