"""Imports of the optional dependencies, with an ImportError that names the extra to install.

The core (ops, losses, estimators, sampler) needs torch and, on Linux, triton only; the model
adapters need transformers (the ``hf`` extra) and the TRL trainer needs TRL (the ``trl`` extra).
"""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """``module`` imported, or a ModuleNotFoundError (an ImportError) saying that ``needed_by`` needs
    it and which extra of daca-kernels installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        raise ModuleNotFoundError(
            f"{needed_by} needs {top}, which is not installed: pip install 'daca-kernels[{extra}]'", name=top
        ) from error
