"""The reference backend's estimators (``backend="reference"``), and the loop's DPS weights.

The fused backend's estimates are the library's ([`daca_kernels.rl_step`][daca_kernels.rl_step] over
``daca_kernels.likelihood``). These use only ``daca_kernels.reference`` and full logits
(``model(...).logits``, ``log_softmax``, gather), on exactly the same masks (rebuilt from the same
seeds), so the two backends must agree.

Two masks describe a batch (both bool ``[B, L]``): ``completion_mask``, the generated region
(``Rollout.completion_mask``: every generated position, the padding after the first ``[EOS]``
included), which the estimators mask; and ``loss_mask``, the answer (``Rollout.answer_mask``: up
to and including the first ``[EOS]``), which they score and the losses count. With the one-step
estimator this is d1's diffu-GRPO estimator.

Every estimator returns float32 ``[B, L]`` per-token values whose row sum is its estimate of
``log pi(completion | prompt)``; 0 outside ``loss_mask``. For ``elbo`` the value of token i is
``(1 / n) sum_j 1[i scored in j] log p_j(y_i) / t_j`` (the mean of n single-sample ELBOs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels import reference, stratified_mask
from daca_kernels.credit import dps_weights
from daca_kernels.likelihood.estimator import MaskSample, monte_carlo_masks, prompt_positions
from daca_kernels.likelihood.ratio_masks import coupled_split
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import Rollout
from integration.config import RunConfig


def estimate_logprob(
    lm: MaskedLM,
    config: RunConfig,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    *,
    seed: int,
    row_offset: int = 0,
) -> Tensor:
    """Per-token estimates ``[B, L]`` of the configured estimator from full logits: ``completion_mask``
    masked, ``loss_mask`` scored."""
    model = lm.module

    def logits_fn(ids: Tensor) -> Tensor:
        return model(input_ids=ids, attention_mask=attention_mask).logits

    if config.diffusion.estimator in ("one_step", "stratified"):
        k = 1 if config.diffusion.estimator == "one_step" else config.diffusion.num_strata
        masks = stratified_mask(
            input_ids, completion_mask, k, seed, lm.mask_id, prompt=prompt_positions(completion_mask, attention_mask),
            prompt_mask_prob=config.diffusion.prompt_mask_prob, row_offset=row_offset,
        )
        return reference.masked_copies_logprob(
            logits_fn, input_ids, masks.input_ids, torch.where(loss_mask, masks.strata, -1), shift=lm.shift
        ).float()
    if config.diffusion.estimator == "coupled":
        split = coupled_split(completion_mask, seed, row_offset=row_offset)
        copies = torch.stack([input_ids.masked_fill(split.strata == k, lm.mask_id) for k in range(2)])
        return reference.masked_copies_logprob(
            logits_fn, input_ids, copies, torch.where(loss_mask, split.strata, -1), split.weights, shift=lm.shift
        ).float()
    n = config.diffusion.elbo_samples
    total = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    elbo_masks = sample_masks(lm, config.replace(estimator="elbo"), input_ids, completion_mask, loss_mask,
                              attention_mask, seed=seed, row_offset=row_offset)
    for masked, scored, t in elbo_masks:
        weights = (1.0 / (n * t))[:, None].expand_as(scored)
        total = total + reference.masked_copies_logprob(
            logits_fn, input_ids, input_ids.masked_fill(masked, lm.mask_id)[None], torch.where(scored, 0, -1),
            weights, shift=lm.shift,
        ).float()
    return total


def sample_masks(lm: MaskedLM, config: RunConfig, input_ids: Tensor, completion_mask: Tensor, loss_mask: Tensor,
                 attention_mask: Tensor | None, *, seed: int, row_offset: int = 0) -> list[MaskSample]:
    """Monte-Carlo samples ``(masked, scored, t)`` for BGPO/SPG
    ([`daca_kernels.likelihood.monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks] of the configured estimator)."""
    return monte_carlo_masks(input_ids, completion_mask, loss_mask, attention_mask, seed=seed, mask_id=lm.mask_id,
                             row_offset=row_offset, **config.diffusion.estimator_spec().keywords())


def sample_logprob(lm: MaskedLM, input_ids: Tensor, masked: Tensor, scored: Tensor,
                   attention_mask: Tensor | None) -> Tensor:
    """float32 ``[B, L]``: ``log p(y_i | input masked at masked)`` at the scored positions, 0 elsewhere,
    from full logits."""
    model = lm.module
    return reference.masked_copies_logprob(
        lambda ids: model(input_ids=ids, attention_mask=attention_mask).logits, input_ids,
        input_ids.masked_fill(masked, lm.mask_id)[None], torch.where(scored, 0, -1), shift=lm.shift,
    ).float()


def branch_logprob(lm: MaskedLM, state: Tensor, attention_mask: Tensor | None, fillings: Tensor,
                   filled: Tensor) -> Tensor:
    """DiSPO's one-step surrogate: float32 ``[R, L]`` with ``R = B * Z`` (row ``b * Z + z`` is filling
    z of state b): ``log p(fillings[r, i] | state b)`` at the filled positions, 0 elsewhere. One
    forward pass per state, shared by its Z fillings, full logits."""
    rows = torch.arange(fillings.shape[0], device=state.device) // (fillings.shape[0] // state.shape[0])
    logits = lm.module(input_ids=state, attention_mask=attention_mask).logits.float()
    if lm.shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    logp = torch.log_softmax(logits, dim=-1)[rows].gather(-1, fillings.unsqueeze(-1)).squeeze(-1)
    return torch.where(filled, logp, 0.0)


def token_weights(rollout: Rollout, config: RunConfig, completion_mask: Tensor) -> Tensor | None:
    """DPS weights ``[B, L]`` (mean 1 per row over ``completion_mask``), or None without DPS."""
    if not config.diffusion.dps:
        return None
    kwargs = config.diffusion.dps_options()
    if config.backend == "reference":
        return reference.dps_weights(
            rollout.commit_confidence, rollout.commit_step, rollout.step_gain, completion_mask, **kwargs
        ).float()
    return dps_weights(rollout, completion_mask, **kwargs)
