"""Monte-Carlo ELBO samples (BGPO, SPG, VRPO-style objectives), one forward pass per sample.

Regions: ``completion_mask`` is the generated region (every position the sampler wrote, the
padding after an end-of-sequence token included) and ``loss_mask`` (default: ``completion_mask``)
the scored answer inside it, e.g. the completion up to and including its first EOS. The positions
of ``completion_mask`` outside ``loss_mask`` are masked in every sample and never scored; the
random masks are drawn over ``loss_mask``, whose size ``n_b`` the ratios refer to.

Sample j of n masks ``m`` of the row's ``n_b`` scored positions, ``t = m / n_b``
([`daca_kernels.likelihood.ratio_masks.elbo_mask`][daca_kernels.likelihood.ratio_masks.elbo_mask] over ``loss_mask``), and

    ELBO_j = 1/t * sum_{i masked} log p(y_i | y unmasked)

is an unbiased estimate of the masked-diffusion ELBO ``E_sigma sum_k log p(y_sigma_k | y_sigma_<k)``
when ``m`` is uniform on ``{1, .., n_b}``; the n ratios are stratified over (0, 1), so the mean of
the n samples is unbiased and every sample masks at least one position.

Masking an exact count instead of each position independently with probability t keeps every
sample non-empty without biasing it, and bounds the weight 1/t by n_b.

Block-causal models (``lm.attention == ("block", S)``): the masks are the same (drawn over the whole
answer), and each scored position of block ``c`` is predicted from block ``c`` of the masked input and
the clean blocks before ``c`` ([`daca_kernels.likelihood.masked_logprob`][daca_kernels.likelihood.masked_passes.masked_logprob]; one
forward pass of the
noisy/clean layout per sample). Then ``ELBO_j`` is an unbiased estimate of ``sum_c ELBO_c``, the sum of
the ELBOs of the factors ``log p(y_c | prompt, y_<c)``: given ``|M| = m`` uniform on ``{1, .., n_b}``
and ``M`` uniform of that size, the part of ``M`` in a block of ``n_c`` scored positions has size
``j`` and is uniform given ``j``, and ``C(n_c, j) sum_m C(n_b - n_c, m - j) / (m C(n_b, m)) = 1 / j``,
so block ``c``'s share of ``(n_b / m) sum_{i in M}`` has the expectation
``sum_j (1 / j) E_{|J| = j}[sum_{i in J} log p(y_i | y_<c, y_c outside J)]``, block ``c``'s ELBO. SPG's
block-wise masks (``block_length``) emulate semi-autoregressive decoding on a bidirectional model and
are refused on a block model, which has its own blocks.

Constant memory in n: call [`elbo_sample`][daca_kernels.likelihood.elbo.elbo_sample] for one sample at a time and back-propagate each
before the next (the sum over samples of their gradients is the gradient of the sum).

Block-wise masking (SPG; ``block_length=l``,
[`daca_kernels.likelihood.ratio_masks.block_elbo_mask`][daca_kernels.likelihood.ratio_masks.block_elbo_mask]
over ``loss_mask``) follows semi-autoregressive decoding in blocks of ``l``: the scored positions,
in order, are cut into blocks of ``l``; each sample selects one block, keeps the blocks before it
clean, masks every block after it, and masks ``m`` of the selected block's ``s`` positions as
above. The block: ``block_choice="uniform"`` (default) picks one of the answer's ``K`` blocks
uniformly for every sample; ``block_choice="spg"`` is SPG's draw, entry j of a random permutation
of the ``N`` decoding blocks of the generated region (``completion_mask``) modulo ``K``, so a
row's samples take distinct permutation entries and the early blocks are chosen more often when
``K`` does not divide ``N``. Two scorings of that input:

- ``block_scoring="spg"`` (default), SPG's released rule: every masked position of ``loss_mask`` is
  scored (the ``m`` positions of the selected block and all positions of the later blocks) and
  ``t = (number scored) / n_b``, so ``ELBO_j = n_b * (mean log-probability of the scored tokens)``;
- ``block_scoring="block"``, this library's block ELBO: only the ``m`` positions of the selected
  block are scored, with ``t = m q / s`` where ``q`` is the probability of choosing that block
  (``1 / K`` for the uniform choice, so ``t = m / (K s)``, ``m / n_b`` when every block is full).
  Averaged over the n samples, ``1/t`` times their summed log-probabilities is an unbiased
  estimate of the sum over blocks of the block ELBOs (each block's ELBO conditioned on the clean
  blocks before it, the blocks after it masked).

Prompt masking (``prompt_mask_prob=p``): each eligible position is also masked with probability
``p``, drawn independently for every sample. Eligible are the ``prompt`` positions and, with
``block_scoring="spg"``, the positions of the blocks before the selected one, which are then
scored as well (SPG masks every position outside the selected and later blocks this way).

Compared with SPG's released trainer (``spg/spg_trainer.py``: ``SPGTrainer.forward_process`` and
``_get_per_seq_logps``): its ``forward_type="random"`` is [`elbo_samples`][daca_kernels.likelihood.elbo.elbo_samples] without
``block_length``, ``"block_random"`` is ``block_length=l`` with ``block_scoring="spg"``, and its
``use_mask_prompt`` / ``p_mask_prompt`` (defaults True / 0.3) is ``prompt_mask_prob``. It masks
everything after the first EOS in every sample and scores the masked tokens up to and including
that EOS (``completion_mask`` = the generated region, ``loss_mask`` = the answer here); its
per-sequence value is the mean log-probability of the scored tokens and its loss weights each
sequence by ``n_b``, which is ``ELBO_j`` here. Its blocks are the decoding blocks counted from the
first generated position, which are the blocks here when the answer starts there. What differs is
the randomness: SPG draws with torch's RNG, here the counter hash; SPG takes its samples' blocks
from one random permutation of all decoding blocks modulo the answer's block count, which is
``block_choice="spg"`` here (the default ``"uniform"`` picks each sample's block uniformly among
the answer's blocks); SPG draws each count uniformly in ``[max(int(s min_t), 1),
min(int(s max_t), s)]`` (uniform on ``{1, .., s}`` at its defaults), here the n counts are
stratified (each uniform on ``{1, .., s}``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.likelihood.masked_passes import (
    check_estimator_inputs,
    check_subset,
    masked_pass_logprob,
    nan_where_unchecked,
    output_dtype,
)
from daca_kernels.likelihood.ratio_masks import block_elbo_mask_unchecked, check_block_choice, check_sample, elbo_mask_unchecked
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.stratified_mask import stratified_mask_unchecked
from daca_kernels.validation import (
    check_disjoint_prompt,
    check_int,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
)

BLOCK_SCORINGS = ("spg", "block")


@dataclass(frozen=True)
class ElboSamples:
    """ELBO Monte-Carlo samples; ``...`` is ``[n]`` for [`elbo_samples`][daca_kernels.likelihood.elbo.elbo_samples], empty for
    [`elbo_sample`][daca_kernels.likelihood.elbo.elbo_sample].

    Attributes:
        logprob: float32 ``[..., B, L]``: ``log p(y_i | unmasked)`` at the scored positions, 0
            elsewhere (unweighted).
        mask: bool ``[..., B, L]``: the scored positions (module docstring), inside ``loss_mask``.
        t: float32 ``[..., B]``: the ratio ``1 / t`` weights the scored sum by (1 for a row with
            nothing to score).
    """

    logprob: Tensor
    mask: Tensor
    t: Tensor

    def elbo(self) -> Tensor:
        """``[..., B]``: the 1/t-weighted sum over the row, one ELBO estimate per sample."""
        return self.logprob.sum(-1) / self.t


@dataclass(frozen=True)
class ElboMask:
    """The masks of one ELBO sample ([`elbo_sample_mask`][daca_kernels.likelihood.elbo.elbo_sample_mask]).

    Attributes:
        masked: bool ``[B, L]``: the positions replaced by the mask id in the model input.
        scored: bool ``[B, L]``: the positions whose log-probabilities count, inside ``masked``
            and ``loss_mask``.
        t: float64 ``[B]``: the ratio ``1 / t`` weights the scored sum by (1 for a row with nothing
            to score).
    """

    masked: Tensor
    scored: Tensor
    t: Tensor


def check_block_length_for(attention, block_length) -> None:
    """SPG's block-wise masks (``block_length``, called ``mask_block_length`` by the estimators' settings)
    are for bidirectional models; a block-causal ``attention`` with one is a ValueError."""
    if block_length is not None and attention != "full":
        raise ValueError(f"mask_block_length: SPG's block-wise ELBO masks emulate block decoding on a bidirectional "
                         f"model; this model is block-causal (attention={attention!r}) and its ELBO is taken over "
                         f"its own blocks: leave mask_block_length None (got {block_length})")


def _check_region(value, name: str, completion_mask: Tensor) -> None:
    check_tensor(value, name, ndim=2, dtypes=(torch.bool,))
    check_shape(value, name, completion_mask.shape, "[B, L] (from completion_mask)")
    check_same_device(completion_mask, "completion_mask", **{name: value})


def _earlier_blocks(loss_mask: Tensor, scored: Tensor, block_length: int) -> Tensor:
    """bool ``[B, L]``: the ``loss_mask`` positions of the blocks before the one ``scored`` lies in
    (blocks of ``block_length`` consecutive ``loss_mask`` positions, as ``block_elbo_mask`` cuts them)."""
    block = torch.where(loss_mask, (torch.cumsum(loss_mask.long(), dim=1) - 1) // block_length, -1)
    selected = torch.where(scored, block, -1).amax(dim=1, keepdim=True)
    return loss_mask & (block < selected)


def _prompt_draws(eligible: Tensor, seed: int, index: int, num_samples: int, prob: float, row_offset: int) -> Tensor:
    """bool ``[B, L]``: the eligible positions that sample ``index`` masks, each with probability
    ``prob``, independently across samples: copy ``index`` of the prompt masking of
    [`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask] with ``num_samples`` copies (its counter hash)."""
    blank = torch.zeros(eligible.shape, dtype=torch.int64, device=eligible.device)
    copies = stratified_mask_unchecked(
        blank, torch.zeros_like(eligible), num_samples, seed, 1,
        scheme="random", prompt=eligible, prompt_mask_prob=prob, row_offset=row_offset,
    ).input_ids
    return copies[index] == 1


def elbo_sample_mask(
    completion_mask: Tensor,
    *,
    seed: int,
    index: int = 0,
    num_samples: int = 1,
    loss_mask: Tensor | None = None,
    block_length: int | None = None,
    block_scoring: str = "spg",
    block_choice: str = "uniform",
    prompt_mask_prob: float = 0.0,
    prompt: Tensor | None = None,
    row_offset: int = 0,
) -> ElboMask:
    """The masks of ELBO sample ``index`` of ``num_samples`` (module docstring), without the model.

    Args:
        completion_mask: bool ``[B, L]``: the generated region.
        seed: int in ``[0, 2**64)``; index, num_samples: ``0 <= index < num_samples``.
        loss_mask: bool ``[B, L]`` inside ``completion_mask``: the positions that may be scored
            (default: ``completion_mask``); the rest of ``completion_mask`` is always masked.
        block_length: None, or an int >= 1 for SPG's block-wise masking.
        block_scoring: ``"spg"`` or ``"block"``, which positions of a block-wise sample are scored
            (only used with ``block_length``).
        block_choice: ``"uniform"`` or ``"spg"``, how a block-wise sample picks its block (module
            docstring; only used with ``block_length``): ``"spg"`` permutes the decoding blocks of
            ``completion_mask``.
        prompt_mask_prob: probability in ``[0, 1]`` of masking each eligible position.
        prompt: bool ``[B, L]`` outside ``completion_mask``: the prompt positions eligible for
            prompt masking (default: every position outside ``completion_mask``); a position in both
            is a ValueError naming ``prompt``, whether or not ``prompt_mask_prob > 0`` (the rule of
            [`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask]).
        row_offset: global index of row 0 of this call, for sharded batches; masks depend on
            ``(seed, row_offset + b, position, index)``.

    Returns:
        [`ElboMask`][daca_kernels.likelihood.elbo.ElboMask]; a pure function of its arguments, so old-policy, reference and current
        passes rebuild the same masks from the seed.
    """
    check_tensor(completion_mask, "completion_mask", ndim=2, dtypes=(torch.bool,))
    if loss_mask is None:
        loss_mask = completion_mask
    else:
        _check_region(loss_mask, "loss_mask", completion_mask)
        check_subset(loss_mask, "loss_mask", completion_mask, "completion_mask")
    prompt_mask_prob = _check_mask_settings(completion_mask, index, num_samples, row_offset, block_length, block_scoring,
                                            block_choice, prompt_mask_prob, prompt)
    return elbo_sample_mask_unchecked(completion_mask, loss_mask, seed=seed, index=index, num_samples=num_samples,
                             block_length=block_length, block_scoring=block_scoring, block_choice=block_choice,
                             prompt_mask_prob=prompt_mask_prob, prompt=prompt, row_offset=row_offset)


def _check_mask_settings(completion_mask: Tensor, index, num_samples, row_offset, block_length, block_scoring,
                         block_choice, prompt_mask_prob, prompt) -> float:
    """The checks of [`elbo_sample_mask`][daca_kernels.likelihood.elbo.elbo_sample_mask]'s settings and ``prompt``; returns
    ``prompt_mask_prob``
    as a float."""
    check_sample(completion_mask, index, num_samples, row_offset)
    if block_length is not None:
        check_int(block_length, "block_length", low=1)
    if not isinstance(block_scoring, str) or block_scoring not in BLOCK_SCORINGS:
        raise ValueError(f"block_scoring must be 'spg' or 'block', got {block_scoring!r}")
    check_block_choice(block_choice)
    prompt_mask_prob = check_probability(prompt_mask_prob, "prompt_mask_prob")
    if prompt is not None:
        _check_region(prompt, "prompt", completion_mask)
        check_disjoint_prompt(prompt, completion_mask, "completion_mask")
    return prompt_mask_prob


def elbo_sample_mask_unchecked(completion_mask: Tensor, loss_mask: Tensor, *, seed: int, index: int, num_samples: int,
                      block_length: int | None, block_scoring: str, block_choice: str, prompt_mask_prob: float,
                      prompt: Tensor | None, row_offset: int) -> ElboMask:
    """[`elbo_sample_mask`][daca_kernels.likelihood.elbo.elbo_sample_mask] without its checks (``loss_mask`` given), for callers that
    checked
    the arguments."""
    if prompt is None:
        prompt = ~completion_mask
    if block_length is None:
        masked, t = elbo_mask_unchecked(loss_mask, seed, index, num_samples, row_offset=row_offset)
        scored, eligible = masked, prompt
    else:
        block = block_elbo_mask_unchecked(loss_mask, seed, index, num_samples, block_length, row_offset=row_offset,
                                block_choice=block_choice, generated=completion_mask)
        masked, scored, t = block.masked, block.scored, block.t
        eligible = prompt
        if block_scoring == "spg":
            eligible = prompt | _earlier_blocks(loss_mask, block.scored, block_length)
    if prompt_mask_prob > 0:
        drawn = _prompt_draws(prompt | loss_mask, seed, index, num_samples, prompt_mask_prob, row_offset)
        masked = masked | (drawn & eligible)
    if block_length is not None and block_scoring == "spg":
        scored = masked & loss_mask
        lengths = loss_mask.sum(dim=1).double()
        t = torch.where(lengths > 0, scored.sum(dim=1).double() / lengths.clamp(min=1), 1.0)
    return ElboMask(masked=masked | (completion_mask & ~loss_mask), scored=scored, t=t)


def elbo_sample(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    *,
    seed: int,
    index: int = 0,
    num_samples: int = 1,
    row_offset: int = 0,
    block_length: int | None = None,
    block_scoring: str = "spg",
    block_choice: str = "uniform",
    prompt_mask_prob: float = 0.0,
    prompt: Tensor | None = None,
) -> ElboSamples:
    """Sample ``index`` of ``num_samples`` (one forward pass), with ``[B, L]`` / ``[B]`` fields.

    lm, input_ids, attention_mask: as in
    [`daca_kernels.likelihood.stratified_logprob`][daca_kernels.likelihood.stratified.stratified_logprob];
    completion_mask: bool ``[B, L]``, the generated region; loss_mask: bool ``[B, L]`` inside it,
    the positions that may be scored (default: ``completion_mask``; a ValueError when it is not
    inside). The masks are ``elbo_sample_mask(completion_mask, seed=seed, index=index, ...)`` with
    the remaining arguments (``block_length``: None or an int >= 1 for SPG's block-wise masking;
    ``block_scoring``: ``"spg"`` or ``"block"``; ``block_choice``: ``"uniform"`` or ``"spg"``;
    ``prompt_mask_prob``, ``prompt``: prompt
    masking; ``row_offset``: global index of row 0 of this call, for sharded batches): the same
    seed and index give the same masks in every pass (old policy, reference, current). Only the
    scored positions go through the LM head. On a block-causal model each scored position is
    predicted from its noisy block and the clean blocks before it (module docstring), and
    ``block_length`` is refused.
    """
    loss_mask, prompt_mask_prob = _check_sample_arguments(lm, input_ids, completion_mask, attention_mask, loss_mask, index,
                                                         num_samples, row_offset, block_length, block_scoring,
                                                         block_choice, prompt_mask_prob, prompt)
    return elbo_sample_unchecked(lm, input_ids, completion_mask, loss_mask, seed=seed, index=index, num_samples=num_samples,
                        attention_mask=attention_mask, row_offset=row_offset, block_length=block_length,
                        block_scoring=block_scoring, block_choice=block_choice, prompt_mask_prob=prompt_mask_prob,
                        prompt=prompt)


def _check_sample_arguments(lm, input_ids, completion_mask, attention_mask, loss_mask, index, num_samples, row_offset,
                           block_length, block_scoring, block_choice, prompt_mask_prob, prompt) -> tuple[Tensor, float]:
    """The checks of [`elbo_sample`][daca_kernels.likelihood.elbo.elbo_sample] (its seed is checked where the masks fold it); returns
    ``(loss_mask, prompt_mask_prob)`` (``completion_mask`` when ``loss_mask`` is None; a float)."""
    loss_mask = check_estimator_inputs(lm, input_ids, completion_mask, attention_mask, loss_mask)
    check_block_length_for(lm.attention, block_length)
    return loss_mask, _check_mask_settings(completion_mask, index, num_samples, row_offset, block_length, block_scoring,
                                           block_choice, prompt_mask_prob, prompt)


def elbo_sample_unchecked(lm: MaskedLM, input_ids: Tensor, completion_mask: Tensor, loss_mask: Tensor, *, seed: int, index: int,
                 num_samples: int, attention_mask: Tensor | None, row_offset: int, block_length: int | None,
                 block_choice: str, prompt_mask_prob: float, prompt: Tensor | None,
                 block_scoring: str = "spg") -> ElboSamples:
    """[`elbo_sample`][daca_kernels.likelihood.elbo.elbo_sample] without its checks (``loss_mask`` given), for callers that checked the
    arguments."""
    sample = elbo_sample_mask_unchecked(
        completion_mask, loss_mask, seed=seed, index=index, num_samples=num_samples, block_length=block_length,
        block_scoring=block_scoring, block_choice=block_choice, prompt_mask_prob=prompt_mask_prob, prompt=prompt,
        row_offset=row_offset,
    )
    logprob = masked_pass_logprob(lm, input_ids, sample.masked, sample.scored, attention_mask=attention_mask)
    logprob = nan_where_unchecked(logprob, lm, completion_mask, loss_mask)
    return ElboSamples(logprob=logprob, mask=sample.scored, t=sample.t.to(output_dtype(lm)))


def elbo_samples(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    *,
    num_samples: int,
    seed: int,
    row_offset: int = 0,
    block_length: int | None = None,
    block_scoring: str = "spg",
    block_choice: str = "uniform",
    prompt_mask_prob: float = 0.0,
    prompt: Tensor | None = None,
) -> ElboSamples:
    """All ``num_samples`` samples stacked: ``logprob [n, B, L]``, ``mask [n, B, L]``, ``t [n, B]``.

    Keeps every sample's graph for backward; use [`elbo_sample`][daca_kernels.likelihood.elbo.elbo_sample] in a loop for constant memory.
    The other arguments are those of [`elbo_sample`][daca_kernels.likelihood.elbo.elbo_sample].
    """
    num_samples = check_int(num_samples, "num_samples", low=1)
    loss_mask, prompt_mask_prob = _check_sample_arguments(lm, input_ids, completion_mask, attention_mask, loss_mask, 0,
                                                         num_samples, row_offset, block_length, block_scoring,
                                                         block_choice, prompt_mask_prob, prompt)
    samples = [
        elbo_sample_unchecked(
            lm, input_ids, completion_mask, loss_mask, seed=seed, index=j, num_samples=num_samples,
            attention_mask=attention_mask, row_offset=row_offset, block_length=block_length,
            block_scoring=block_scoring, block_choice=block_choice, prompt_mask_prob=prompt_mask_prob, prompt=prompt,
        )
        for j in range(num_samples)
    ]
    return ElboSamples(
        logprob=torch.stack([s.logprob for s in samples]),
        mask=torch.stack([s.mask for s in samples]),
        t=torch.stack([s.t for s in samples]),
    )
