"""One entry point for the four estimators, and the Monte-Carlo masks of the ELBO-based objectives.

[`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob] picks an estimator by name (``"one_step"``, ``"coupled"``,
``"stratified"``, ``"elbo"``) so that a trainer or a loop configures it with plain settings; every
estimator masks ``completion_mask`` (the generated region) and scores ``loss_mask`` (the answer).
[`monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks] returns the mask samples that BGPO and SPG score one forward
pass each;
[`estimator_masks`][daca_kernels.likelihood.estimator.estimator_masks] returns every forward pass of any estimator (masked input,
context, scored
positions, weights, block partition), so that an estimate can be rebuilt with plain model calls.

Both follow the model's attention: on a block-causal model (``lm.attention == ("block", S)``; pass
``attention=lm.attention`` to [`monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks], which sees no model) every
estimator scores
each block from its noisy copy and the clean blocks before it, with the strata and coupled splits
drawn within each block ([`daca_kernels.likelihood.block_masks`][daca_kernels.likelihood.block_masks]), so that it estimates
``log p(y) = sum_c log p(y_c | prompt, y_<c)`` block by block; the ELBO masks are the same as for a
bidirectional model (an unbiased estimate of the sum of the block ELBOs, see
[`daca_kernels.likelihood.elbo`][daca_kernels.likelihood.elbo]). d1's prompt masking applies unchanged (the drawn prompt
positions are hidden from every prediction); SPG's block-wise masks (``mask_block_length``) are
refused on a block model.

Masks are functions of ``(seed, row_offset + b, position)`` only, so the old, reference and
current passes of one update rebuild the same masks from the same seed, and a process holding rows
``a:c`` of the global batch (``row_offset=a``) sees the masks of those rows of the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from daca_kernels.hashing import seed32
from daca_kernels.likelihood.block_masks import block_coupled_split, block_stratified_mask
from daca_kernels.likelihood.coupled import coupled_logprob_unchecked
from daca_kernels.likelihood.elbo import check_block_length_for, elbo_sample_mask, elbo_sample_mask_unchecked, elbo_sample_unchecked
from daca_kernels.likelihood.masked_passes import check_estimator_inputs, check_positions, check_subset
from daca_kernels.likelihood.ratio_masks import BLOCK_CHOICES, coupled_split
from daca_kernels.likelihood.stratified import stratified_logprob_unchecked
from daca_kernels.models.masked_lm import MaskedLM, block_index, check_attention
from daca_kernels.ops import stratified_mask
from daca_kernels.validation import (
    INDEX_DTYPES,
    check_choice,
    check_int,
    check_probability,
    check_row_offset,
    check_same_device,
    check_shape,
    check_tensor,
    reads_values,
)

ESTIMATORS = ("one_step", "coupled", "stratified", "elbo")
MONTE_CARLO_ESTIMATORS = ("stratified", "elbo")

@dataclass(frozen=True)
class EstimatorSpec:
    """Which estimator a run uses, with its settings: the keyword settings of
    [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob] and
    [`monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks] that a run's configuration holds
    (everything but the per-call ``seed`` and ``row_offset``), checked once at construction.

    ``EstimatorSpec("stratified", num_strata=4)`` is SML with K = 4; the fields mean what the
    keywords of ``estimate_logprob`` of the same names mean (``name`` is its ``estimator``).
    """

    name: str = "one_step"
    """One of [`ESTIMATORS`][daca_kernels.likelihood.estimator.ESTIMATORS]."""
    num_strata: int = 4
    elbo_samples: int = 2
    prompt_mask_prob: float = 0.0
    mask_block_length: int | None = None
    mask_block_choice: str = "uniform"

    def __post_init__(self):
        _check_estimator(self.name, ESTIMATORS)
        _check_spec_settings(num_strata=self.num_strata, elbo_samples=self.elbo_samples,
                             prompt_mask_prob=self.prompt_mask_prob, mask_block_length=self.mask_block_length,
                             mask_block_choice=self.mask_block_choice)

    @classmethod
    def from_config(cls, config) -> "EstimatorSpec":
        """The spec of any config with attributes ``estimator`` (the name) and, optionally, the
        other settings under their field names (``DiffusionGRPOConfig``, ``DiffusionOptions``)."""
        settings = {f.name: getattr(config, f.name) for f in fields(cls)[1:] if hasattr(config, f.name)}
        return cls(config.estimator, **settings)

    def keywords(self) -> dict:
        """The keyword arguments of ``estimate_logprob`` / ``monte_carlo_masks`` it sets."""
        return {"estimator": self.name, **{f.name: getattr(self, f.name) for f in fields(self)[1:]}}


class MaskSample(NamedTuple):
    """One Monte-Carlo mask sample: bool ``[B, L]`` ``masked`` (positions masked in the model
    input) and ``scored`` (positions whose log-probabilities count, inside ``loss_mask``), and
    float64 ``[B]`` ``t`` (the sample's masking ratio; its scores are weighted by ``1 / t``)."""

    masked: Tensor
    scored: Tensor
    t: Tensor


def _check_estimator(estimator, choices: tuple[str, ...], purpose: str = "") -> None:
    if not isinstance(estimator, str):
        raise TypeError(f"estimator must be a str, got {type(estimator).__name__}")
    if estimator not in choices:
        raise ValueError(f"estimator must be one of {', '.join(choices)}{purpose}, got {estimator!r}")


def _check_settings(*, seed, row_offset, **settings) -> None:
    """The keyword settings shared by [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob] and
    [`monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks], each
    checked whichever estimator uses it (errors name the setting)."""
    seed32(seed)  # the counter hash's own check of a seed: an int in [0, 2**64)
    _check_spec_settings(**settings)
    check_int(row_offset, "row_offset", low=0)


def _check_spec_settings(*, num_strata, elbo_samples, prompt_mask_prob, mask_block_length, mask_block_choice) -> None:
    check_int(num_strata, "num_strata", low=1)
    check_int(elbo_samples, "elbo_samples", low=1)
    check_probability(prompt_mask_prob, "prompt_mask_prob")
    if mask_block_length is not None:
        check_int(mask_block_length, "mask_block_length", low=1)
    check_choice(mask_block_choice, "mask_block_choice", BLOCK_CHOICES)


def _check_attention_mask(attention_mask: Tensor | None, like: Tensor, like_name: str) -> None:
    """``attention_mask``: None, or a ``[B, L]`` tensor shaped and placed like ``like``."""
    if attention_mask is None:
        return
    check_tensor(attention_mask, "attention_mask", ndim=2)
    check_shape(attention_mask, "attention_mask", like.shape, f"[B, L] (from {like_name})")
    check_same_device(like, like_name, attention_mask=attention_mask)


def prompt_positions(completion_mask: Tensor, attention_mask: Tensor | None) -> Tensor:
    """bool ``[B, L]``: positions eligible for d1's prompt masking, the real prompt tokens (not
    the completion, not left padding).

    completion_mask: bool ``[B, L]``; attention_mask: ``[B, L]`` (nonzero = real token) on the
    device of ``completion_mask``, or None (every position outside the completion).
    """
    check_tensor(completion_mask, "completion_mask", ndim=2, dtypes=(torch.bool,))
    _check_attention_mask(attention_mask, completion_mask, "completion_mask")
    return prompt_positions_unchecked(completion_mask, attention_mask)


def prompt_positions_unchecked(completion_mask: Tensor, attention_mask: Tensor | None) -> Tensor:
    """[`prompt_positions`][daca_kernels.likelihood.estimator.prompt_positions] without its checks."""
    prompt = ~completion_mask
    return prompt if attention_mask is None else prompt & attention_mask.bool()


def estimate_logprob(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    *,
    estimator: str,
    seed: int,
    num_strata: int = 4,
    elbo_samples: int = 2,
    prompt_mask_prob: float = 0.0,
    mask_block_length: int | None = None,
    mask_block_choice: str = "uniform",
    row_offset: int = 0,
) -> Tensor:
    """Per-token estimates of ``log pi(completion | prompt)`` by the named estimator.

    Args:
        lm: the model.
        input_ids: long ``[B, L]``, prompt then completion.
        completion_mask: bool ``[B, L]``, the generated region (masked by every estimator).
        loss_mask: bool ``[B, L]`` inside ``completion_mask``, the tokens scored.
        attention_mask: ``[B, L]`` (1 = attend; a rollout's ``Rollout.attention_mask``), or None for a
            batch without padding. It has no default, so that a left-padded batch is never scored
            without it by accident (its padding would then be attended to).
        estimator: one of [`ESTIMATORS`][daca_kernels.likelihood.estimator.ESTIMATORS]: ``"one_step"`` (d1's single fully masked pass),
            ``"stratified"`` (SML, ``num_strata`` complementary strata), ``"coupled"``
            (DiffuCoder's complementary pair) or ``"elbo"`` (the mean of ``elbo_samples``
            single-sample ELBOs: token i gets ``(1 / n) sum_j 1[i scored in j] log p_j(y_i) / t_j``;
            SPG's block-wise masks with ``mask_block_length``).
        seed: the mask seed (an int in ``[0, 2**64)``).
        num_strata: int >= 1 (used by ``stratified``).
        elbo_samples: int >= 1 (used by ``elbo``).
        prompt_mask_prob: d1's probability in ``[0, 1]`` of masking each real prompt token
            (``one_step``, ``stratified``, ``elbo``).
        mask_block_length: SPG's block length of the ELBO masks (an int >= 1), or None for i.i.d.
            masks.
        mask_block_choice: how a block-wise mask picks its block: ``"uniform"`` (independently per
            sample) or ``"spg"`` (SPG's ``randperm(blocks) % answer_blocks``).
        row_offset: global index of row 0 (sharded batches), an int >= 0.

    Every setting is checked whichever estimator uses it: a wrong type is a TypeError, a value out
    of range a ValueError, each naming the setting.

    On a block-causal ``lm`` each estimator is taken block by block (module docstring):
    ``one_step`` masks every block whole, ``stratified`` draws its strata within each block,
    ``coupled`` splits each block, ``elbo`` keeps its masks; each scored token is predicted from its
    noisy block and the clean blocks before it. ``mask_block_length`` is a ValueError there.

    Returns:
        float32 ``[B, L]``, 0 outside ``loss_mask``; differentiable through the model.
    """
    _check_estimator(estimator, ESTIMATORS)
    _check_settings(seed=seed, num_strata=num_strata, elbo_samples=elbo_samples, prompt_mask_prob=prompt_mask_prob,
                    mask_block_length=mask_block_length, mask_block_choice=mask_block_choice, row_offset=row_offset)
    if isinstance(lm, MaskedLM):
        check_block_length_for(lm.attention, mask_block_length)
    loss_mask = check_estimator_inputs(lm, input_ids, completion_mask, attention_mask, loss_mask)
    row_offset = check_row_offset(row_offset, input_ids.shape[0])
    prompt_mask_prob = float(prompt_mask_prob)
    # The checked arguments go to the estimators' unchecked internals; d1's prompt positions lie
    # outside completion_mask by construction.
    common = dict(attention_mask=attention_mask, row_offset=row_offset)
    prompt = prompt_positions_unchecked(completion_mask, attention_mask)
    if estimator in ("one_step", "stratified"):
        return stratified_logprob_unchecked(lm, input_ids, completion_mask, loss_mask, seed=seed,
                                   num_strata=1 if estimator == "one_step" else num_strata,
                                   prompt_mask_prob=prompt_mask_prob, prompt=prompt, **common)
    if estimator == "coupled":
        return coupled_logprob_unchecked(lm, input_ids, completion_mask, loss_mask, seed=seed, **common)
    total = None
    for j in range(elbo_samples):
        sample = elbo_sample_unchecked(lm, input_ids, completion_mask, loss_mask, seed=seed, index=j, num_samples=elbo_samples,
                              block_length=mask_block_length, block_choice=mask_block_choice,
                              prompt_mask_prob=prompt_mask_prob, prompt=prompt, **common)
        term = sample.logprob / (elbo_samples * sample.t[:, None])
        total = term if total is None else total + term
    return total


def _check_mask_arguments(input_ids, completion_mask, loss_mask, attention_mask, *, seed, mask_id, num_strata,
                          elbo_samples, prompt_mask_prob, mask_block_length, mask_block_choice, row_offset,
                          attention) -> int | None:
    """The checks [`monte_carlo_masks`][daca_kernels.likelihood.estimator.monte_carlo_masks] and
    [`estimator_masks`][daca_kernels.likelihood.estimator.estimator_masks] share (errors name the argument);
    returns the block size of ``attention`` (None for full attention)."""
    _check_settings(seed=seed, num_strata=num_strata, elbo_samples=elbo_samples, prompt_mask_prob=prompt_mask_prob,
                    mask_block_length=mask_block_length, mask_block_choice=mask_block_choice, row_offset=row_offset)
    check_int(mask_id, "mask_id", low=0)
    block_size = check_attention(attention)
    check_block_length_for(attention, mask_block_length)
    check_tensor(input_ids, "input_ids", ndim=2, dtypes=INDEX_DTYPES)
    check_positions(completion_mask, "completion_mask", input_ids)
    check_positions(loss_mask, "loss_mask", input_ids)
    _check_attention_mask(attention_mask, input_ids, "input_ids")
    check_row_offset(row_offset, input_ids.shape[0])
    check_subset(loss_mask, "loss_mask", completion_mask, "completion_mask")
    return block_size


def monte_carlo_masks(
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    *,
    estimator: str,
    seed: int,
    mask_id: int,
    num_strata: int = 4,
    elbo_samples: int = 2,
    prompt_mask_prob: float = 0.0,
    mask_block_length: int | None = None,
    mask_block_choice: str = "uniform",
    row_offset: int = 0,
    attention: str | tuple[str, int] = "full",
) -> list[MaskSample]:
    """The mask samples BGPO and SPG score, one [`MaskSample`][daca_kernels.likelihood.estimator.MaskSample] per forward pass.

    ``estimator="stratified"`` (DACA): the ``num_strata`` SML strata of ``completion_mask``, ``t_k``
    the fraction of the row's ``loss_mask`` that stratum k scores (SPG's empirical ratio; 1 for a
    stratum scoring nothing). ``estimator="elbo"``: ``elbo_samples`` ELBO masks (SPG's block-wise
    masks with ``mask_block_length``, prompt masking with ``prompt_mask_prob``). ``"one_step"`` and
    ``"coupled"`` have no Monte-Carlo samples (a ValueError; [`estimator_masks`][daca_kernels.likelihood.estimator.estimator_masks]
    gives their passes).

    ``attention``: the model's ``lm.attention`` (``"full"`` or ``("block", size)``). For a block-causal
    model the strata are drawn within each block (as [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob] draws
    them) and
    ``mask_block_length`` is a ValueError; score each sample with
    [`daca_kernels.likelihood.masked_logprob`][daca_kernels.likelihood.masked_passes.masked_logprob], which reads a block model block
    by block.

    input_ids: int64/int32 ``[B, L]``; completion_mask, loss_mask: bool ``[B, L]`` on its device,
    ``loss_mask`` inside ``completion_mask``; attention_mask: ``[B, L]`` or None (no default, as
    in [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob]); mask_id: an int
    >= 0; the other settings as in [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob], all checked (errors name
    the argument)
    whichever estimator uses them.
    """
    _check_estimator(estimator, MONTE_CARLO_ESTIMATORS, " for Monte-Carlo mask samples")
    block_size = _check_mask_arguments(input_ids, completion_mask, loss_mask, attention_mask, seed=seed, mask_id=mask_id,
                                       num_strata=num_strata, elbo_samples=elbo_samples,
                                       prompt_mask_prob=prompt_mask_prob, mask_block_length=mask_block_length,
                                       mask_block_choice=mask_block_choice, row_offset=row_offset, attention=attention)
    if estimator == "stratified":
        if block_size is None:
            strata = stratified_mask(input_ids, completion_mask, num_strata, seed, mask_id, row_offset=row_offset).strata
        else:
            strata = block_stratified_mask(input_ids, completion_mask, num_strata, seed, mask_id, block_size,
                                           row_offset=row_offset, attention_mask=attention_mask).strata
        lengths = loss_mask.sum(1).clamp(min=1).double()
        samples = []
        for k in range(num_strata):
            scored = (strata == k) & loss_mask
            t = torch.where(scored.any(1), scored.sum(1) / lengths, torch.ones_like(lengths))
            samples.append(MaskSample(strata == k, scored, _nan_ratios_where_unchecked(t, completion_mask, loss_mask)))
        return samples
    prompt = prompt_positions_unchecked(completion_mask, attention_mask)  # outside completion_mask by construction
    masks = [elbo_sample_mask_unchecked(completion_mask, loss_mask, seed=seed, index=j, num_samples=elbo_samples,
                               block_length=mask_block_length, block_scoring="spg", block_choice=mask_block_choice,
                               prompt_mask_prob=float(prompt_mask_prob), prompt=prompt,
                               row_offset=row_offset) for j in range(elbo_samples)]
    return [MaskSample(m.masked, m.scored, _nan_ratios_where_unchecked(m.t, completion_mask, loss_mask)) for m in masks]


def _nan_ratios_where_unchecked(t: Tensor, completion_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """A sample's ratios ``t`` ``[B]``, NaN in the rows whose ``loss_mask`` leaves ``completion_mask``
    where that was not checked (no value read on CUDA): the objectives score those rows NaN."""
    if reads_values(loss_mask):
        return t
    return torch.where((loss_mask & ~completion_mask).any(dim=1), torch.full_like(t, float("nan")), t)


class EstimatorPass(NamedTuple):
    """One forward pass of an estimator ([`estimator_masks`][daca_kernels.likelihood.estimator.estimator_masks]), all ``[B, L]``.

    Attributes:
        input_ids: the model input, ``lm.mask_id`` at the masked positions (dtype of the ids).
        context_ids: block models: the clean earlier blocks a scored block is conditioned on, i.e.
            ``input_ids`` with the scored positions restored (positions masked without being scored
            stay masked); for a bidirectional model it is not read.
        scored: bool, the positions whose log-probabilities this pass contributes, inside ``loss_mask``.
        weight: float64, what each scored log-probability is multiplied by (0 elsewhere).
    """

    input_ids: Tensor
    context_ids: Tensor
    scored: Tensor
    weight: Tensor


class EstimatorMasks(NamedTuple):
    """Every forward pass of one estimate ([`estimator_masks`][daca_kernels.likelihood.estimator.estimator_masks]).

    Attributes:
        passes: the [`EstimatorPass`][daca_kernels.likelihood.estimator.EstimatorPass] of each forward, in the estimator's order.
        blocks: block models: int64 ``[B, L]``, the block of each position
            ([`daca_kernels.models.masked_lm.block_index`][daca_kernels.models.masked_lm.block_index]: counted from each row's first
            attended
            position, padding in negative blocks); None for a bidirectional model.
    """

    passes: tuple[EstimatorPass, ...]
    blocks: Tensor | None


def estimator_masks(
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    *,
    estimator: str,
    seed: int,
    mask_id: int,
    attention: str | tuple[str, int] = "full",
    num_strata: int = 4,
    elbo_samples: int = 2,
    prompt_mask_prob: float = 0.0,
    mask_block_length: int | None = None,
    mask_block_choice: str = "uniform",
    row_offset: int = 0,
) -> EstimatorMasks:
    """The masked inputs of every forward pass of [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob], so that an
    estimate can be
    audited or rebuilt outside the library.

    Same arguments as [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob] (all checked, errors naming the
    argument), with the
    model's ``mask_id`` and ``attention`` (``lm.attention``) in place of the model. The estimate is

        ``estimate[b, i] = sum_p passes[p].weight[b, i] * log p_p(input_ids[b, i])``

    summed over the passes that score ``(b, i)``, where ``log p_p`` is the model's log-softmax at
    position ``i`` (``i - 1`` under the shift convention) of

    - a bidirectional model: ``model(passes[p].input_ids, attention_mask)``;
    - a block-causal model, ``c = blocks[b, i]``: row ``b`` alone (its padding dropped) with
      ``context_ids`` in the blocks before ``c`` and ``input_ids`` in block ``c``, block-causal
      attention over ``blocks`` and position ids counted from the row's first token, which is what
      [`daca_kernels.MaskedLM.block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden] computes in one forward.

    Passes: ``"one_step"`` one; ``"stratified"`` ``num_strata`` (stratum k, weight 1);
    ``"coupled"`` two (weights ``1 / (2 t)`` and ``1 / (2 (1 - t))``, per block on a block model);
    ``"elbo"`` ``elbo_samples`` (weight ``1 / (n t_j)``). A pass that scores nothing is kept (the
    estimator runs no forward for it).
    """
    _check_estimator(estimator, ESTIMATORS)
    block_size = _check_mask_arguments(input_ids, completion_mask, loss_mask, attention_mask, seed=seed, mask_id=mask_id,
                                       num_strata=num_strata, elbo_samples=elbo_samples,
                                       prompt_mask_prob=prompt_mask_prob, mask_block_length=mask_block_length,
                                       mask_block_choice=mask_block_choice, row_offset=row_offset, attention=attention)
    prompt = prompt_positions(completion_mask, attention_mask)
    ones = torch.ones(input_ids.shape, dtype=torch.float64, device=input_ids.device)
    drawn = []  # (masked ids, scored, weight)
    if estimator in ("one_step", "stratified"):
        k = 1 if estimator == "one_step" else num_strata
        settings = dict(prompt=prompt, prompt_mask_prob=prompt_mask_prob, row_offset=row_offset)
        if block_size is None:
            masks = stratified_mask(input_ids, completion_mask, k, seed, mask_id, **settings)
        else:
            masks = block_stratified_mask(input_ids, completion_mask, k, seed, mask_id, block_size,
                                          attention_mask=attention_mask, **settings)
        drawn = [(masks.input_ids[j], (masks.strata == j) & loss_mask, ones) for j in range(k)]
    elif estimator == "coupled":
        if block_size is None:
            split = coupled_split(completion_mask, seed, row_offset=row_offset)
            strata, weights = split.strata, split.weights
        else:
            strata, weights = block_coupled_split(completion_mask, seed, block_size, row_offset=row_offset,
                                                  attention_mask=attention_mask)
        drawn = [(input_ids.masked_fill(strata == j, mask_id), (strata == j) & loss_mask, weights) for j in range(2)]
    else:
        for j in range(elbo_samples):
            sample = elbo_sample_mask(completion_mask, seed=seed, index=j, num_samples=elbo_samples,
                                      loss_mask=loss_mask, block_length=mask_block_length,
                                      block_choice=mask_block_choice, prompt_mask_prob=prompt_mask_prob,
                                      prompt=prompt, row_offset=row_offset)
            weight = (1.0 / (elbo_samples * sample.t))[:, None].expand(input_ids.shape)
            drawn.append((input_ids.masked_fill(sample.masked, mask_id), sample.scored, weight))
    passes = tuple(
        EstimatorPass(noisy, torch.where(scored, input_ids, noisy), scored, torch.where(scored, weight, 0.0))
        for noisy, scored, weight in drawn
    )
    blocks = None
    if block_size is not None:
        blocks = block_index(block_size, attention_mask, *input_ids.shape, input_ids.device)
    return EstimatorMasks(passes, blocks)
