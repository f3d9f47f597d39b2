"""Checks of a loaded model that the released modeling code needs under transformers 5.

``from_pretrained`` builds a model on the meta device and then materialises what the checkpoint does
not hold: non-persistent buffers become ``torch.empty_like`` memory and are filled only by the
model's ``_init_weights``. The released code of several families (Dream, LLaDA-MoE, SDAR, LLaDA2)
computes its rotary ``inv_freq`` in ``__init__`` and has an ``_init_weights`` that never touches it,
so the loaded model runs on uninitialised frequencies. :func:`repair_buffers` recomputes them.
"""
from __future__ import annotations

import inspect
import warnings

import torch
from torch import Tensor, nn


def repair_buffers(model: nn.Module) -> list[str]:
    """Recompute the non-persistent buffers of ``model`` that are not finite or differ from a fresh
    computation, in place, with a ``warnings.warn`` naming them.

    The fresh values come from a new instance of the module that owns the buffer, built by calling its
    class with the constructor arguments the module still carries as attributes (``config`` for
    transformers' and the released rotary embeddings; ``dim``, ``base``, ... for older ones). Only
    modules without parameters are rebuilt (rotary embeddings and the like), so nothing large is
    allocated. A rotary module's ``original_inv_freq`` follows its repaired ``inv_freq``. Buffers of a
    module that cannot be rebuilt are left as they are.

    Returns:
        The qualified names (``"model.rotary_emb.inv_freq"``) of the repaired buffers, in module order.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    repaired = []
    for prefix, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if isinstance(module._buffers.get(n), Tensor)]
        if not names or any(True for _ in module.parameters(recurse=True)):
            continue
        fresh = _rebuild(module)
        if fresh is None:
            continue
        for name in sorted(names):
            current, expected = module._buffers[name], fresh._buffers.get(name)
            if not isinstance(expected, Tensor) or expected.shape != current.shape or current.is_meta:
                continue
            expected = expected.to(device=current.device, dtype=current.dtype)
            if _same(current, expected):
                continue
            with torch.no_grad():
                current.copy_(expected)
            if name == "inv_freq" and isinstance(getattr(module, "original_inv_freq", None), Tensor):
                module.original_inv_freq = current.clone()
            repaired.append(f"{prefix}.{name}" if prefix else name)
    if repaired:
        warnings.warn(
            f"{type(model).__name__}: non-persistent buffers left uninitialised by loading were recomputed: "
            f"{', '.join(repaired)}", stacklevel=2,
        )
    return repaired


def _same(current: Tensor, expected: Tensor) -> bool:
    if not current.is_floating_point():
        return torch.equal(current, expected)
    if not bool(torch.isfinite(current).all()):
        return False
    # A fresh computation on another device may differ by a rounding; garbage differs by far more.
    return torch.allclose(current.double(), expected.double(), rtol=1e-5, atol=0)


def _rebuild(module: nn.Module) -> nn.Module | None:
    """A new instance of ``module``'s class on the CPU from the constructor arguments it carries, or None."""
    try:
        parameters = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name != "device" and hasattr(module, parameter.name):
            kwargs[parameter.name] = getattr(module, parameter.name)
        elif parameter.default is parameter.empty or parameter.kind is parameter.POSITIONAL_ONLY:
            return None
    try:
        with torch.device("cpu"):
            return type(module)(**kwargs)
    except Exception:  # a constructor this generic call cannot satisfy: leave the module as it is
        return None
