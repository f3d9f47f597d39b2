"""Readable reference of the masks the likelihood estimators use: the executable spec of
[`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask] and of the ranked masks of the coupled and ELBO estimators.

Every random choice is a counter hash (``daca_kernels.hashing``): with
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
- **SPG's block choice** (``block_choice="spg"``; the above is ``"uniform"``): the generated
  region of row ``b`` (a superset of its maskable positions) spans ``N_b = ceil(g_b / l)``
  decoding blocks (``g_b`` generated positions; ``N_b >= K_b``). Permutation ``p`` of the row is
  the blocks ``0 .. N_b - 1`` sorted by ``(H(STREAM_BLOCK_SELECT, b, p, 1 + v), v)``, and sample
  ``j`` selects ``c_b = pi_{floor(j / N_b)}(j mod N_b) mod K_b``: SPG's ``randperm(N) % K``, the
  samples of a row taking successive entries of one permutation. Block ``c`` is then chosen with
  probability ``q_c = #{v < N_b : v mod K_b = c} / N_b``, and the weight ratio is
  ``t = m q_c / s_b`` (``1 / q_c`` replaces ``K_b`` in the derivation above, which stays
  unbiased); for the uniform choice ``q_c = 1 / K_b``. Over the ``N_b`` samples of one
  permutation every block ``c`` is selected exactly ``N_b q_c`` times, so the mean of
  ``m / t = s_c / q_c`` over them is exactly ``n_b``.

``uniform(h) = (floor(h / 2**9) + 1/2) / 2**23`` (exact in float32); the arithmetic after it is
float64. The per-position keys are the vectorised ``daca_kernels.hashing.hash4``; the per-row draws
(ratios, block choice) come from the plain-Python hash of ``daca_kernels.reference.hashing``, and
the ratio masks are computed one row at a time, independently of the vectorised production code
in ``daca_kernels.likelihood.ratio_masks``.

Masks depend only on ``(seed, b, i)`` (and ``k`` / the sample), never on the batch size, the
device or the backend, so the old-policy, reference and current passes of a trainer rebuild the
same masks from the same seed, and a call on rows ``a:c`` of a batch with ``row_offset=a`` gives
exactly rows ``a:c`` of the call on the whole batch (sharded data parallelism).
"""
from __future__ import annotations

import math

import torch

from daca_kernels.hashing import (
    STREAM_BLOCK_SELECT,
    STREAM_ELBO_MASK,
    STREAM_INTERLEAVE_OFFSET,
    STREAM_MASK_RATIO,
    STREAM_PROMPT_MASK,
    STREAM_STRATUM_KEY,
    hash4,
    seed32,
)
from daca_kernels.reference.hashing import murmur3_32_words, uniform


def prompt_threshold(prompt_mask_prob: float) -> int:
    """The integer ``T`` with ``P(hash < T) = T / 2**32`` closest below ``prompt_mask_prob``."""
    return int(prompt_mask_prob * 2**32)


def _positions(maskable: torch.Tensor, row_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global row indices and positions, int64 ``[B, L]`` each."""
    batch, length = maskable.shape
    rows = torch.arange(row_offset, row_offset + batch, device=maskable.device)[:, None].expand(batch, length)
    cols = torch.arange(length, device=maskable.device)[None, :].expand(batch, length)
    return rows, cols


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
    key = hash4(seed32(seed), stream, rows, cols, sample)
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
    [`maskable_ranks`][daca_kernels.reference.masking.maskable_ranks]).
    """
    if scheme == "random":
        rank = maskable_ranks(maskable, seed, STREAM_STRATUM_KEY, 0, row_offset)
        return torch.where(maskable, rank % num_strata, -1)
    if scheme == "interleave":
        rows, _ = _positions(maskable, row_offset)
        ordinal = torch.cumsum(maskable.long(), dim=1) - maskable.long()
        offset = hash4(seed32(seed), STREAM_INTERLEAVE_OFFSET, rows[:, :1], torch.zeros_like(rows[:, :1]), 0) % num_strata
        return torch.where(maskable, (ordinal + offset) % num_strata, -1)
    raise ValueError(f"scheme must be 'random' or 'interleave', got {scheme!r}")


def prompt_masked(
    prompt: torch.Tensor, copy: int, seed: int, prompt_mask_prob: float, row_offset: int = 0
) -> torch.Tensor:
    """bool ``[B, L]``: the prompt positions (bool ``[B, L]`` ``prompt``) masked in copy ``copy``;
    row_offset: global index of row 0 of this call (see [`maskable_ranks`][daca_kernels.reference.masking.maskable_ranks])."""
    rows, cols = _positions(prompt, row_offset)
    drawn = hash4(seed32(seed), STREAM_PROMPT_MASK, rows, cols, copy) < prompt_threshold(prompt_mask_prob)
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


def _ratio_uniform(seed: int, row: int, a: int, c: int) -> float:
    """``uniform(H(STREAM_MASK_RATIO, row, a, c))`` of one row, from the plain-Python hash."""
    return uniform(murmur3_32_words(seed32(seed), [STREAM_MASK_RATIO, row, a, c]))


def _sample_count(size: int, seed: int, row: int, index: int, num_samples: int) -> int:
    """``m = min(max(ceil(u * size), 1), size)`` of ELBO sample ``index`` of ``num_samples`` for
    global row ``row``, with ``u = (index + v) / N`` stratified over the samples (0 when size is 0)."""
    u = (index + _ratio_uniform(seed, row, index, 0)) / num_samples
    return min(max(math.ceil(u * size), 1), size)


def coupled_split(
    maskable: torch.Tensor, seed: int, t_range: tuple[float, float] = (0.2, 0.8), row_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two complementary masks of the coupled estimator, one row at a time.

    maskable: bool ``[B, L]``; row_offset: global index of row 0 of this call, for sharded batches
    (masks depend on ``(seed, row_offset + b, position)``). Returns ``(strata int64 [B, L] in
    {-1, 0, 1}, t float64 [B], weights float64 [B, L])`` as defined in the module docstring
    (weights 0 off maskable).
    """
    low, high = t_range
    rank = maskable_ranks(maskable, seed, STREAM_STRATUM_KEY, 0, row_offset)
    assigned = torch.full(maskable.shape, -1, dtype=torch.int64, device=maskable.device)
    t = torch.zeros(maskable.shape[0], dtype=torch.float64, device=maskable.device)
    weights = torch.zeros(maskable.shape, dtype=torch.float64, device=maskable.device)
    for b in range(maskable.shape[0]):
        n = int(maskable[b].sum())
        u = low + (high - low) * _ratio_uniform(seed, row_offset + b, 0, 1)
        m = min(max(round(u * n), 1), n - 1) if n >= 2 else n
        first = maskable[b] & (rank[b] < m)
        second = maskable[b] & (rank[b] >= m)
        t_b = m / max(n, 1)
        non_empty = 2 if n >= 2 else 1
        assigned[b, first] = 0
        assigned[b, second] = 1
        t[b] = t_b
        if first.any():
            weights[b, first] = 1 / (non_empty * t_b)
        if second.any():
            weights[b, second] = 1 / (non_empty * (1 - t_b))
    return assigned, t, weights


def elbo_mask(
    maskable: torch.Tensor, seed: int, index: int, num_samples: int, row_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of ELBO sample ``index`` of ``num_samples``: ``(mask bool [B, L], t float64 [B])``.

    maskable: bool ``[B, L]``; row_offset: global index of row 0 of this call, for sharded batches
    (masks depend on ``(seed, row_offset + b, position)``).
    """
    rank = maskable_ranks(maskable, seed, STREAM_ELBO_MASK, index, row_offset)
    mask = torch.zeros_like(maskable)
    t = torch.ones(maskable.shape[0], dtype=torch.float64, device=maskable.device)
    for b in range(maskable.shape[0]):
        n = int(maskable[b].sum())
        m = _sample_count(n, seed, row_offset + b, index, num_samples)
        mask[b] = maskable[b] & (rank[b] < m)
        if n > 0:
            t[b] = m / n
    return mask, t


def _spg_block(seed: int, row: int, index: int, decoding_blocks: int, num_blocks: int) -> tuple[int, int, int]:
    """SPG's choice for sample ``index`` of global row ``row``: ``(block, a, n)`` with ``q = a / n``
    (module docstring)."""
    n = max(decoding_blocks, 1)
    keys = [(murmur3_32_words(seed32(seed), [STREAM_BLOCK_SELECT, row, index // n, 1 + v]), v) for v in range(n)]
    permutation = [v for _, v in sorted(keys)]
    block = permutation[index % n] % max(num_blocks, 1)
    return block, sum(1 for v in range(n) if v % max(num_blocks, 1) == block), n


def block_elbo_mask(
    maskable: torch.Tensor,
    seed: int,
    index: int,
    num_samples: int,
    block_length: int,
    row_offset: int = 0,
    block_choice: str = "uniform",
    generated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-wise ELBO sample ``index`` of ``num_samples`` (module docstring), one row at a time.

    maskable: bool ``[B, L]``; block_length: ``l >= 1``; row_offset: global index of row 0 of this
    call, for sharded batches; block_choice: ``"uniform"`` or ``"spg"``; generated: bool
    ``[B, L]`` containing ``maskable``, the region whose decoding blocks ``"spg"`` permutes
    (default ``maskable``). Returns ``(scored bool [B, L], masked bool [B, L], t float64 [B])``.
    """
    if generated is None:
        generated = maskable
    scored = torch.zeros_like(maskable)
    masked = torch.zeros_like(maskable)
    t = torch.ones(maskable.shape[0], dtype=torch.float64, device=maskable.device)
    for b in range(maskable.shape[0]):
        row = row_offset + b
        positions = maskable[b].nonzero().flatten()
        num_blocks = -(-len(positions) // block_length)
        if block_choice == "spg":
            decoding_blocks = -(-int(generated[b].sum()) // block_length)
            selected, chance, total = _spg_block(seed, row, index, decoding_blocks, num_blocks)
        else:
            selected = murmur3_32_words(seed32(seed), [STREAM_BLOCK_SELECT, row, index, 0]) % max(num_blocks, 1)
            chance, total = 1, num_blocks
        start, end = selected * block_length, (selected + 1) * block_length
        in_block = torch.zeros_like(maskable[b])
        in_block[positions[start:end]] = True
        size = int(in_block.sum())
        m = _sample_count(size, seed, row, index, num_samples)
        rank = maskable_ranks(in_block[None], seed, STREAM_ELBO_MASK, index, row)[0]
        scored[b] = in_block & (rank < m)
        masked[b] = scored[b]
        masked[b, positions[end:]] = True
        if size > 0:
            t[b] = m * chance / (total * size)
    return scored, masked, t
