"""Denoising Progress Scores: per-token weights from a rollout's confidence history.

For a token i committed at step s with confidence ``c_s[i]``, and ``n_s`` tokens committed at step
s in its row, the raw score is

    d_i = (1 - c_s[i]) + step_gain[s] / n_s        (variant "progress")

or only its first term ("self": how uncertain the model was when it committed i) or only its second
("lookahead": i's share of how much step s's commitments raised the confidence of everything still
masked). Per row, over the completion tokens, ``w_i = clip(1 + scale * (d_i - mean d) /
(std d + 1e-6), lo, hi)`` and then ``w_i / mean w``: every row's weights average exactly 1.

Conventions: ``std`` is the population standard deviation (divisor n), so a row with one
completion token gets weight 1 (no NaN); a row with no completion token gets all zeros. Weights
are 0 outside ``completion_mask`` and carry no gradient. Computed in float64, returned in float32.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from daca_kernels.rollout import Rollout
from daca_kernels.validation import check_shape, check_tensor

VARIANTS = ("progress", "self", "lookahead")
STD_EPS = 1e-6


def _check_clip(clip) -> tuple[float, float] | None:
    if clip is None:
        return None
    if not isinstance(clip, (tuple, list)) or len(clip) != 2:
        raise TypeError(f"clip must be a (low, high) pair or None, got {clip!r}")
    low, high = (float(v) for v in clip)
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise ValueError(f"clip must satisfy 0 < low <= high (finite), got {clip!r}")
    return low, high


def dps_weights(
    rollout: Rollout,
    completion_mask: Tensor | None = None,
    *,
    variant: str = "progress",
    scale: float = 0.5,
    clip: tuple[float, float] | None = (0.2, 5.0),
) -> Tensor:
    """Per-token DPS weights of a rollout.

    Args:
        rollout: a [`daca_kernels.rollout.Rollout`][daca_kernels.rollout.record.Rollout].
        completion_mask: bool ``[B, L]``, the completion tokens that count (e.g. up to the end of
            the answer); every one must have been committed by the sampler. None: all of them.
        variant: ``"progress"``, ``"self"`` or ``"lookahead"``.
        scale: finite float >= 0; 0 gives all ones on the completion (plain GRPO).
        clip: ``(low, high)`` with ``0 < low <= high``, or None for no clipping.

    Returns:
        float32 ``[B, L]``: weights with mean exactly 1 over each row's completion tokens, 0
        elsewhere; detached.
    """
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a Rollout, got {type(rollout).__name__}")
    commit_step = rollout.commit_step
    if completion_mask is None:
        completion_mask = rollout.completion_mask
    check_tensor(completion_mask, "completion_mask", ndim=2, dtypes=(torch.bool,))
    check_shape(completion_mask, "completion_mask", commit_step.shape, "[B, L] (from rollout.sequences)")
    if completion_mask.device != commit_step.device:
        raise ValueError(f"completion_mask is on {completion_mask.device} but rollout is on {commit_step.device}")
    if bool((completion_mask & (commit_step < 0)).any()):
        raise ValueError("completion_mask must select only positions the sampler committed (commit_step >= 0)")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    clip = _check_clip(clip)

    with torch.no_grad():
        mask = completion_mask.double()
        step = commit_step.clamp(min=0)
        commits_per_step = torch.zeros(rollout.step_gain.shape, dtype=torch.float64, device=step.device)
        commits_per_step.scatter_add_(1, step, (commit_step >= 0).double())
        own = 1.0 - rollout.commit_confidence.double()
        lookahead = rollout.step_gain.double().gather(1, step) / commits_per_step.gather(1, step).clamp(min=1)
        raw = {"progress": own + lookahead, "self": own, "lookahead": lookahead}[variant]

        count = mask.sum(dim=1, keepdim=True)
        safe_count = count.clamp(min=1)
        mean = (raw * mask).sum(dim=1, keepdim=True) / safe_count
        std = (((raw - mean) ** 2 * mask).sum(dim=1, keepdim=True) / safe_count).sqrt()
        weights = 1.0 + scale * (raw - mean) / (std + STD_EPS)
        if clip is not None:
            weights = weights.clamp(*clip)
        weights = weights * mask
        weights = weights / (weights.sum(dim=1, keepdim=True) / safe_count).clamp(min=torch.finfo(torch.float64).tiny)
        return weights.float()
