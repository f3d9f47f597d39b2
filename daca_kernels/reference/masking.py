"""Readable reference of the masks the likelihood estimators use: the executable spec of
:func:`daca_kernels.stratified_mask` and of the ranked masks of the coupled and ELBO estimators.

Every random choice is a counter hash (``daca_kernels.reference.hashing``): with
``s = seed32(seed)`` and ``H(stream, a, b, c) = hash4(s, stream, a, b, c)`` (a uint32), for row
``b`` and position ``i`` of the row, where ``b`` is the row's *global* index: its index in the
call's batch plus the call's ``row_offset`` (0 unless the batch is a shard of a larger one; it
must keep ``b < 2**32``):

- **Rank of a maskable position** (stream ``S``, sample word ``c``):
  ``key(b, i) = H(S, b, i, c)`` and ``rank(b, i)`` is the number of maskable positions ``j`` of
  row ``b`` with ``(key(b, j), j) < (key(b, i), i)`` (lexicographic: the position breaks ties).
  The ranks of a row are a uniformly random permutation of ``0 .. n_b - 1``, ``n_b`` being the
  row's number of maskable positions.
- **scheme="random"**: ``stratum(b, i) = rank(b, i) mod K`` with ``S = STREAM_STRATUM_KEY`` and
  ``c = 0``.
- **scheme="interleave"**: ``stratum(b, i) = (ordinal(b, i) + offset(b)) mod K`` where
  ``ordinal(b, i)`` counts the maskable positions of row ``b`` before ``i`` and
  ``offset(b) = H(STREAM_INTERLEAVE_OFFSET, b, 0, 0) mod K``.
- Positions that are not maskable get stratum ``-1``. Either scheme puts every maskable position
  in exactly one stratum and the stratum sizes of a row differ by at most one. When ``K`` exceeds
  ``n_b`` the strata ``n_b .. K - 1`` of that row (random scheme; a rotation of them for
  interleave) are empty: this is allowed, not an error.
- **Prompt masking** (d1): position ``i`` of row ``b`` is also masked in copy ``k`` iff it is a
  prompt position and ``H(STREAM_PROMPT_MASK, b, i, k) < T`` with the integer threshold
  ``T = floor(prompt_mask_prob * 2**32)`` (``p = 1`` masks every prompt position, ``p = 0`` none).
  Comparing integers keeps the draw exactly reproducible on every backend.

The coupled and ELBO estimators mask the first ``m`` positions of a row by rank:

- **Coupled split** (``coupled_logprob``): ``v_b = uniform(H(STREAM_MASK_RATIO, b, 0, 1))``,
  ``u_b = lo + (hi - lo) * v_b`` for ``t_range = (lo, hi)``, ``m_b = round(u_b * n_b)`` clipped to
  ``[1, n_b - 1]`` (``m_b = n_b`` when ``n_b < 2``). Stratum 0 holds the positions of rank
  ``< m_b`` (ranks of stream ``STREAM_STRATUM_KEY``, sample 0), stratum 1 the others;
  ``t_b = m_b / n_b``. Weights: ``1 / (c_b t_b)`` on stratum 0 and ``1 / (c_b (1 - t_b))`` on
  stratum 1, where ``c_b`` is the number of non-empty strata (2, or 1 for a one-token row), so
  the row sum is the mean of the two single-mask ELBO estimates.
- **ELBO sample** ``j`` of ``N``: ``v = uniform(H(STREAM_MASK_RATIO, b, j, 0))``,
  ``u = (j + v) / N`` (the N ratios are stratified over (0, 1)),
  ``m = min(max(ceil(u * n_b), 1), n_b)``: the positions of rank ``< m`` (stream
  ``STREAM_ELBO_MASK``, sample ``j``) are masked and ``t = m / n_b`` (``t = 1`` for an empty row).
  With ``u`` uniform on (0, 1), ``m`` is uniform on ``{1, .., n_b}``.
- **Block-wise ELBO sample** ``j`` of ``N`` with block length ``l`` (SPG's block masking, which
  mirrors semi-autoregressive decoding: one random block is being denoised, the blocks before it
  are clean and the blocks after it are still fully masked). The maskable positions of row ``b``,
  in order, are cut into consecutive blocks of ``l``: ``ordinal(b, i)`` counts the maskable
  positions of row ``b`` before ``i``, ``block(b, i) = floor(ordinal(b, i) / l)``, and the row has
  ``K_b = ceil(n_b / l)`` blocks (the last one shorter when ``l`` does not divide ``n_b``). The
  selected block is ``c_b = H(STREAM_BLOCK_SELECT, b, j, 0) mod K_b`` (uniform on
  ``{0, .., K_b - 1}`` up to a bias below ``K_b / 2**32``), of size
  ``s_b = min(l, n_b - c_b * l)``. The ratio ``u`` is the plain ELBO sample's (same draw,
  ``u = (j + v) / N``) and ``m = min(max(ceil(u * s_b), 1), s_b)``. **Scored**: the positions
  of block ``c_b`` whose rank among that block's positions (the rank definition above applied to
  the block's positions, stream ``STREAM_ELBO_MASK``, sample ``j``) is ``< m``. **Masked** in
  the model input: the scored positions and every maskable position with ``block(b, i) > c_b``;
  blocks before ``c_b`` and non-maskable positions stay clean. The weight ratio is
  ``t = m / (K_b * s_b)`` (``t = 1`` for an empty row). When ``l`` divides ``n_b`` (all blocks
  full) ``K_b * s_b = n_b`` and ``t = m / n_b``, the fraction of the completion that is scored.
  Why this ``t``: given the selected block ``c`` (size ``s``) and ``m``, the scored set is a
  uniformly random ``m``-subset of the block, so for a per-token value ``f`` that does not
  depend on the mask ``E[sum_{scored} f | c, m] = (m / s) * F_c`` (``F_c``: the sum of ``f`` over
  block ``c``) and ``E[1/t * sum_{scored} f] = sum_c (1 / K_b) * (K_b * s / m) * (m / s) * F_c =
  sum_c F_c``. With log-probabilities in place of ``f``, ``1/t`` times the scored sum is thus an
  unbiased estimate of the sum over blocks of the block ELBOs, a shorter last block included
  (``m / n_b`` in its place would scale block ``c``'s term by ``n_b / (K_b * s)``, biased
  whenever the blocks differ in size). With ``l >= n_b`` the row has one block and the sample is
  exactly the plain ELBO sample ``j``.

``uniform`` is ``hashing.uniform_from_hash`` (float32); the arithmetic after it is float64.

Masks depend only on ``(seed, b, i)`` (and ``k`` / the sample), never on the batch size, the
device or the backend, so the old-policy, reference and current passes of a trainer rebuild the
same masks from the same seed, and a call on rows ``a:c`` of a batch with ``row_offset=a`` gives
exactly rows ``a:c`` of the call on the whole batch (sharded data parallelism).
"""
from __future__ import annotations

import torch

from daca_kernels.reference.hashing import (
    STREAM_BLOCK_SELECT,
    STREAM_ELBO_MASK,
    STREAM_INTERLEAVE_OFFSET,
    STREAM_MASK_RATIO,
    STREAM_PROMPT_MASK,
    STREAM_STRATUM_KEY,
    hash4,
    seed32,
    uniform_from_hash,
)


def prompt_threshold(prompt_mask_prob: float) -> int:
    """The integer ``T`` with ``P(hash < T) = T / 2**32`` closest below ``prompt_mask_prob``."""
    return int(prompt_mask_prob * 2**32)


def _positions(maskable: torch.Tensor, row_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global row indices and positions, int64 ``[B, L]`` each."""
    batch, length = maskable.shape
    rows = torch.arange(row_offset, row_offset + batch, device=maskable.device)[:, None].expand(batch, length)
    cols = torch.arange(length, device=maskable.device)[None, :].expand(batch, length)
    return rows, cols


def _hash(seed: int, stream: int, a: torch.Tensor, b: torch.Tensor, c) -> torch.Tensor:
    """``hash4`` with every word a tensor on the device of ``a``."""
    word = lambda v: torch.as_tensor(v, dtype=torch.int64, device=a.device)  # noqa: E731
    return hash4(seed32(seed), word(stream), a, b, word(c))


def maskable_ranks(
    maskable: torch.Tensor, seed: int, stream: int = STREAM_STRATUM_KEY, sample: int = 0, row_offset: int = 0
) -> torch.Tensor:
    """Rank of each maskable position among its row's maskable positions, by ``(key, position)``.

    maskable: bool ``[B, L]``; row_offset: global index of row 0 of this call, for sharded
    batches (keys depend on ``(seed, row_offset + b, position)``). Returns int64 ``[B, L]``:
    ``0 .. n_b - 1`` on maskable positions, -1 elsewhere. Written as the pairwise count of the
    definition (``O(L^2)`` per row).
    """
    rows, cols = _positions(maskable, row_offset)
    key = _hash(seed, stream, rows, cols, sample)
    key_j, key_i = key[:, None, :], key[:, :, None]
    col_j, col_i = cols[:, None, :], cols[:, :, None]
    before = (key_j < key_i) | ((key_j == key_i) & (col_j < col_i))
    rank = (before & maskable[:, None, :]).sum(-1)
    return torch.where(maskable, rank, -1)


def strata(
    maskable: torch.Tensor, num_strata: int, seed: int, scheme: str = "random", row_offset: int = 0
) -> torch.Tensor:
    """int64 ``[B, L]``: the stratum (``0 .. K-1``) of every maskable position, -1 elsewhere.

    maskable: bool ``[B, L]``; row_offset: global index of row 0 of this call (see
    :func:`maskable_ranks`).
    """
    if scheme == "random":
        rank = maskable_ranks(maskable, seed, STREAM_STRATUM_KEY, 0, row_offset)
        return torch.where(maskable, rank % num_strata, -1)
    if scheme == "interleave":
        rows, _ = _positions(maskable, row_offset)
        ordinal = torch.cumsum(maskable.long(), dim=1) - maskable.long()
        offset = _hash(seed, STREAM_INTERLEAVE_OFFSET, rows[:, :1], torch.zeros_like(rows[:, :1]), 0) % num_strata
        return torch.where(maskable, (ordinal + offset) % num_strata, -1)
    raise ValueError(f"scheme must be 'random' or 'interleave', got {scheme!r}")


def prompt_masked(
    prompt: torch.Tensor, copy: int, seed: int, prompt_mask_prob: float, row_offset: int = 0
) -> torch.Tensor:
    """bool ``[B, L]``: the prompt positions (bool ``[B, L]`` ``prompt``) masked in copy ``copy``;
    row_offset: global index of row 0 of this call (see :func:`maskable_ranks`)."""
    rows, cols = _positions(prompt, row_offset)
    drawn = _hash(seed, STREAM_PROMPT_MASK, rows, cols, copy) < prompt_threshold(prompt_mask_prob)
    return prompt & drawn


def stratified_mask(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    num_strata: int,
    seed: int,
    mask_id: int,
    scheme: str = "random",
    prompt: torch.Tensor | None = None,
    prompt_mask_prob: float = 0.0,
    row_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strata and the K masked copies of ``input_ids``.

    input_ids: integer ``[B, L]``; maskable and prompt: bool ``[B, L]`` (prompt None: no prompt
    masking); row_offset: global index of row 0 of this call, for sharded batches (masks depend on
    ``(seed, row_offset + b, position)``). Returns ``(strata int64 [B, L], copies [K, B, L] of
    input_ids' dtype)`` where copy ``k`` holds ``mask_id`` where ``strata == k`` or where the
    prompt is masked for ``k``.
    """
    assigned = strata(maskable, num_strata, seed, scheme, row_offset)
    copies = []
    for k in range(num_strata):
        masked = assigned == k
        if prompt is not None and prompt_mask_prob > 0:
            masked = masked | prompt_masked(prompt, k, seed, prompt_mask_prob, row_offset)
        copies.append(torch.where(masked, torch.full_like(input_ids, mask_id), input_ids))
    return assigned, torch.stack(copies)


def _row_uniforms(batch: int, seed: int, a, c, device: torch.device, row_offset: int) -> torch.Tensor:
    """float64 ``[B]``: ``uniform(H(STREAM_MASK_RATIO, row_offset + b, a, c))`` for every row b."""
    rows = torch.arange(row_offset, row_offset + batch, device=device)
    return uniform_from_hash(_hash(seed, STREAM_MASK_RATIO, rows, torch.full_like(rows, a), c)).double()


def coupled_split(
    maskable: torch.Tensor,
    seed: int,
    t_range: tuple[float, float] = (0.2, 0.8),
    rank: torch.Tensor | None = None,
    row_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two complementary masks of the coupled estimator.

    maskable: bool ``[B, L]``; rank: ``maskable_ranks(maskable, seed, STREAM_STRATUM_KEY, 0,
    row_offset)`` when already computed (by a faster implementation), else None; row_offset:
    global index of row 0 of this call, for sharded batches (masks depend on ``(seed,
    row_offset + b, position)``). Returns ``(strata int64 [B, L] in {-1, 0, 1}, t float64 [B],
    weights float64 [B, L])`` as defined in the module docstring (weights 0 off maskable).
    """
    n = maskable.sum(1)
    v = _row_uniforms(maskable.shape[0], seed, 0, 1, maskable.device, row_offset)
    u = t_range[0] + (t_range[1] - t_range[0]) * v
    m = torch.where(n >= 2, torch.round(u * n).long().clamp(min=1).minimum(n - 1), n)
    if rank is None:
        rank = maskable_ranks(maskable, seed, STREAM_STRATUM_KEY, 0, row_offset)
    first = rank < m[:, None]
    assigned = torch.where(maskable, torch.where(first, 0, 1), -1)
    t = m.double() / n.clamp(min=1)
    halves = torch.where(n >= 2, 2.0, 1.0).double()
    # Infinite where a stratum is empty (t = 0 or 1), and then never selected.
    w_first, w_second = 1 / (halves * t), 1 / (halves * (1 - t))
    weights = torch.where(assigned == 0, w_first[:, None], torch.where(assigned == 1, w_second[:, None], 0.0))
    return assigned, t, weights


def _sample_count(
    maskable_count: torch.Tensor, seed: int, index: int, num_samples: int, row_offset: int
) -> torch.Tensor:
    """int64 ``[B]``: ``m = min(max(ceil(u * size), 1), size)`` of ELBO sample ``index`` of
    ``num_samples``, with ``u = (index + v) / N`` stratified over the samples and ``size`` the
    int64 ``[B]`` ``maskable_count`` (0 gives 0)."""
    v = _row_uniforms(maskable_count.shape[0], seed, index, 0, maskable_count.device, row_offset)
    u = (index + v) / num_samples
    return torch.ceil(u * maskable_count).long().clamp(min=1).minimum(maskable_count)


def elbo_mask(
    maskable: torch.Tensor,
    seed: int,
    index: int,
    num_samples: int,
    rank: torch.Tensor | None = None,
    row_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of ELBO sample ``index`` of ``num_samples``: ``(mask bool [B, L], t float64 [B])``.

    maskable: bool ``[B, L]``; rank: ``maskable_ranks(maskable, seed, STREAM_ELBO_MASK, index,
    row_offset)`` when already computed; row_offset: global index of row 0 of this call, for
    sharded batches (masks depend on ``(seed, row_offset + b, position)``).
    """
    n = maskable.sum(1)
    m = _sample_count(n, seed, index, num_samples, row_offset)
    if rank is None:
        rank = maskable_ranks(maskable, seed, STREAM_ELBO_MASK, index, row_offset)
    mask = maskable & (rank < m[:, None])
    t = torch.where(n > 0, m.double() / n.clamp(min=1), 1.0)
    return mask, t


def selected_block(
    maskable: torch.Tensor, seed: int, index: int, block_length: int, row_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks of a block-wise ELBO sample and the one it selects (module docstring).

    maskable: bool ``[B, L]``; block_length: ``l >= 1``; row_offset: global index of row 0 of
    this call. Returns ``(block int64 [B, L]`` (the block of each maskable position, -1
    elsewhere), ``selected int64 [B]`` (``c_b``; 0 for an empty row), ``num_blocks int64 [B]``
    (``K_b``)).
    """
    ordinal = torch.cumsum(maskable.long(), dim=1) - 1
    block = torch.where(maskable, ordinal // block_length, -1)
    num_blocks = (maskable.sum(1) + block_length - 1) // block_length
    rows = torch.arange(row_offset, row_offset + maskable.shape[0], device=maskable.device)
    draw = _hash(seed, STREAM_BLOCK_SELECT, rows, torch.full_like(rows, index), 0)
    return block, draw % num_blocks.clamp(min=1), num_blocks


def block_elbo_mask(
    maskable: torch.Tensor,
    seed: int,
    index: int,
    num_samples: int,
    block_length: int,
    rank: torch.Tensor | None = None,
    row_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-wise ELBO sample ``index`` of ``num_samples`` (module docstring).

    maskable: bool ``[B, L]``; block_length: ``l >= 1``; rank: ``maskable_ranks(in_block, seed,
    STREAM_ELBO_MASK, index, row_offset)`` with ``in_block`` the positions of the selected
    blocks (``block == selected[:, None]`` from :func:`selected_block`) when already computed;
    row_offset: global index of row 0 of this call, for sharded batches. Returns ``(scored
    bool [B, L], masked bool [B, L], t float64 [B])``.
    """
    block, selected, num_blocks = selected_block(maskable, seed, index, block_length, row_offset)
    in_block = block == selected[:, None]
    size = in_block.sum(1)
    m = _sample_count(size, seed, index, num_samples, row_offset)
    if rank is None:
        rank = maskable_ranks(in_block, seed, STREAM_ELBO_MASK, index, row_offset)
    scored = in_block & (rank < m[:, None])
    masked = scored | (block > selected[:, None])
    t = torch.where(size > 0, m.double() / (num_blocks * size).clamp(min=1), 1.0)
    return scored, masked, t
