"""The objectives of the loop, each combinable with DACA (SML masks and DPS token weights).

- ``grpo``: :func:`daca_kernels.grpo_loss` on per-token estimates of the configured estimator
  (with ``beta > 0``, a k3 KL penalty to the frozen SFT policy, estimated on the same masks).
- ``bgpo``: :func:`daca_kernels.bgpo_loss` on per-sample sequence scores
  ``l_j = (1 / t_j) sum_{i scored in j} w_i log p_j(y_i)``, back-propagated sample by sample
  (:func:`daca_kernels.bgpo_backward`: memory of one sample whatever n).
- ``spg``: :func:`daca_kernels.spg_loss` (ELBO for A >= 0, the configured upper bound for A < 0)
  on the same per-sample log-probabilities.
- ``dispo``: the ``grpo`` loss on the final completions plus ``dispo_alpha`` times
  :func:`daca_kernels.dispo_step_loss` at a cached intermediate state: Z fillings of its masked
  positions resampled from the rollout's cache (no extra rollout), scored by the task, and the
  one-step surrogate ``log p(filled token | state)`` trained on the newly filled positions only.

Monte-Carlo samples of ``bgpo``/``spg``: with ``estimator="elbo"`` they are independent ELBO masks
(``elbo_samples`` of them; SPG's block-wise masks with ``mask_block_length``); with
``estimator="stratified"`` (DACA) they are the K complementary SML strata, ``t_k`` the fraction of
the answer that stratum k scores. DPS weights enter every objective through the token weights (for
DiSPO: its terminal loss; the fillings of a branch have no commit history to score).

Every estimator masks the generated region (``Rollout.completion_mask``) and scores the answer
(``RolloutBatch.mask``: up to and including the first ``[EOS]``), and every loss counts the answer
tokens, as d1, DiffuCoder and SPG do. ``dr_grpo`` divides by the number of rollouts times the
generation length G, as TRL's ``max_completion_length``; ``dapo``, ``cispo`` and ``vespo`` by the
answer tokens of the global batch; ``grpo``, ``sapo`` and ``luspo`` average over the rollouts.

The ``reference`` backend computes the same quantities from full logits with ``daca_kernels.reference``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from daca_kernels import bgpo_backward, dispo_step_loss, elbo_sample_scores, grpo_loss, mixed_objective, reference, spg_loss
from daca_kernels.losses.grpo import TOKEN_COUNT_LOSS_TYPES
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.rollout import Rollout
from integration.config import RunConfig
from integration.estimators import branch_logprob, estimate_logprob, sample_logprob, sample_masks


@dataclass
class BranchBatch:
    """DiSPO's fillings of one state per row, ``R = B * Z`` rows with each row's Z fillings consecutive."""

    state: Tensor
    """long ``[B, L]``: the cached state (mask id at the positions to fill)."""
    fillings: Tensor
    """long ``[R, L]``: the completed sequences."""
    filled: Tensor
    """bool ``[R, L]``: the positions each filling filled."""
    rewards: Tensor
    """float32 ``[R]``: the task reward of each filling."""
    global_filled: Tensor
    """0-d: filled tokens over every process (the step loss's normaliser)."""


@dataclass
class RolloutBatch:
    """What one step trains on (this process's share of the global batch)."""

    rollout: Rollout
    rewards: Tensor
    advantages: Tensor
    mask: Tensor
    """bool ``[B, L]``: the answer tokens (``Rollout.answer_mask``), scored by the estimators and
    counted by the losses; the estimators mask all of ``rollout.completion_mask``."""
    weights: Tensor | None
    global_tokens: Tensor
    seeds: list[int]
    row_offset: int
    world_size: int = 1
    branch: BranchBatch | None = None
    old: list = field(default_factory=list)
    """Per inner iteration: old-policy per-token estimates (grpo, dispo), per-sample scores
    ``[n, B]`` (bgpo) or None (spg; and iteration 0 of grpo/dispo, where old equals current)."""
    old_step: list = field(default_factory=list)
    """DiSPO: per inner iteration, the old step log-probabilities ``[R, L]`` (None at iteration 0)."""
    ref: list = field(default_factory=list)
    """With ``beta > 0`` (grpo, dispo): per inner iteration, the reference policy's per-token estimates."""


def _terminal_estimate(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int) -> Tensor:
    rollout = batch.rollout
    return estimate_logprob(lm, config, rollout.sequences, rollout.completion_mask, batch.mask, rollout.attention_mask,
                            seed=seed, row_offset=batch.row_offset)


def _samples(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int):
    rollout = batch.rollout
    return sample_masks(lm, config, rollout.sequences, rollout.completion_mask, batch.mask, rollout.attention_mask,
                        seed=seed, row_offset=batch.row_offset)


def _sample_scores(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, sample) -> Tensor:
    masked, scored, t = sample
    logp = sample_logprob(lm, config, batch.rollout.sequences, masked, scored, batch.rollout.attention_mask)
    scores = reference.losses.elbo_sample_scores if config.backend == "reference" else elbo_sample_scores
    return scores(logp[None], scored[None], t[None].to(logp.dtype), token_weights=batch.weights)[0].float()


def _step_logprob(lm: MaskedLM, config: RunConfig, batch: RolloutBatch) -> Tensor:
    branch = batch.branch
    return branch_logprob(lm, config, branch.state, batch.rollout.attention_mask, branch.fillings, branch.filled)


@torch.no_grad()
def prepare_old(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, reference_lm: MaskedLM | None = None) -> None:
    """Fill ``batch.old`` (and ``batch.old_step``) with the sampling policy's values, and
    ``batch.ref`` with the frozen reference policy's (``reference_lm``, needed when ``beta > 0``)."""
    if config.objective == "bgpo":
        batch.old = [torch.stack([_sample_scores(lm, config, batch, s) for s in _samples(lm, config, batch, seed)])
                     for seed in batch.seeds]
    elif config.objective == "spg":
        batch.old = [None] * len(batch.seeds)
    else:
        batch.old = [None] + [_terminal_estimate(lm, config, batch, seed) for seed in batch.seeds[1:]]
    if config.objective == "dispo":
        step = _step_logprob(lm, config, batch) if len(batch.seeds) > 1 else None
        batch.old_step = [None] + [step] * (len(batch.seeds) - 1)
    if config.beta > 0 and config.objective in ("grpo", "dispo"):
        if reference_lm is None:
            raise ValueError("reference_lm is required when beta > 0")
        batch.ref = [_terminal_estimate(reference_lm, config, batch, seed) for seed in batch.seeds]


def _grpo_terms(config: RunConfig, batch: RolloutBatch) -> tuple[dict, float]:
    """Normaliser kwargs and loss factor making the sum over processes the global batch's loss."""
    if config.loss_type in TOKEN_COUNT_LOSS_TYPES:
        return {"num_items_in_batch": batch.global_tokens}, 1.0
    if config.loss_type == "bnpo":
        return {}, float(batch.mask.sum()) / float(batch.global_tokens)
    if config.loss_type == "dr_grpo":
        rollout = batch.rollout
        return {"max_completion_length": rollout.sequences.shape[1] - rollout.prompt_length}, 1.0 / batch.world_size
    return {}, 1.0 / batch.world_size


def _grpo_loss(lm, config: RunConfig, batch: RolloutBatch, iteration: int) -> tuple[Tensor, dict]:
    logp = _terminal_estimate(lm, config, batch, batch.seeds[iteration])
    normaliser, factor = _grpo_terms(config, batch)
    kwargs = dict(token_weights=batch.weights, beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                  loss_type=config.loss_type, ref_logp=batch.ref[iteration] if batch.ref else None)
    if config.backend == "reference":
        loss, metrics = reference.losses.grpo_loss(logp, batch.old[iteration], batch.advantages, batch.mask, **kwargs,
                                                   **normaliser)
    else:
        loss, metrics = grpo_loss(logp, batch.old[iteration], batch.advantages, batch.mask, **kwargs, **normaliser)
    return loss * factor, {"clip_fraction": float(metrics["clip_fraction"])}


def _bgpo_backward(lm, config: RunConfig, batch: RolloutBatch, iteration: int) -> tuple[float, dict]:
    samples = _samples(lm, config, batch, batch.seeds[iteration])
    old = batch.old[iteration]
    advantages = batch.advantages / batch.world_size
    if config.backend == "reference":
        scores = torch.stack([_sample_scores(lm, config, batch, s) for s in samples])
        loss = reference.losses.bgpo_loss(scores, old, advantages)
        loss.backward()
        return loss.item(), {}
    loss, _ = bgpo_backward(lambda j: _sample_scores(lm, config, batch, samples[j]), len(samples), old, advantages)
    return loss.item(), {}


def _spg_loss(lm, config: RunConfig, batch: RolloutBatch, iteration: int) -> Tensor:
    samples = _samples(lm, config, batch, batch.seeds[iteration])
    rollout = batch.rollout
    logp = torch.stack([sample_logprob(lm, config, rollout.sequences, m, s, rollout.attention_mask) for m, s, _ in samples])
    scored = torch.stack([s for _, s, _ in samples])
    t = torch.stack([t for _, _, t in samples]).to(logp.dtype)
    weights = batch.weights
    kwargs = dict(negative_bound=config.spg_bound, beta=config.spg_beta, mix_weight=config.spg_mix_weight,
                  token_weights=weights)
    if config.backend == "reference":
        return reference.losses.spg_loss(logp, scored, t, batch.mask, batch.advantages, **kwargs)
    loss, _ = spg_loss(logp, scored, t, batch.mask, batch.advantages, **kwargs, num_items_in_batch=batch.global_tokens)
    return loss


def _dispo_step_loss(lm, config: RunConfig, batch: RolloutBatch, iteration: int) -> Tensor:
    branch = batch.branch
    logp = _step_logprob(lm, config, batch)
    kwargs = dict(epsilon=config.epsilon, epsilon_high=config.epsilon_high)
    z = config.dispo_fillings
    if config.backend == "reference":
        return reference.losses.dispo_step_loss(logp, batch.old_step[iteration], branch.filled, branch.rewards, z, **kwargs)
    loss, _ = dispo_step_loss(logp, batch.old_step[iteration], branch.filled, branch.rewards, z, **kwargs,
                              num_items_in_batch=branch.global_filled)
    return loss


def backward_objective(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, iteration: int) -> tuple[float, dict]:
    """The loss of inner iteration ``iteration`` (this process's share of the global batch's loss),
    back-propagated into the parameters' ``.grad``. Returns ``(loss value, metrics)``."""
    if config.objective == "bgpo":
        return _bgpo_backward(lm, config, batch, iteration)
    metrics = {}
    if config.objective == "spg":
        loss = _spg_loss(lm, config, batch, iteration)
    else:
        loss, metrics = _grpo_loss(lm, config, batch, iteration)
        if config.objective == "dispo":
            step = _dispo_step_loss(lm, config, batch, iteration)
            metrics["step_loss"] = step.item()
            loss = mixed_objective(loss, step, alpha_base=1.0, alpha_step=config.dispo_alpha)
    loss.backward()
    return loss.item(), metrics
