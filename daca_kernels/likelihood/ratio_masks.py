"""Masks of a drawn ratio for the coupled and ELBO estimators: the first ``m`` positions of a
row (or of one block of it, for SPG's block-wise masking) by hash rank.

Vectorised over rows; the ranks come from the sort-based
[`daca_kernels.ops.stratified_mask.maskable_ranks`][daca_kernels.ops.stratified_mask.maskable_ranks], so memory stays ``O(B * L)``.
``daca_kernels.reference.masking`` states the same formulas and computes them one row at a time
with pairwise ranks; the tests hold the two to the same bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.hashing import (
    STREAM_BLOCK_SELECT,
    STREAM_ELBO_MASK,
    STREAM_MASK_RATIO,
    STREAM_STRATUM_KEY,
    hash4,
    seed32,
    uniform_from_hash,
)
from daca_kernels.ops.stratified_mask import maskable_ranks_unchecked
from daca_kernels.validation import (
    WORD_LIMIT,
    check_choice,
    check_int,
    check_row_offset,
    check_same_device,
    check_shape,
    check_tensor,
)

BLOCK_CHOICES = ("uniform", "spg")


@dataclass(frozen=True)
class BlockElboMask:
    """One block-wise ELBO sample (see [`block_elbo_mask`][daca_kernels.likelihood.ratio_masks.block_elbo_mask]).

    Attributes:
        scored: bool ``[B, L]``: the masked positions of the selected block, whose
            log-probabilities count.
        masked: bool ``[B, L]``: every position masked in the model input: ``scored`` and every
            completion position of the blocks after the selected one.
        t: float64 ``[B]``: ``m q_b / s_b`` (``m = |scored_b|``, selected block of ``s_b``
            positions chosen with probability ``q_b``: ``1 / K_b`` for ``block_choice="uniform"``),
            which is ``|scored_b| / n_b`` for the uniform choice when every block of the row is
            full; 1 for a row without completion.
    """

    scored: Tensor
    masked: Tensor
    t: Tensor


@dataclass(frozen=True)
class CoupledSplit:
    """The complementary masks of the coupled estimator (see [`coupled_split`][daca_kernels.likelihood.ratio_masks.coupled_split]).

    Attributes:
        strata: int64 ``[B, L]``: 0 for the first mask, 1 for its complement, -1 off the completion.
        t: float64 ``[B]``: the fraction of the row's completion in the first mask.
        weights: float64 ``[B, L]``: ``1 / (c t)`` on the first mask, ``1 / (c (1 - t))`` on the
            second (``c`` = number of non-empty masks of the row), 0 elsewhere.
    """

    strata: Tensor
    t: Tensor
    weights: Tensor


def check_t_range(t_range) -> tuple[float, float]:
    if not isinstance(t_range, (tuple, list)) or len(t_range) != 2:
        raise TypeError(f"t_range must be a pair (low, high), got {t_range!r}")
    low, high = (float(v) for v in t_range)
    if not (0.0 < low <= high < 1.0 and math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"t_range must satisfy 0 < low <= high < 1, got {tuple(t_range)}")
    return low, high


def _ratio_uniforms(batch: int, seed: int, a: int, c: int, device: torch.device, row_offset: int) -> Tensor:
    """float64 ``[B]``: the uniform of ``hash4(seed32(seed), STREAM_MASK_RATIO, row, a, c)`` of
    every global row ``row = row_offset + b``."""
    rows = torch.arange(row_offset, row_offset + batch, device=device)
    return uniform_from_hash(hash4(seed32(seed), STREAM_MASK_RATIO, rows, a, c)).double()


def _masked_count(size: Tensor, seed: int, index: int, num_samples: int, row_offset: int) -> Tensor:
    """int64 ``[B]``: how many of ``size`` (int64 ``[B]``) positions sample ``index`` of
    ``num_samples`` masks: ``ceil(u size)`` clipped to ``[1, size]`` (0 for size 0), the ratio
    ``u = (index + v) / N`` stratified over the samples."""
    u = (index + _ratio_uniforms(size.shape[0], seed, index, 0, size.device, row_offset)) / num_samples
    return torch.ceil(u * size).long().clamp(min=1).minimum(size)


def coupled_split(
    completion_mask: Tensor, seed: int, t_range: tuple[float, float] = (0.2, 0.8), *, row_offset: int = 0
) -> CoupledSplit:
    """Split each row's completion into a random first mask of ``round(t n)`` positions and its
    complement, ``t`` drawn uniformly in ``t_range`` per row from the seed.

    completion_mask: bool ``[B, L]``; seed: int in ``[0, 2**64)``. The first mask holds the
    ``m = round(t n)`` positions (clipped to ``[1, n - 1]``) of lowest stratum-key rank, so at
    ``m = n / 2`` the split is a random halving. row_offset: global index of row 0 of this call,
    for sharded batches (int >= 0, ``row_offset + B <= 2**32``); masks depend on ``(seed,
    row_offset + b, position)``, so rows ``a:c`` with ``row_offset=a`` split exactly as rows
    ``a:c`` of the whole batch.
    """
    check_tensor(completion_mask, "completion_mask", ndim=2, dtypes=(torch.bool,))
    t_range = check_t_range(t_range)
    row_offset = check_row_offset(row_offset, completion_mask.shape[0])
    return coupled_split_unchecked(completion_mask, seed, t_range, row_offset=row_offset)


def coupled_split_unchecked(completion_mask: Tensor, seed: int, t_range: tuple[float, float], *, row_offset: int) -> CoupledSplit:
    """[`coupled_split`][daca_kernels.likelihood.ratio_masks.coupled_split] without its checks, for callers that checked the arguments."""
    low, high = t_range
    n = completion_mask.sum(1)
    u = low + (high - low) * _ratio_uniforms(n.shape[0], seed, 0, 1, n.device, row_offset)
    first_size = torch.where(n >= 2, torch.round(u * n).long().clamp(min=1).minimum(n - 1), n)
    rank = maskable_ranks_unchecked(completion_mask, seed, stream=STREAM_STRATUM_KEY, sample=0, row_offset=row_offset)
    strata = torch.where(completion_mask, (rank >= first_size[:, None]).long(), -1)
    t = first_size.double() / n.clamp(min=1)
    non_empty = torch.where(n >= 2, 2.0, 1.0).double()
    # Infinite where a mask is empty (t = 0 or 1), and then never selected.
    w_first, w_second = 1 / (non_empty * t), 1 / (non_empty * (1 - t))
    weights = torch.where(strata == 0, w_first[:, None], torch.where(strata == 1, w_second[:, None], 0.0))
    return CoupledSplit(strata=strata, t=t, weights=weights)


def check_sample(completion_mask: Tensor, index, num_samples, row_offset) -> tuple[int, int]:
    """Validate the arguments shared by the ELBO masks; returns ``(num_samples, row_offset)``."""
    check_tensor(completion_mask, "completion_mask", ndim=2, dtypes=(torch.bool,))
    num_samples = check_int(num_samples, "num_samples", low=1)
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"index must be an int, got {type(index).__name__}")
    if not 0 <= index < num_samples:
        raise ValueError(f"index must lie in [0, num_samples) = [0, {num_samples}), got {index}")
    return num_samples, check_row_offset(row_offset, completion_mask.shape[0])


def elbo_mask(
    completion_mask: Tensor, seed: int, index: int, num_samples: int, *, row_offset: int = 0
) -> tuple[Tensor, Tensor]:
    """Mask of Monte-Carlo sample ``index`` of ``num_samples`` for the ELBO estimator.

    The sample's ratio ``u`` is drawn in ``[index / N, (index + 1) / N)`` (stratified over the N
    samples), ``m = ceil(u n)`` clipped to ``[1, n]`` positions of lowest rank under the sample's
    own key are masked (at least one whenever the row has a completion) and ``t = m / n``.
    row_offset: global index of row 0 of this call, for sharded batches (int >= 0,
    ``row_offset + B <= 2**32``); masks depend on ``(seed, row_offset + b, position)``.

    completion_mask: bool ``[B, L]``. Returns ``(mask bool [B, L], t float64 [B])``; ``t = 1``
    for a row without completion.
    """
    num_samples, row_offset = check_sample(completion_mask, index, num_samples, row_offset)
    return elbo_mask_unchecked(completion_mask, seed, index, num_samples, row_offset=row_offset)


def elbo_mask_unchecked(completion_mask: Tensor, seed: int, index: int, num_samples: int, *,
               row_offset: int) -> tuple[Tensor, Tensor]:
    """[`elbo_mask`][daca_kernels.likelihood.ratio_masks.elbo_mask] without its checks, for callers that checked the arguments."""
    n = completion_mask.sum(1)
    count = _masked_count(n, seed, index, num_samples, row_offset)
    rank = maskable_ranks_unchecked(completion_mask, seed, stream=STREAM_ELBO_MASK, sample=index, row_offset=row_offset)
    t = torch.where(n > 0, count.double() / n.clamp(min=1), 1.0)
    return completion_mask & (rank < count[:, None]), t


def check_block_choice(block_choice) -> str:
    """``block_choice`` if it is one of [`BLOCK_CHOICES`][daca_kernels.likelihood.ratio_masks.BLOCK_CHOICES], else a ValueError naming
    it."""
    return check_choice(block_choice, "block_choice", BLOCK_CHOICES)


def _permuted_block(seed: int, rows: Tensor, index: int, decoding_blocks: Tensor) -> Tensor:
    """int64 ``[B]``: entry ``index mod N_b`` of permutation ``floor(index / N_b)`` of ``0 .. N_b - 1``
    (``N_b = decoding_blocks``, clamped to >= 1) of each global row ``rows`` (int64 ``[B]``).

    Permutation ``p`` of row ``r`` orders the blocks ``v`` by ``(hash4(seed32(seed),
    STREAM_BLOCK_SELECT, r, p, 1 + v), v)``: a uniformly random permutation, a pure function of its
    words (the uniform choice hashes ``(r, index, 0)``, so the two never share a word).
    """
    n = decoding_blocks.clamp(min=1)
    blocks = torch.arange(int(n.max()), device=rows.device)
    keys = hash4(seed32(seed), STREAM_BLOCK_SELECT, rows[:, None], (index // n)[:, None], 1 + blocks[None, :])
    # A row's missing blocks sort after all of its keys (every key is below 2**32).
    keys = torch.where(blocks[None, :] < n[:, None], keys, WORD_LIMIT)
    order = torch.sort(keys, dim=1, stable=True).indices
    return order.gather(1, (index % n)[:, None]).squeeze(1)


def block_elbo_mask(
    completion_mask: Tensor,
    seed: int,
    index: int,
    num_samples: int,
    block_length: int,
    *,
    row_offset: int = 0,
    block_choice: str = "uniform",
    generated: Tensor | None = None,
) -> BlockElboMask:
    """Block-wise mask of Monte-Carlo sample ``index`` of ``num_samples`` (SPG's block masking).

    Each row's completion positions, in order, are cut into consecutive blocks of
    ``block_length`` (the last may be shorter), as a semi-autoregressive sampler decodes them. The
    sample selects one of the row's ``K`` blocks (per row and sample, from the seed), keeps the
    blocks before it clean, masks every completion position after it, and inside it masks
    ``m = ceil(u s)`` (at least 1) of its ``s`` positions by rank under the sample's key, ``u``
    stratified over the N samples exactly as in [`elbo_mask`][daca_kernels.likelihood.ratio_masks.elbo_mask]. Those ``m`` positions are
    scored; averaged over the N samples, ``1 / t`` times their summed log-probabilities is an
    unbiased estimate of the sum over blocks of the block ELBOs (the module docstring of
    ``daca_kernels.reference.masking`` derives it). With ``block_length`` at least the row's
    completion length the sample equals [`elbo_mask`][daca_kernels.likelihood.ratio_masks.elbo_mask]'s.

    The block (``block_choice``):

    - ``"uniform"`` (default): uniform on the ``K`` blocks, independently for every sample.
    - ``"spg"``: SPG's released rule. The generated region (``generated``) spans ``N >= K``
      decoding blocks of ``block_length``; a random permutation ``pi`` of ``0 .. N - 1`` per row
      gives sample j the block ``pi(j) mod K``. So the samples of a row take distinct entries of
      one permutation (without replacement: with ``N = K`` the first K samples cover every block
      once), and block c is chosen with probability ``q_c = #{v < N : v mod K = c} / N``, more
      often for the early blocks when K does not divide N. Sample j >= N (SPG has at most N)
      takes entry ``j mod N`` of a further, independent permutation ``floor(j / N)``.

    Args:
        completion_mask: bool ``[B, L]``: the completion positions (the answer whose blocks are
            masked; its size is ``n``).
        seed: int in ``[0, 2**64)``.
        index: the sample, ``0 <= index < num_samples``.
        num_samples: the number of samples drawn.
        block_length: int >= 1, the decoding block length.
        row_offset: global index of row 0 of this call, for sharded batches (int >= 0,
            ``row_offset + B <= 2**32``); masks depend on ``(seed, row_offset + b, position,
            index)``, so rows ``a:c`` with ``row_offset=a`` get exactly the masks of rows ``a:c``
            of the whole batch.
        block_choice: ``"uniform"`` or ``"spg"``.
        generated: bool ``[B, L]`` containing ``completion_mask``: the generated region whose
            ``N_b = ceil(|generated_b| / block_length)`` decoding blocks ``"spg"`` permutes
            (default: ``completion_mask``, i.e. ``N = K``); unused by ``"uniform"``.

    Returns:
        [`BlockElboMask`][daca_kernels.likelihood.ratio_masks.BlockElboMask] with ``scored`` and ``masked`` bool ``[B, L]`` and ``t``
        float64 ``[B]``.
    """
    num_samples, row_offset = check_sample(completion_mask, index, num_samples, row_offset)
    block_length = check_int(block_length, "block_length", low=1)
    block_choice = check_block_choice(block_choice)
    if generated is not None:
        check_tensor(generated, "generated", ndim=2, dtypes=(torch.bool,))
        check_shape(generated, "generated", completion_mask.shape, "[B, L] (from completion_mask)")
        check_same_device(completion_mask, "completion_mask", generated=generated)
        if bool((completion_mask & ~generated).any()):
            raise ValueError("generated must contain completion_mask (the answer lies in the generated region)")
    return block_elbo_mask_unchecked(completion_mask, seed, index, num_samples, block_length, row_offset=row_offset,
                            block_choice=block_choice, generated=generated)


def block_elbo_mask_unchecked(completion_mask: Tensor, seed: int, index: int, num_samples: int, block_length: int, *,
                     row_offset: int, block_choice: str, generated: Tensor | None) -> BlockElboMask:
    """[`block_elbo_mask`][daca_kernels.likelihood.ratio_masks.block_elbo_mask] without its checks, for callers that checked the
    arguments."""
    ordinal = torch.cumsum(completion_mask.long(), dim=1) - 1
    block = torch.where(completion_mask, ordinal // block_length, -1)
    num_blocks = (completion_mask.sum(1) + block_length - 1) // block_length
    rows = torch.arange(row_offset, row_offset + completion_mask.shape[0], device=completion_mask.device)
    if block_choice == "uniform":
        selected = hash4(seed32(seed), STREAM_BLOCK_SELECT, rows, index, 0) % num_blocks.clamp(min=1)
        # q = 1 / K
        chance_count, chance_total = torch.ones_like(num_blocks), num_blocks
    else:
        region = completion_mask if generated is None else generated
        decoding_blocks = (region.sum(1) + block_length - 1) // block_length
        selected = _permuted_block(seed, rows, index, decoding_blocks) % num_blocks.clamp(min=1)
        # q = #{v < N : v mod K = selected} / N
        chance_count = (decoding_blocks - 1 - selected) // num_blocks.clamp(min=1) + 1
        chance_total = decoding_blocks
    in_block = block == selected[:, None]
    size = in_block.sum(1)
    count = _masked_count(size, seed, index, num_samples, row_offset)
    rank = maskable_ranks_unchecked(in_block, seed, stream=STREAM_ELBO_MASK, sample=index, row_offset=row_offset)
    scored = in_block & (rank < count[:, None])
    masked = scored | (block > selected[:, None])
    t = torch.where(size > 0, (count * chance_count).double() / (chance_total * size).clamp(min=1), 1.0)
    return BlockElboMask(scored=scored, masked=masked, t=t)
