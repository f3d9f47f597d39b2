"""The GRPO family: clipped importance-ratio surrogate, k3 KL penalty, TRL's four normalisations, GSPO.

Conventions follow TRL's ``GRPOTrainer``. Per completion token ``(b, i)`` with ``mask[b, i]``::

    ratio    = exp(logp - old_logp)                    # importance_level="token"
    surrogate = min(ratio * A_b, clip(ratio, 1 - eps_low, 1 + eps_high) * A_b)
    loss_bi  = -w_bi * surrogate + beta * k3_kl(ref_logp, logp)

and the per-token losses are reduced by ``loss_type``:

- ``"grpo"``: mean over each sequence's completion tokens, then mean over the B sequences (a row
  without completion tokens contributes 0 but still counts in B);
- ``"bnpo"``: mean over all completion tokens of this batch;
- ``"dr_grpo"``: sum / (B * max_completion_length) (Dr. GRPO: a constant normaliser). TRL's
  ``GRPOTrainer._compute_loss`` divides by ``B * max_completion_length`` on its ``[B, G]``
  completion layout; pass the generation length G as ``max_completion_length`` for exactly that
  (the default, the number of columns of ``mask`` that hold any token, is G only when some row of
  the batch uses the last generated column);
- ``"dapo"``: sum / the number of completion tokens of the *global* batch. On one process that is
  ``mask.sum()``; with several processes (or gradient accumulation) pass ``num_items_in_batch``.
  It is the divisor itself: when the gradients of P processes are *averaged* (DDP), pass the global
  token count divided by P (as TRL does), so that the averaged gradient equals the gradient of
  ``global sum / global token count``; when they are summed, pass the global count.

``importance_level="sequence"`` is GSPO: the ratio of sequence b is
``s_b = exp(mean over its completion tokens of (logp - old_logp))`` and is clipped as a whole. It is
applied per token in GSPO-token form, ``s_bi = sg[s_b] * exp(logp_bi - sg[logp_bi])`` (``sg`` = stop
gradient): the value of every token's ratio is ``s_b`` and the gradient of ``s_bi`` is
``s_b * grad logp_bi``. With uniform token weights the gradient is exactly GSPO's
``-A_b * s_b * mean_i grad logp_bi`` (per sequence, inside the clip range); DPS token weights then
weight each token's own gradient, as in the token-level objective.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.losses.checks import (
    check_choice,
    check_float,
    check_bool_tensor,
    check_float_tensor,
    check_token_count,
    compute_dtype,
)
from daca_kernels.ops.validation import FLOAT_DTYPES, check_int, check_tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")


def k3_kl(ref_logp: Tensor, logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: ``exp(r) - r - 1`` with
    ``r = ref_logp - logp``. Non-negative, 0 where the two agree; same shape as the inputs."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    token_weights: Tensor | None = None,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    loss_type: str = "dapo",
    importance_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO objective (module docstring) as a loss to minimise.

    Args:
        logp: floating ``[B, L]``, log-probabilities of the completion tokens under the current
            policy (differentiable).
        old_logp: ``[B, L]`` under the policy that sampled the completions, or None for
            ``logp.detach()`` (one update per batch: ratio 1, plain policy gradient).
        advantages: ``[B]``, one per sequence (e.g. :func:`group_advantages`).
        mask: bool ``[B, L]``, the completion tokens that count. Values of ``logp``, ``old_logp``,
            ``ref_logp`` and ``token_weights`` outside it are ignored (they may be anything,
            including inf or NaN) and get zero gradient.
        ref_logp: ``[B, L]`` under the reference policy; required when ``beta > 0``.
        token_weights: ``[B, L]`` per-token weights of the surrogate (DPS), or None for ones.
        beta: KL coefficient (>= 0).
        eps_low, eps_high: the clip range ``[1 - eps_low, 1 + eps_high]``; ``eps_high`` defaults
            to ``eps_low``. ``0 <= eps_low < 1``, ``eps_high >= 0``.
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"`` (module docstring).
        importance_level: ``"token"`` (GRPO) or ``"sequence"`` (GSPO).
        max_completion_length: Dr. GRPO's constant, the generation length G; only with
            ``loss_type="dr_grpo"``. Default: the number of columns of ``mask`` with at least one
            True (the completion width in the ``[B, G]`` and the ``[B, P + G]`` layouts alike,
            prompt columns never counted; at least 1).
        num_items_in_batch: DAPO's divisor (default ``mask.sum()``): a Python number > 0 or a 0-d
            tensor; only with ``loss_type="dapo"``.

    Tensors are used as given: pass ``old_logp``, ``ref_logp``, ``advantages`` and
    ``token_weights`` detached. Everything is computed in float32 (float64 if any input is float64).

    Returns:
        ``(loss, metrics)``: the 0-d loss and a dict of detached 0-d tensors, all means over the
        completion tokens of this batch: ``clip_fraction_low`` (ratio below ``1 - eps_low`` with
        A < 0), ``clip_fraction_high`` (above ``1 + eps_high`` with A > 0) — the tokens whose
        gradient the clip removes — their sum ``clip_fraction``, ``ratio_mean``, and ``kl_mean``
        (the k3 KL) when ``ref_logp`` is given.
    """
    check_tensor(logp, "logp", ndim=2, dtypes=FLOAT_DTYPES)
    batch, length = logp.shape
    if batch == 0 or length == 0:
        raise ValueError(f"logp must be non-empty, got shape {tuple(logp.shape)}")
    same = (logp, "logp")
    check_bool_tensor(mask, "mask", (batch, length), "[B, L]", same)
    if old_logp is not None:
        check_float_tensor(old_logp, "old_logp", (batch, length), "[B, L]", same)
    check_float_tensor(advantages, "advantages", (batch,), "[B]", same)
    if ref_logp is not None:
        check_float_tensor(ref_logp, "ref_logp", (batch, length), "[B, L]", same)
    if token_weights is not None:
        check_float_tensor(token_weights, "token_weights", (batch, length), "[B, L]", same)
    beta = check_float(beta, "beta", minimum=0.0)
    if beta > 0 and ref_logp is None:
        raise ValueError("ref_logp is required when beta > 0")
    eps_low = check_float(eps_low, "eps_low", minimum=0.0, maximum=1.0, exclusive_maximum=True)
    eps_high = eps_low if eps_high is None else check_float(eps_high, "eps_high", minimum=0.0)
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_choice(importance_level, "importance_level", IMPORTANCE_LEVELS)
    if max_completion_length is not None:
        if loss_type != "dr_grpo":
            raise ValueError(f"max_completion_length is only used by loss_type='dr_grpo', got loss_type={loss_type!r}")
        check_int(max_completion_length, "max_completion_length", low=1)
    num_items_in_batch = check_token_count(num_items_in_batch, "num_items_in_batch", same)
    if num_items_in_batch is not None and loss_type != "dapo":
        raise ValueError(f"num_items_in_batch is only used by loss_type='dapo', got loss_type={loss_type!r}")

    dtype = compute_dtype(logp, old_logp, advantages, ref_logp, token_weights)
    zero = logp.new_zeros((), dtype=dtype)
    current = torch.where(mask, logp.to(dtype), zero)
    old = current.detach() if old_logp is None else torch.where(mask, old_logp.to(dtype), zero)
    adv = advantages.to(dtype)[:, None]
    counted = mask.to(dtype)
    tokens_per_row = counted.sum(dim=1, keepdim=True).clamp(min=1.0)

    if importance_level == "token":
        log_ratio = current - old
    else:
        sequence_log_ratio = ((current - old).sum(dim=1, keepdim=True) / tokens_per_row).detach()
        log_ratio = sequence_log_ratio + current - current.detach()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    if token_weights is not None:
        surrogate = surrogate * token_weights.to(dtype)
    per_token = -surrogate
    if ref_logp is not None:
        kl = k3_kl(torch.where(mask, ref_logp.to(dtype), zero), current)
        per_token = per_token + beta * kl
    per_token = torch.where(mask, per_token, zero)

    if loss_type == "grpo":
        loss = (per_token.sum(dim=1, keepdim=True) / tokens_per_row).mean()
    elif loss_type == "dr_grpo":
        width = mask.any(dim=0).sum().clamp(min=1) if max_completion_length is None else max_completion_length
        loss = per_token.sum() / (batch * width)
    elif num_items_in_batch is None:  # "bnpo", or "dapo" on a single process
        loss = per_token.sum() / counted.sum().clamp(min=1.0)
    else:
        divisor = num_items_in_batch.to(dtype) if isinstance(num_items_in_batch, Tensor) else num_items_in_batch
        loss = per_token.sum() / divisor

    with torch.no_grad():
        total = counted.sum().clamp(min=1.0)
        low = ((ratio < 1.0 - eps_low) & (adv < 0) & mask).to(dtype).sum() / total
        high = ((ratio > 1.0 + eps_high) & (adv > 0) & mask).to(dtype).sum() / total
        metrics = {
            "clip_fraction_low": low,
            "clip_fraction_high": high,
            "clip_fraction": low + high,
            "ratio_mean": (ratio * counted).sum() / total,
        }
        if ref_logp is not None:
            metrics["kl_mean"] = kl.sum() / total
    return loss, metrics
