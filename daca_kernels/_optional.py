"""Imports of the optional dependencies, with an ImportError that names the extra to install.

The core (ops, losses, estimators, sampler) needs torch and, on Linux, triton only; the model
adapters need transformers (the ``hf`` extra) and the TRL trainer needs TRL (the ``trl`` extra).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
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


def defined_on_first_use(namespace: dict, builders: dict[str, Callable[[], type]]) -> Callable[[str], type]:
    """A module ``__getattr__`` that builds each class of ``builders`` (name -> function returning the
    class) on first access and keeps it in the module's ``namespace``: for classes that subclass an
    optional dependency's (transformers' ``DynamicCache``), so that the module imports without it."""
    module = namespace["__name__"]

    def __getattr__(name: str) -> type:
        if name not in builders:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        cls = builders[name]()
        cls.__module__, cls.__qualname__ = module, name
        namespace[name] = cls
        return cls

    return __getattr__
