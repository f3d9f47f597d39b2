"""SPG: sandwiched policy gradient, a lower bound of ``A * log pi`` for either sign of A.

For a sequence with ``A >= 0`` it uses ``A * ELBO`` (ELBO <= log pi); for ``A < 0`` it uses
``A * U`` with U an upper bound of log pi, so that ``A * bound <= A * log pi`` for every sequence
and the summed objective bounds the true one from below (both bounds are estimated by Monte Carlo,
so the inequalities hold for the bounds, not for every draw). From n samples (mask ratio ``t_j``,
masked set ``M_j``, token log-probabilities ``logp_j``) of sequence b:

- ELBO: ``mean_j (1 / t_j) sum_{i in M_j} w_i logp_ji`` ([`elbo_sample_scores`][daca_kernels.losses.elbo.elbo_sample_scores]);
- EUBO (Renyi bound, ``beta >= 1``): per completion token i that at least one sample masked (a
  covered token), ``u_i = (1 / beta) w_i log mean_j [ (1 / t_j) 1[i in M_j] p_ji ** beta ]``,
  computed as a log-mean-exp of ``beta * logp_ji - log t_j`` over the samples that masked token i
  (stable for very negative log-probabilities). The weight ``1 / t`` is the ELBO's own (so both
  bounds estimate log pi on the same, per-sequence sum, scale); t is the mask ratio reported for
  each sample (SPG uses the empirical fraction of masked completion tokens). A token that no
  sample masked carries no information; ``uncovered`` says how the bound treats it:

  - ``"spg"`` (default), SPG's released rule: ``EUBO_b = n_b * mean over covered i of u_i`` with
    ``n_b`` the row's completion length (the tokens of ``completion_mask``), i.e. the uncovered
    tokens are counted at the covered tokens' average (0 for a row with none covered);
  - ``"zero"``: ``EUBO_b = sum over covered i of u_i``, uncovered tokens count 0. The two differ by
    the factor ``n_b / covered_b``, which is 1 once every token is covered.
- mixture: ``mix_weight * EUBO + (1 - mix_weight) * ELBO``.

``w_i`` are optional per-token weights (DPS), applied to each token's term of either bound. The
loss is ``-sum_b A_b * bound_b / N`` with N the number of completion tokens: SPG's length-weighted
average of per-token bounds, ``sum_b len_b * (A_b * bound_b / len_b) / sum_b len_b``.

Compared with SPG's released trainer (``spg/spg_trainer.py``: ``SPGTrainer._get_per_seq_logps``
and ``compute_loss``): it computes per-sequence means (the ELBO terms as the mean log-probability
of each sample's scored tokens, the EUBO over the covered tokens) and weights each sequence's loss
by its completion length ``n_b`` (the tokens up to and including the first EOS), which is the
per-sequence sum above with ``t_j`` = the sample's fraction of those tokens masked (what
[`daca_kernels.elbo_samples`][daca_kernels.likelihood.elbo.elbo_samples] reports) and ``uncovered="spg"``. SPG counts a covered token
whose mean ``p ** beta / t`` underflows to 0 in float32 as uncovered; here the log-mean-exp keeps
it. SPG has no token weights and no KL term.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from daca_kernels.losses.checks import (
    check_mask_ratios,
    check_token_count,
    compute_dtype,
    poison_invalid,
)
from daca_kernels.losses.elbo import elbo_sample_scores
from daca_kernels.validation import (
    FLOAT_DTYPES,
    check_bool_tensor,
    check_choice,
    check_float,
    check_float_tensor,
    check_tensor,
)

NEGATIVE_BOUNDS = ("eubo", "mix", "elbo")
UNCOVERED = ("spg", "zero")


def eubo_scores(
    sample_logp: Tensor,
    sample_masks: Tensor,
    mask_ratios: Tensor,
    beta: float,
    token_weights: Tensor | None = None,
    *,
    completion_mask: Tensor | None = None,
    uncovered: str = "spg",
) -> Tensor:
    """SPG's Renyi upper bound of each sequence's log-likelihood (module docstring).

    sample_logp: floating ``[n, B, L]``; sample_masks: bool ``[n, B, L]``, the tokens each sample
    masked (counted only inside ``completion_mask`` when it is given); mask_ratios: ``[n, B]``, each
    sample's t in (0, 1] (0 only for a sample that masks nothing; any other value, NaN included, is
    a ValueError when run eagerly and makes the row's bound NaN under ``torch.compile``, as in
    [`elbo_sample_scores`][daca_kernels.losses.elbo.elbo_sample_scores]); beta >= 1; token_weights: ``[B, L]`` or None; completion_mask:
    bool ``[B, L]``, the completion tokens (their count per row is ``n_b``), required by
    ``uncovered="spg"``; uncovered: ``"spg"`` (SPG's released rule: the mean over covered tokens
    times ``n_b``) or ``"zero"`` (uncovered tokens count 0). Returns ``[B]`` (float32, float64 if any input is float64), differentiable in
    ``sample_logp``.
    """
    check_tensor(sample_logp, "sample_logp", ndim=3, dtypes=FLOAT_DTYPES)
    num_samples, batch, length = sample_logp.shape
    if num_samples == 0:
        raise ValueError(f"sample_logp must hold at least one sample, got shape {tuple(sample_logp.shape)}")
    same = (sample_logp, "sample_logp")
    check_bool_tensor(sample_masks, "sample_masks", (num_samples, batch, length), "[n, B, L]", same)
    check_float_tensor(mask_ratios, "mask_ratios", (num_samples, batch), "[n, B]", same)
    if token_weights is not None:
        check_float_tensor(token_weights, "token_weights", (batch, length), "[B, L]", same)
    if completion_mask is not None:
        check_bool_tensor(completion_mask, "completion_mask", (batch, length), "[B, L]", same)
    beta = check_float(beta, "beta", minimum=1.0)
    check_choice(uncovered, "uncovered", UNCOVERED)
    if uncovered == "spg" and completion_mask is None:
        raise ValueError("completion_mask is required with uncovered='spg' (the bound is scaled to the completion length)")
    masks = sample_masks if completion_mask is None else sample_masks & completion_mask
    valid = check_mask_ratios(mask_ratios, masks).all(dim=0)
    dtype = compute_dtype(sample_logp, mask_ratios, token_weights)
    exponent = beta * sample_logp.to(dtype) - torch.log(mask_ratios.to(dtype))[..., None]
    exponent = torch.where(masks, exponent, torch.full_like(exponent, -math.inf))
    # -inf for a token that no sample masked; torch.where below drops it (and its NaN gradient).
    per_token = (torch.logsumexp(exponent, dim=0) - math.log(num_samples)) / beta
    if token_weights is not None:
        per_token = per_token * token_weights.to(dtype)
    covered = masks.any(dim=0)
    bound = torch.where(covered, per_token, per_token.new_zeros(())).sum(dim=-1)
    if uncovered == "spg":
        scale = completion_mask.to(dtype).sum(dim=-1) / covered.to(dtype).sum(dim=-1).clamp(min=1.0)
        bound = bound * scale
    return poison_invalid(bound, valid)


def spg_loss(
    sample_logp: Tensor,
    sample_masks: Tensor,
    mask_ratios: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    *,
    negative_bound: str = "eubo",
    beta: float = 1.0,
    mix_weight: float = 0.5,
    token_weights: Tensor | None = None,
    num_items_in_batch: float | Tensor | None = None,
    uncovered: str = "spg",
) -> tuple[Tensor, dict[str, Tensor]]:
    """SPG's loss (module docstring) from the outputs of ``elbo_samples``.

    Args:
        sample_logp: floating ``[n, B, L]``, per-sample per-token log-probabilities under the
            current policy (differentiable); values at tokens a sample did not mask are ignored.
        sample_masks: bool ``[n, B, L]``, the tokens each sample masked (counted only inside
            ``completion_mask``).
        mask_ratios: floating ``[n, B]``, each sample's mask ratio t in (0, 1] (t = 0 only for a
            sample that masks nothing); any other value (NaN included) is a ValueError when run
            eagerly, and makes the loss NaN under ``torch.compile`` ([`elbo_sample_scores`][daca_kernels.losses.elbo.elbo_sample_scores]).
        completion_mask: bool ``[B, L]``, the completion tokens.
        advantages: ``[B]``; ``A >= 0`` uses the ELBO, ``A < 0`` the ``negative_bound``.
        negative_bound: ``"eubo"`` (the default: the Renyi upper bound, the sandwich itself),
            ``"mix"`` (``mix_weight * EUBO + (1 - mix_weight) * ELBO``) or ``"elbo"`` (the ELBO for
            every sequence: the ablation). The TRL trainer's ``spg_bound`` and the reference loop's
            ``RunConfig.spg_bound`` default to ``"mix"`` instead. SPG's released trainer has no
            default (its ``logp_estimation`` must be set) and its scripts train both ``"eubo"``
            and ``"mix"`` (``mix_weight=0.5``); the reward curves its README shows are those of
            the mixture, the variant the trainers default to. Pass ``negative_bound="mix"`` for
            the trainers' loss.
        beta: the Renyi order, ``>= 1`` (SPG uses 1.0 to 2.0).
        mix_weight: in ``[0, 1]``, for ``"mix"``.
        token_weights: floating ``[B, L]`` (DPS) or None.
        num_items_in_batch: the divisor N (default ``completion_mask.sum()``); for several processes
            pass the global completion-token count (divided by the number of processes when their
            gradients are averaged), as ``grpo_loss``'s DAPO normalisation.
        uncovered: the EUBO's treatment of tokens no sample masked, as in [`eubo_scores`][daca_kernels.losses.spg.eubo_scores]:
            ``"spg"`` (SPG's released rule, the default) or ``"zero"``.

    Returns ``(loss, metrics)``: the 0-d loss (float32, float64 if any input is float64) and
    detached means over the B sequences: ``elbo_mean``, ``eubo_mean`` (unless
    ``negative_bound="elbo"``), and ``negative_fraction`` (share of sequences with A < 0).
    """
    check_tensor(sample_logp, "sample_logp", ndim=3, dtypes=FLOAT_DTYPES)
    num_samples, batch, length = sample_logp.shape
    if sample_logp.numel() == 0:
        raise ValueError(f"sample_logp must be non-empty, got shape {tuple(sample_logp.shape)}")
    same = (sample_logp, "sample_logp")
    check_bool_tensor(sample_masks, "sample_masks", (num_samples, batch, length), "[n, B, L]", same)
    check_float_tensor(mask_ratios, "mask_ratios", (num_samples, batch), "[n, B]", same)
    check_bool_tensor(completion_mask, "completion_mask", (batch, length), "[B, L]", same)
    check_float_tensor(advantages, "advantages", (batch,), "[B]", same)
    if token_weights is not None:
        check_float_tensor(token_weights, "token_weights", (batch, length), "[B, L]", same)
    check_choice(negative_bound, "negative_bound", NEGATIVE_BOUNDS)
    beta = check_float(beta, "beta", minimum=1.0)
    mix_weight = check_float(mix_weight, "mix_weight", minimum=0.0, maximum=1.0)
    check_choice(uncovered, "uncovered", UNCOVERED)
    num_items_in_batch = check_token_count(num_items_in_batch, "num_items_in_batch", same)

    dtype = compute_dtype(sample_logp, mask_ratios, advantages, token_weights)
    masks = sample_masks & completion_mask
    elbo = elbo_sample_scores(sample_logp, masks, mask_ratios, token_weights=token_weights).mean(dim=0).to(dtype)
    metrics = {"elbo_mean": elbo.detach().mean()}
    if negative_bound == "elbo":
        negative = elbo
    else:
        eubo = eubo_scores(
            sample_logp, masks, mask_ratios, beta, token_weights, completion_mask=completion_mask, uncovered=uncovered
        ).to(dtype)
        metrics["eubo_mean"] = eubo.detach().mean()
        negative = eubo if negative_bound == "eubo" else mix_weight * eubo + (1.0 - mix_weight) * elbo
    adv = advantages.to(dtype)
    bound = torch.where(adv >= 0, elbo, negative)
    if num_items_in_batch is None:
        divisor = completion_mask.to(dtype).sum().clamp(min=1.0)
    elif isinstance(num_items_in_batch, Tensor):
        divisor = num_items_in_batch.to(dtype)
    else:
        divisor = num_items_in_batch
    loss = -(adv * bound).sum() / divisor
    metrics["negative_fraction"] = (adv < 0).to(dtype).mean()
    return loss, metrics
