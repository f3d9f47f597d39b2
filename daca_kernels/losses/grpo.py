"""The GRPO family and TRL's other policy losses: clipped, CISPO, SAPO, LUSPO and VESPO surrogates,
the k3 KL penalty, TRL's normalisations, GSPO.

Conventions follow TRL's ``GRPOTrainer._compute_loss`` (TRL 1.16). Per completion token ``(b, i)``
with ``mask[b, i]``, ``r_bi = exp(logp - old_logp)`` (``importance_sampling_level="token"``), advantage
``A_b`` and token weight ``w_bi`` (1 unless given), the per-token loss is ``-w_bi * surrogate_bi``
plus the KL term, where the surrogate depends on ``loss_type``:

- ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``, ``"luspo"`` (the clipped surrogate)::

      min(min(r, delta) * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)

  with ``delta`` (two-sided clipping, INTELLECT-2) None by default, i.e. ``min(r, delta) = r``;
- ``"cispo"`` (MiniMax-M1): ``sg[min(r, epsilon_high)] * A * logp`` (``sg`` = stop gradient). Here
  ``epsilon_high`` is the cap on the ratio itself, not a distance from 1 (TRL's ``epsilon_high``,
  recommended 5.0 for CISPO);
- ``"sapo"`` (soft adaptive): ``sigmoid(tau * (r - 1)) * 4 / tau * A`` with
  ``tau = sapo_temperature_pos`` where ``A > 0``, else ``sapo_temperature_neg``. Its gradient is
  ``4 s (1 - s) A grad r`` (``s`` the sigmoid): the plain policy gradient at ``r = 1``, smoothly
  damped away from it;
- ``"vespo"``: ``sg[phi_b] * A * logp`` with the Gamma weight of the sequence ratio
  ``w_b = exp(sum_i r~_bi)`` (the *product* of the token ratios; per-token log ratios clamped to
  ``[-20, 20]``, their sum to ``[log 1e-8, 20]``)::

      phi_b = exp(lam + k * log w_b - lam * w_b)      # phi(1) = 1

  with ``(k, lam) = (vespo_k_pos, vespo_lambda_pos)`` where ``A >= 0``, else the ``_neg`` pair
  (``lam`` floored at 1e-4). ``phi_b`` uses the token log ratios whatever ``importance_sampling_level``.
  Where the exponential overflows (``phi_b`` = inf in the compute dtype, possible for large ``k``
  and small ``lam``: the peak ``lam + k log(k / lam) - k`` passes about 88 in float32), or is NaN,
  ``phi_b`` is 0: the sequence gets no gradient, as in TRL.

The KL term is ``beta * k3_kl(ref_logp, logp)``, multiplied by the importance ratio when
``use_bias_correction_kl`` (DeepSeek-V3.2: ``r * k3`` is an unbiased estimate of the reverse KL
under the sampling policy; the ratio is differentiated, so this changes the gradient even on-policy).

The per-token losses are reduced by ``loss_type``:

- ``"grpo"``, ``"sapo"``: mean over each sequence's completion tokens, then mean over the B
  sequences (a row without completion tokens contributes 0 but still counts in B);
- ``"bnpo"``: mean over all completion tokens of this batch;
- ``"dr_grpo"``: sum / (B * max_completion_length) (Dr. GRPO: a constant normaliser). TRL's
  ``GRPOTrainer._compute_loss`` divides by ``B * max_completion_length`` on its ``[B, G]``
  completion layout; pass the generation length G as ``max_completion_length`` for exactly that
  (the default, the number of columns of ``mask`` that hold any token, is G only when some row of
  the batch uses the last generated column);
- ``"dapo"``, ``"cispo"``, ``"vespo"``: sum / the number of completion tokens of the *global*
  batch. On one process that is ``mask.sum()``; with several processes (or gradient accumulation)
  pass ``num_items_in_batch``. It is the divisor itself: when the gradients of P processes are
  *averaged* (DDP), pass the global token count divided by P (as TRL does), so that the averaged
  gradient equals the gradient of ``global sum / global token count``; when they are summed, pass
  the global count;
- ``"luspo"`` (length-unbiased GSPO): sum over each sequence's completion tokens, then mean over
  the B sequences (each sequence weighted by its length; meant for ``importance_sampling_level="sequence"``).

``importance_sampling_level="sequence"`` is GSPO: the ratio of sequence b is
``s_b = exp(mean over its completion tokens of (logp - old_logp))`` and is clipped as a whole. It is
applied per token in GSPO-token form, ``s_bi = sg[s_b] * exp(logp_bi - sg[logp_bi])``: the value of
every token's ratio is ``s_b`` and the gradient of ``s_bi`` is ``s_b * grad logp_bi``. With uniform
token weights the gradient is exactly GSPO's ``-A_b * s_b * mean_i grad logp_bi`` (per sequence,
inside the clip range), and every loss type equals TRL's sequence level; DPS token weights then
weight each token's own gradient, as in the token-level objective. The bias-corrected KL is
multiplied by ``s_b`` itself, differentiated through its mean, as in TRL.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from daca_kernels.losses.checks import check_token_count, compute_dtype
from daca_kernels.validation import (
    FLOAT_DTYPES,
    check_bool,
    check_bool_tensor,
    check_choice,
    check_float,
    check_float_tensor,
    check_int,
    check_tensor,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TOKEN_COUNT_LOSS_TYPES = ("dapo", "cispo", "vespo")
IMPORTANCE_LEVELS = ("token", "sequence")

# VESPO's clamps on the log ratios (per token, then per sequence) and floor on lambda, as in TRL.
VESPO_TOKEN_LOG_RATIO_BOUND = 20.0
VESPO_SEQUENCE_LOG_RATIO_MIN = math.log(1e-8)
VESPO_SEQUENCE_LOG_RATIO_MAX = 20.0
VESPO_MIN_LAMBDA = 1e-4


def k3_kl(ref_logp: Tensor, logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: ``exp(r) - r - 1`` with
    ``r = ref_logp - logp``. Non-negative, 0 where the two agree.

    ref_logp, logp: floating tensors of one shape (any), on one device. Returns that shape, in the
    promoted dtype of the two; differentiable in both.
    """
    check_tensor(ref_logp, "ref_logp", dtypes=FLOAT_DTYPES)
    check_float_tensor(logp, "logp", ref_logp.shape, "of ref_logp", (ref_logp, "ref_logp"))
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def by_sign(condition: Tensor, if_true: float, if_false: float, like: Tensor) -> Tensor:
    """``if_true`` where ``condition``, else ``if_false``, in the dtype of ``like`` (a
    ``torch.where`` of two Python floats would round them to the default dtype, float32)."""
    return torch.where(condition, torch.full_like(like, if_true), torch.full_like(like, if_false))


def vespo_weights(
    token_log_ratio: Tensor, advantages: Tensor, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float
) -> Tensor:
    """VESPO's Gamma weights ``phi_b`` (module docstring), detached.

    Args:
        token_log_ratio: ``[B, L]`` ``logp - old_logp``, zero outside the completion tokens.
        advantages: ``[B, 1]``.

    Returns:
        ``[B, 1]`` in the dtype of ``token_log_ratio``; 0 where the weight is not finite.
    """
    bound = VESPO_TOKEN_LOG_RATIO_BOUND
    with torch.no_grad():
        log_w = token_log_ratio.clamp(-bound, bound).sum(dim=1, keepdim=True)
        log_w = log_w.clamp(VESPO_SEQUENCE_LOG_RATIO_MIN, VESPO_SEQUENCE_LOG_RATIO_MAX)
        nonnegative = advantages >= 0
        k = by_sign(nonnegative, k_pos, k_neg, log_w)
        lam = by_sign(nonnegative, max(lambda_pos, VESPO_MIN_LAMBDA), max(lambda_neg, VESPO_MIN_LAMBDA), log_w)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        # TRL drops a sequence whose weight overflows instead of letting inf reach the loss.
        return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    token_weights: Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | Tensor | None = None,
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of ``loss_type`` (module docstring) as a loss to minimise.

    Args:
        logp: floating ``[B, L]``, log-probabilities of the completion tokens under the current
            policy (differentiable).
        old_logp: ``[B, L]`` under the policy that sampled the completions, or None for
            ``logp.detach()`` (one update per batch: ratio 1, plain policy gradient).
        advantages: ``[B]``, one per sequence (e.g. [`group_advantages`][daca_kernels.losses.advantages.group_advantages]).
        mask: bool ``[B, L]``, the completion tokens that count. Values of ``logp``, ``old_logp``,
            ``ref_logp`` and ``token_weights`` outside it are ignored (they may be anything,
            including inf or NaN) and get zero gradient.
        ref_logp: ``[B, L]`` under the reference policy; required when ``beta > 0``.
        token_weights: ``[B, L]`` per-token weights of the surrogate (DPS), or None for ones.
        beta: KL coefficient (>= 0).
        epsilon: the clip range is ``[1 - epsilon, 1 + epsilon_high]`` (TRL's names);
            ``0 <= epsilon < 1``; unused with ``loss_type="cispo"``.
        epsilon_high: ``>= 0``, defaults to ``epsilon``. With ``loss_type="cispo"`` it is the cap on
            the ratio (e.g. 5.0) and must be given.
        delta: two-sided clipping: the ratio is capped at ``delta`` before the clipped minimum, so
            a token with ``A < 0`` and ``r > delta`` stops contributing gradient. None (default, as
            TRL) for no cap; else ``delta >= 1 + epsilon_high`` (TRL recommends above ``1 + epsilon``).
            Only with the clipped loss types (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``).
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``, ``"cispo"``, ``"sapo"``,
            ``"luspo"`` or ``"vespo"`` (module docstring).
        importance_sampling_level: ``"token"`` (GRPO) or ``"sequence"`` (GSPO); TRL's
            ``importance_sampling_level``.
        max_completion_length: Dr. GRPO's constant, the generation length G; only with
            ``loss_type="dr_grpo"``. Default: the number of columns of ``mask`` with at least one
            True (the completion width in the ``[B, G]`` and the ``[B, P + G]`` layouts alike,
            prompt columns never counted; at least 1).
        num_items_in_batch: the divisor of ``dapo``, ``cispo`` and ``vespo`` (default
            ``mask.sum()``): a Python number > 0 or a 0-d tensor; only with those loss types.
        use_bias_correction_kl: multiply the per-token k3 KL by the importance ratio (token or
            sequence level, differentiated). Default False here, so that the KL term stays d1's
            plain k3 penalty; TRL 1.16's default is True.
        sapo_temperature_pos: SAPO's temperature (> 0) for ``A > 0``; TRL's default 1.0. Used
            only by ``loss_type="sapo"``.
        sapo_temperature_neg: the same for ``A <= 0``; TRL's default 1.05.
        vespo_k_pos: VESPO's Gamma exponent ``k >= 0`` for ``A >= 0``; TRL's default 2.0. The four
            ``vespo_*`` options are used only by ``loss_type="vespo"``.
        vespo_lambda_pos: VESPO's decay ``lambda >= 0`` for ``A >= 0``; TRL's default 3.0.
        vespo_k_neg: the exponent for ``A < 0``; TRL's default 3.0.
        vespo_lambda_neg: the decay for ``A < 0``; TRL's default 2.0.

    Tensors are used as given: pass ``old_logp``, ``ref_logp``, ``advantages`` and
    ``token_weights`` detached. Everything is computed in float32 (float64 if any input is float64).

    Returns:
        ``(loss, metrics)``: the 0-d loss and a dict of detached 0-d tensors, all means over the
        completion tokens of this batch: ``clip_fraction_low`` (ratio below ``1 - epsilon`` with
        A < 0), ``clip_fraction_high`` (above ``1 + epsilon_high`` with A > 0) — the tokens whose
        gradient the clip removes — with ``delta`` also ``clip_fraction_delta`` (above ``delta``
        with A < 0), their sum ``clip_fraction``, ``ratio_mean``, and ``kl_mean`` (the k3 KL,
        without the bias correction) when ``ref_logp`` is given. For ``cispo``,
        ``clip_fraction_high`` counts the tokens with ratio above the cap and A > 0 (as TRL's
        ``cispo_clip_ratio``) and ``clip_fraction_low`` is 0; ``sapo`` and ``vespo`` clip nothing
        (both 0).
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
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    epsilon = check_float(epsilon, "epsilon", minimum=0.0, maximum=1.0, exclusive_maximum=True)
    if loss_type == "cispo" and epsilon_high is None:
        raise ValueError("epsilon_high is required with loss_type='cispo': it is the cap on the ratio (e.g. 5.0)")
    epsilon_high = epsilon if epsilon_high is None else check_float(epsilon_high, "epsilon_high", minimum=0.0)
    if delta is not None:
        if loss_type not in CLIPPED_LOSS_TYPES:
            raise ValueError(
                f"delta is only used by the clipped loss types {CLIPPED_LOSS_TYPES}, got loss_type={loss_type!r}"
            )
        delta = check_float(delta, "delta", minimum=1.0 + epsilon_high)
    check_choice(importance_sampling_level, "importance_sampling_level", IMPORTANCE_LEVELS)
    if max_completion_length is not None:
        if loss_type != "dr_grpo":
            raise ValueError(f"max_completion_length is only used by loss_type='dr_grpo', got loss_type={loss_type!r}")
        check_int(max_completion_length, "max_completion_length", low=1)
    num_items_in_batch = check_token_count(num_items_in_batch, "num_items_in_batch", same)
    if num_items_in_batch is not None and loss_type not in TOKEN_COUNT_LOSS_TYPES:
        raise ValueError(
            f"num_items_in_batch is only used by loss_type in {TOKEN_COUNT_LOSS_TYPES}, got loss_type={loss_type!r}"
        )
    use_bias_correction_kl = check_bool(use_bias_correction_kl, "use_bias_correction_kl")
    positive = dict(minimum=0.0, exclusive_minimum=True)
    sapo_temperature_pos = check_float(sapo_temperature_pos, "sapo_temperature_pos", **positive)
    sapo_temperature_neg = check_float(sapo_temperature_neg, "sapo_temperature_neg", **positive)
    vespo_k_pos = check_float(vespo_k_pos, "vespo_k_pos", minimum=0.0)
    vespo_lambda_pos = check_float(vespo_lambda_pos, "vespo_lambda_pos", minimum=0.0)
    vespo_k_neg = check_float(vespo_k_neg, "vespo_k_neg", minimum=0.0)
    vespo_lambda_neg = check_float(vespo_lambda_neg, "vespo_lambda_neg", minimum=0.0)

    dtype = compute_dtype(logp, old_logp, advantages, ref_logp, token_weights)
    zero = logp.new_zeros((), dtype=dtype)
    current = torch.where(mask, logp.to(dtype), zero)
    old = current.detach() if old_logp is None else torch.where(mask, old_logp.to(dtype), zero)
    adv = advantages.to(dtype)[:, None]
    counted = mask.to(dtype)
    tokens_per_row = counted.sum(dim=1, keepdim=True).clamp(min=1.0)

    token_log_ratio = current - old
    if importance_sampling_level == "token":
        ratio = torch.exp(token_log_ratio)
        kl_ratio = ratio
    else:
        sequence_ratio = torch.exp(token_log_ratio.sum(dim=1, keepdim=True) / tokens_per_row)
        ratio = sequence_ratio.detach() * torch.exp(current - current.detach())
        kl_ratio = sequence_ratio

    none_clipped = torch.zeros_like(mask)
    low_clipped = high_clipped = none_clipped
    if loss_type in CLIPPED_LOSS_TYPES:
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        surrogate = torch.minimum(capped * adv, torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * adv)
        low_clipped = (ratio < 1.0 - epsilon) & (adv < 0)
        high_clipped = (ratio > 1.0 + epsilon_high) & (adv > 0)
    elif loss_type == "cispo":
        surrogate = torch.clamp(ratio, max=epsilon_high).detach() * adv * current
        high_clipped = (ratio > epsilon_high) & (adv > 0)
    elif loss_type == "sapo":
        temperature = by_sign(adv > 0, sapo_temperature_pos, sapo_temperature_neg, adv)
        surrogate = torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature * adv
    else:  # "vespo"
        phi = vespo_weights(token_log_ratio, adv, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        surrogate = phi * adv * current
    if token_weights is not None:
        surrogate = surrogate * token_weights.to(dtype)
    per_token = -surrogate
    if ref_logp is not None:
        kl = k3_kl(torch.where(mask, ref_logp.to(dtype), zero), current)
        per_token = per_token + beta * (kl * kl_ratio if use_bias_correction_kl else kl)
    per_token = torch.where(mask, per_token, zero)

    if loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(dim=1, keepdim=True) / tokens_per_row).mean()
    elif loss_type == "luspo":
        loss = per_token.sum() / batch
    elif loss_type == "dr_grpo":
        width = mask.any(dim=0).sum().clamp(min=1) if max_completion_length is None else max_completion_length
        loss = per_token.sum() / (batch * width)
    elif num_items_in_batch is None:  # "bnpo", or a token-count loss type on a single process
        loss = per_token.sum() / counted.sum().clamp(min=1.0)
    else:
        divisor = num_items_in_batch.to(dtype) if isinstance(num_items_in_batch, Tensor) else num_items_in_batch
        loss = per_token.sum() / divisor

    with torch.no_grad():
        total = counted.sum().clamp(min=1.0)

        def fraction(selected: Tensor) -> Tensor:
            return (selected & mask).to(dtype).sum() / total

        metrics = {"clip_fraction_low": fraction(low_clipped), "clip_fraction_high": fraction(high_clipped)}
        metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
        if delta is not None:
            metrics["clip_fraction_delta"] = fraction((ratio > delta) & (adv < 0))
            metrics["clip_fraction"] = metrics["clip_fraction"] + metrics["clip_fraction_delta"]
        metrics["ratio_mean"] = (ratio * counted).sum() / total
        if ref_logp is not None:
            metrics["kl_mean"] = (kl * counted).sum() / total
    return loss, metrics
