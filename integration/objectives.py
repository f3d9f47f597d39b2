"""The objectives of the loop, each combinable with DACA (SML masks and DPS token weights).

- ``grpo``: [`daca_kernels.grpo_loss`][daca_kernels.losses.grpo.grpo_loss] on per-token estimates of the configured estimator
  (with ``beta > 0``, a k3 KL penalty to the frozen SFT policy, estimated on the same masks).
- ``bgpo``: [`daca_kernels.bgpo_loss`][daca_kernels.losses.bgpo.bgpo_loss] on per-sample sequence scores
  ``l_j = (1 / t_j) sum_{i scored in j} w_i log p_j(y_i)``, back-propagated sample by sample
  ([`daca_kernels.bgpo_backward`][daca_kernels.losses.bgpo.bgpo_backward]: memory of one sample whatever n).
- ``spg``: [`daca_kernels.spg_loss`][daca_kernels.losses.spg.spg_loss] (ELBO for A >= 0, the configured upper bound for A < 0)
  on the same per-sample log-probabilities.
- ``dispo``: the ``grpo`` loss on the final completions plus ``dispo_alpha`` times
  [`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss] at a cached intermediate state: Z fillings of its masked
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

The step itself (the values, the losses and their normalisation, BGPO's sample-by-sample backward)
is the library's [`daca_kernels.rl_step`][daca_kernels.rl_step], which the TRL trainer calls too; this module builds its
batch from the loop's ([`step_batch`][integration.objectives.step_batch]) and sums the processes' gradients (``gradients="summed"``:
[`normaliser`][integration.objectives.normaliser]). The ``reference`` backend computes the same quantities from full logits with
``daca_kernels.reference`` (the estimators of [`integration.estimators`][integration.estimators], the losses of
``daca_kernels.reference.losses``) on the same masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from daca_kernels import mixed_objective, reference
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.objectives import OBJECTIVES
from daca_kernels.rl_step import (
    Fillings,
    Normaliser,
    StepBatch,
    StepOptions,
    chunk_normaliser,
    mask_samples,
    normalised_grpo_loss,
    objective_loss,
    old_values,
    reference_values,
    step_logprob,
)
from daca_kernels.rollout import Rollout
from integration.config import RunConfig
from integration.estimators import branch_logprob, estimate_logprob, sample_logprob


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
    branch: Fillings | None = None
    """DiSPO (objective ``dispo``): the fillings of each row's branch state, with their rewards."""
    global_filled: Tensor | None = None
    """DiSPO: 0-d, the filled tokens over every process (the step loss's normaliser)."""
    old: list = field(default_factory=list)
    """Per inner iteration: old-policy per-token estimates (grpo, dispo), per-sample scores
    ``[n, B]`` (bgpo) or None (spg; and iteration 0 of grpo/dispo, where old equals current)."""
    old_step: list = field(default_factory=list)
    """DiSPO: per inner iteration, the old step log-probabilities ``[R, L]`` (None at iteration 0)."""
    ref: list = field(default_factory=list)
    """With ``beta > 0`` (grpo, dispo): per inner iteration, the reference policy's per-token estimates."""
    sampling: dict = field(default_factory=dict)
    """An approximate rollout's sampling/scoring gap
    ([`daca_kernels.rl_step.sampling_importance_weights`][daca_kernels.rl_step.sampling_importance_weights]'s
    metrics, floats), empty for an exact one without the correction."""


def step_options(config: RunConfig) -> StepOptions:
    """The run's objective, estimator and loss settings ([`daca_kernels.rl_step.StepOptions`][daca_kernels.rl_step.StepOptions])."""
    loss_settings = {name: getattr(config, name) for name in ("beta", "epsilon", "epsilon_high", "loss_type")}
    return StepOptions.from_config(config.diffusion, **loss_settings)


def step_batch(config: RunConfig, batch: RolloutBatch) -> StepBatch:
    """``batch`` as [`daca_kernels.rl_step`][daca_kernels.rl_step] reads it (Dr. GRPO's constant: the generation length G)."""
    rollout = batch.rollout
    return StepBatch(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                     completion_mask=rollout.completion_mask, loss_mask=batch.mask, advantages=batch.advantages,
                     generation_length=rollout.sequences.shape[1] - rollout.prompt_length, row_offset=batch.row_offset,
                     token_weights=batch.weights, fillings=batch.branch)


def normaliser(batch: RolloutBatch) -> Normaliser:
    """The divisors that make the sum of the processes' losses the global batch's loss."""
    return chunk_normaliser(batch.global_tokens, batch.global_filled,
                            processes=batch.world_size, gradients="summed")


# The reference backend: full logits (integration.estimators) and daca_kernels.reference's losses.
def _reference_estimate(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int) -> Tensor:
    rollout = batch.rollout
    return estimate_logprob(lm, config, rollout.sequences, rollout.completion_mask, batch.mask, rollout.attention_mask,
                            seed=seed, row_offset=batch.row_offset)


def _reference_sample_logprob(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int):
    """``(logp [n, B, L], scored [n, B, L], t [n, B])`` of the mask samples of ``seed``."""
    samples = mask_samples(lm, step_options(config), step_batch(config, batch), seed)
    rollout = batch.rollout
    logp = torch.stack([sample_logprob(lm, rollout.sequences, s.masked, s.scored, rollout.attention_mask)
                        for s in samples])
    return logp, torch.stack([s.scored for s in samples]), torch.stack([s.t for s in samples]).to(logp.dtype)


def _reference_scores(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int) -> Tensor:
    return reference.losses.elbo_sample_scores(*_reference_sample_logprob(lm, config, batch, seed),
                                               token_weights=batch.weights).float()


def _reference_step_logprob(lm: MaskedLM, config: RunConfig, batch: RolloutBatch) -> Tensor:
    branch = batch.branch
    return branch_logprob(lm, branch.state, batch.rollout.attention_mask, branch.fillings, branch.filled)


def _old(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int) -> Tensor | None:
    """[`daca_kernels.rl_step.old_values`][daca_kernels.rl_step.old_values] of the configured backend."""
    if config.backend == "fused":
        return old_values(lm, step_options(config), step_batch(config, batch), seed)
    if config.diffusion.objective == "bgpo":
        return _reference_scores(lm, config, batch, seed)
    return None if config.diffusion.objective == "spg" else _reference_estimate(lm, config, batch, seed)


def _step(lm: MaskedLM, config: RunConfig, batch: RolloutBatch) -> Tensor:
    if config.backend == "fused":
        return step_logprob(lm, step_batch(config, batch))
    return _reference_step_logprob(lm, config, batch)


def _ref(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, seed: int) -> Tensor:
    if config.backend == "fused":
        return reference_values(lm, step_options(config), step_batch(config, batch), seed)
    return _reference_estimate(lm, config, batch, seed)


@torch.no_grad()
def prepare_old(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, reference_lm: MaskedLM | None = None) -> None:
    """Fill ``batch.old`` (and ``batch.old_step``) with the sampling policy's values, and
    ``batch.ref`` with the frozen reference policy's (``reference_lm``, needed when ``beta > 0``).
    Iteration 0 of grpo and dispo is on-policy (None); BGPO's scores are kept for every iteration."""
    first = 0 if config.diffusion.objective == "bgpo" else 1
    batch.old = [None] * first + [_old(lm, config, batch, seed) for seed in batch.seeds[first:]]
    if OBJECTIVES[config.diffusion.objective].fillings:
        step = _step(lm, config, batch) if len(batch.seeds) > 1 else None
        batch.old_step = [None] + [step] * (len(batch.seeds) - 1)
    if step_options(config).needs_reference:
        if reference_lm is None:
            raise ValueError("reference_lm is required when beta > 0")
        batch.ref = [_ref(reference_lm, config, batch, seed) for seed in batch.seeds]


def _reference_loss(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, iteration: int) -> tuple[Tensor, dict]:
    """The reference backend's loss of inner iteration ``iteration`` (BGPO with every sample's graph)."""
    seed, losses = batch.seeds[iteration], reference.losses
    if config.diffusion.objective == "bgpo":
        scores = _reference_scores(lm, config, batch, seed)
        return losses.bgpo_loss(scores, batch.old[iteration], batch.advantages / batch.world_size), {}
    if config.diffusion.objective == "spg":
        logp, scored, t = _reference_sample_logprob(lm, config, batch, seed)
        return losses.spg_loss(logp, scored, t, batch.mask, batch.advantages, negative_bound=config.diffusion.spg_bound,
                               beta=config.diffusion.spg_beta, mix_weight=config.diffusion.spg_mix_weight, token_weights=batch.weights), {}
    logp = _reference_estimate(lm, config, batch, seed)
    loss, metrics = normalised_grpo_loss(step_options(config), step_batch(config, batch), logp, batch.old[iteration],
                                         batch.ref[iteration] if batch.ref else None, normaliser(batch),
                                         loss_fn=losses.grpo_loss)
    if config.diffusion.objective == "dispo":
        branch = batch.branch
        step = losses.dispo_step_loss(_reference_step_logprob(lm, config, batch), batch.old_step[iteration],
                                      branch.filled, branch.rewards, config.diffusion.dispo_fillings, epsilon=config.epsilon,
                                      epsilon_high=config.epsilon_high)
        metrics["dispo/step_loss"] = step.detach()
        loss = mixed_objective(loss, step, alpha_base=1.0, alpha_step=config.diffusion.dispo_alpha)
    return loss, metrics


def backward_objective(lm: MaskedLM, config: RunConfig, batch: RolloutBatch, iteration: int) -> tuple[float, dict]:
    """The loss of inner iteration ``iteration`` (this process's share of the global batch's loss),
    back-propagated into the parameters' ``.grad``. Returns ``(loss value, metrics)``: the clip
    fraction (grpo, dispo) and DiSPO's step loss."""
    if config.backend == "reference":
        loss, metrics = _reference_loss(lm, config, batch, iteration)
        loss.backward()
    else:
        loss, metrics = objective_loss(lm, step_options(config), step_batch(config, batch), batch.seeds[iteration],
                                       normaliser(batch), old=batch.old[iteration],
                                       ref=batch.ref[iteration] if batch.ref else None,
                                       old_step=batch.old_step[iteration] if batch.old_step else None,
                                       backward=Tensor.backward)
    recorded = {"clip_fraction": float(metrics["clip_fraction"])} if "clip_fraction" in metrics else {}
    if "dispo/step_loss" in metrics:
        recorded["step_loss"] = float(metrics["dispo/step_loss"])
    return loss.item(), recorded
