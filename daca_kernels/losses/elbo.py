"""Per-sample ELBO scores: the sequence-level Monte-Carlo terms that BGPO and SPG are built from."""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.losses.checks import check_mask_ratios, compute_dtype, poison_invalid
from daca_kernels.validation import FLOAT_DTYPES, check_bool_tensor, check_float_tensor, check_tensor


def elbo_sample_scores(
    sample_logp: Tensor,
    sample_masks: Tensor,
    mask_ratios: Tensor,
    *,
    token_weights: Tensor | None = None,
) -> Tensor:
    """``l[..., b] = (1 / t[..., b]) * sum_i w[b, i] * m[..., b, i] * logp[..., b, i]``.

    The single-sample estimate of the masked-diffusion ELBO of sequence b (LLaDA's ``1 / t``
    weighting), optionally with per-token weights (DPS) applied to the log-probabilities before
    they are summed. Its mean over samples is the usual MC ELBO.

    Args:
        sample_logp: floating ``[n, B, L]`` (or ``[B, L]`` for one sample), the log-probability of
            each token in each sample; values where the sample did not mask the token are ignored.
        sample_masks: bool, same shape: which tokens each sample masked (only completion tokens).
        mask_ratios: floating ``[n, B]`` (or ``[B]``): each sample's mask ratio t in (0, 1]; a
            sample with t = 0 must mask nothing and scores 0. Any other value (NaN included) is a
            ValueError, checked when the function runs eagerly (it reads the values: one host
            synchronisation); under ``torch.compile``, where it cannot be read, that sample's score
            is NaN instead (value and gradient).
        token_weights: floating ``[B, L]`` or None (ones); values at tokens a sample did not mask
            are ignored.

    Returns ``[n, B]`` (or ``[B]``), float32 (float64 if any input is float64), differentiable
    in ``sample_logp``.
    """
    check_tensor(sample_logp, "sample_logp", dtypes=FLOAT_DTYPES)
    if sample_logp.dim() not in (2, 3):
        raise ValueError(f"sample_logp must be [n, B, L] or [B, L], got shape {tuple(sample_logp.shape)}")
    same = (sample_logp, "sample_logp")
    shape = tuple(sample_logp.shape)
    per_token, per_sample = ("[n, B, L]", "[n, B]") if len(shape) == 3 else ("[B, L]", "[B]")
    check_bool_tensor(sample_masks, "sample_masks", shape, per_token, same)
    check_float_tensor(mask_ratios, "mask_ratios", shape[:-1], per_sample, same)
    if token_weights is not None:
        check_float_tensor(token_weights, "token_weights", shape[-2:], "[B, L]", same)

    dtype = compute_dtype(sample_logp, mask_ratios, token_weights)
    zero = sample_logp.new_zeros((), dtype=dtype)
    terms = torch.where(sample_masks, sample_logp.to(dtype), zero)
    if token_weights is not None:
        terms = terms * torch.where(sample_masks, token_weights.to(dtype), zero)
    valid = check_mask_ratios(mask_ratios, sample_masks)
    ratios = mask_ratios.to(dtype)
    # A sample that masks nothing has an empty sum: its t (possibly 0) must not make 0 / 0 = NaN.
    scores = terms.sum(dim=-1) / torch.where(ratios > 0, ratios, torch.ones_like(ratios))
    return poison_invalid(scores, valid)
