"""The checks only the objectives need (the argument checks they share with the ops are in
[`daca_kernels.validation`][daca_kernels.validation]). Every error starts with the offending argument's name.

The checks are static (types, dtypes, shapes, devices, Python hyper-parameters): they never read
tensor values, so the objectives stay traceable by ``torch.compile(fullgraph=True)``. The one
exception is [`check_mask_ratios`][daca_kernels.losses.checks.check_mask_ratios]: a mask ratio outside its range would make a score silently
wrong, so it is read when the objective runs eagerly on the CPU and, under ``torch.compile`` or on
CUDA, where it cannot be read without a synchronisation, the affected scores are NaN instead.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import check_float, check_same_device, reads_values


def check_token_count(value, name: str, device_of: tuple[Tensor, str]) -> float | Tensor | None:
    """An optional normaliser: None, a Python number > 0, or a 0-d real tensor (its value is the
    caller's responsibility: reading it would break ``torch.compile``)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a number or a 0-d tensor, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got dtype {str(value.dtype).replace('torch.', '')}")
        check_same_device(device_of[0], device_of[1], **{name: value})
        return value
    return check_float(value, name, minimum=0.0, exclusive_minimum=True)


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any of ``tensors`` is float64, else float32 (half inputs are computed in float32)."""
    return accumulation_dtype(*(t.dtype for t in tensors if t is not None))


def check_mask_ratios(mask_ratios: Tensor, masks: Tensor) -> Tensor:
    """Where each Monte-Carlo sample's mask ratio ``t`` is usable: bool, the shape of ``mask_ratios``.

    ``t`` must lie in ``(0, 1]``, or be 0 for a sample that masks nothing (``masks [..., L]``, the
    tokens the sample scores, all False along the last dimension). Run eagerly, any other entry
    (NaN included) raises a ValueError naming ``mask_ratios`` and the first offending index; this
    reads the values. Under ``torch.compile``, on the meta device and where the read would be a
    device synchronisation (CUDA: ``daca_kernels.validation.reads_values``) nothing is read and
    the caller turns the samples where the result is False into NaN.
    """
    valid = ((mask_ratios > 0) & (mask_ratios <= 1)) | ((mask_ratios == 0) & ~masks.any(dim=-1))
    if torch.compiler.is_compiling() or mask_ratios.device.type == "meta" or not reads_values(mask_ratios):
        return valid
    if not bool(valid.all()):
        first = tuple((~valid).nonzero()[0].tolist())
        where = ", ".join(str(i) for i in first)
        raise ValueError(
            f"mask_ratios must lie in (0, 1] (0 only for a sample that masks nothing), got "
            f"mask_ratios[{where}] = {float(mask_ratios[first])}"
        )
    return valid


def poison_invalid(values: Tensor, valid: Tensor) -> Tensor:
    """``values`` where ``valid``, NaN elsewhere (value and gradient), for scores computed from an
    input that could not be checked ([`check_mask_ratios`][daca_kernels.losses.checks.check_mask_ratios] under ``torch.compile``)."""
    factor = torch.where(valid, torch.ones_like(values), torch.full_like(values, math.nan))
    return values * factor
