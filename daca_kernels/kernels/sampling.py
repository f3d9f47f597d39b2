"""Triton kernel for one denoising step: Gumbel-max candidate and its noise-free confidence.

One program per row makes one pass over the row's logits ``x``, a tile of ``BLOCK_V`` at a time
seen as ``[BLOCK_V // VEC, VEC]``: a lane holds whole vectors of ``VEC`` consecutive tokens (16
bytes), so the maxima and sums within a vector stay in its registers. Per lane it keeps
- the maximum candidate score (``daca_kernels.kernels.gumbel``; ``x`` alone for argmax) and the
  tile where the lane first reached it; after the loop the lane's vector of that tile is scored
  again and its lowest id reaching the maximum taken, so the loop tracks no per-element index;
- the online softmax statistics of the raw ``x`` (``online_softmax``; and the entropy's sum).
The noise of a token comes from ``keyed_hash(row_key, token)`` with the row key ``hash3(seed,
stream, step, row_id)``; its first product, ``(token * WEYL + row_key) * KEYED_F1``, is one addition
per element (a per-lane constant plus one per tile), and the noise is never stored.

Only the tile holding the mask id compares ids with it, and only the last, partial tile is masked:
the loop over the other tiles does neither. Contiguous rows that do not start on 16 bytes begin
with a masked tile of the tokens up to their first token on 16 bytes; the tiles after it start
there and are read in vectors, as on aligned rows (the tokens' noise and the candidate are the
same; the softmax sums group the tokens differently, so the confidence and entropy agree to
rounding). The confidence is ``exp((x[candidate] - row_max) -
log_total)``: the softmax probability of the candidate without temperature or noise. The mask id's
logit counts as ``-inf`` in both the candidate and the softmax. Launchers do no validation: callers
(``daca_kernels.ops``) check everything.
"""
from __future__ import annotations

import math
from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl

from daca_kernels.kernels import gumbel
from daca_kernels.kernels.gumbel import ARGMAX, NOISE_SCALED, candidate_scores
from daca_kernels.kernels.hashing import KEYED_F1, WEYL, WEYL_F1, hash3
from daca_kernels.kernels.launch import (
    FLOAT_DTYPES,
    INTERPRETED,
    accumulation_dtype,
    accumulator_dtype,
    gpu_row_lengths,
    num_warps,
    row_block,
)
from daca_kernels.kernels.online_softmax import online_lse_finish, online_lse_start, online_lse_update


def _gpu_block(dtype: torch.dtype) -> int:
    """Vocabulary elements per loop step on a GPU (float64: half, for the registers)."""
    return 1024 if dtype == torch.float64 else 2048


def _on_16_bytes(logits: torch.Tensor) -> bool:
    """Every row of ``logits`` starts on 16 bytes."""
    return logits.data_ptr() % 16 == 0 and logits.stride(0) * logits.element_size() % 16 == 0


def _register_cap(logits: torch.Tensor) -> int | None:
    """ptxas's register cap for a launch on ``logits``: 32 for contiguous rows of 16-bit logits
    (read in vectors, after a prologue up to 16 bytes where they do not start there), which then
    fit without spilling at 64 warps per SM, where ptxas alone takes 40 registers and 48 warps (the
    rows stream from DRAM: more warps, more loads in flight); 128 where the loads are per token
    (strided rows of 16- or 32-bit logits), where ptxas would otherwise trade a few bytes of spills
    for occupancy; None (no cap) for contiguous float32 rows, which spill at 32, and for float64,
    which needs more. ``daca_kernels.tools.ahead_of_time`` fails on any spill."""
    if logits.stride(1) != 1:
        return None if logits.dtype == torch.float64 else 128
    return 32 if logits.element_size() == 2 else None


def _vector(dtype: torch.dtype) -> int:
    """Tokens per lane vector: 16 bytes, one vector load where the row is aligned."""
    return 16 // dtype.itemsize


@triton.jit
def _tile_scores(x, offs, cols_wf, start, key, logit_scale, noise_scale, mask_id, EXCLUDE_MASK: tl.constexpr,
                 SCORE: tl.constexpr, NOISE: tl.constexpr):
    """``(x, scores)`` of a ``[lanes, VEC]`` tile whose lanes start at token ``start`` (a scalar or
    ``[lanes, 1]``): ``x`` with the mask id at ``-inf`` when ``EXCLUDE_MASK``."""
    if EXCLUDE_MASK:
        x = tl.where(offs == mask_id, float("-inf"), x)
    if SCORE != ARGMAX:
        words = cols_wf + (tl.cast(start, tl.uint32) * WEYL + key) * KEYED_F1
        return x, candidate_scores(x, words, logit_scale, noise_scale,
                                   SCORE == NOISE_SCALED, NOISE)
    else:
        return x, x


@triton.jit
def _load_full_tile(row_ptr, start, cols, stride_v, ACC: tl.constexpr, BF16_PAIRS: tl.constexpr):
    """The full tile of tokens ``start + cols`` (``[lanes, VEC]``) in ``ACC``. ``BF16_PAIRS``: the row
    is contiguous bfloat16 starting on 4 bytes, read as 32-bit pairs whose halves are the float32
    values' top bits (one instruction per token where a conversion takes 1.5)."""
    if BF16_PAIRS:
        LANES: tl.constexpr = cols.shape[0]
        HALF: tl.constexpr = cols.shape[1] // 2
        pairs_ptr = (row_ptr + start).to(tl.pointer_type(tl.uint32), bitcast=True)
        pairs = tl.load(pairs_ptr + tl.arange(0, LANES)[:, None] * HALF + tl.arange(0, HALF)[None, :])
        low = (pairs << 16).to(tl.float32, bitcast=True)
        high = (pairs & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(low, high), [LANES, 2 * HALF])
    else:
        return tl.load(row_ptr + (start + cols).to(tl.int64) * stride_v).to(ACC)


@triton.jit
def _fold_tile(row, start, state, BOUNDED: tl.constexpr, EXCLUDE_MASK: tl.constexpr, SCORE: tl.constexpr,
               NOISE: tl.constexpr, RETURN_ENTROPY: tl.constexpr, ACC: tl.constexpr, BF16_PAIRS: tl.constexpr):
    """Folds the tile starting at token ``start`` into the lane states ``state = (best, best_start,
    m, s, w)``; ``row = (row_ptr, V, stride_v, cols, cols_wf, key, logit_scale, noise_scale,
    mask_id)``."""
    row_ptr, V, stride_v, cols, cols_wf, key, logit_scale, noise_scale, mask_id = row
    best, best_start, m, s, w = state
    offs = start + cols
    if BOUNDED:
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < V, other=float("-inf")).to(ACC)
    else:
        x = _load_full_tile(row_ptr, start, cols, stride_v, ACC, BF16_PAIRS)
    x, score = _tile_scores(x, offs, cols_wf, start, key, logit_scale, noise_scale, mask_id, EXCLUDE_MASK,
                            SCORE, NOISE)
    lane_best = tl.max(score, axis=1)
    # Strictly greater: a lane keeps the earliest tile among equal maxima.
    better = lane_best > best
    best = tl.where(better, lane_best, best)
    best_start = tl.where(better, start, best_start)
    m, s, w = online_lse_update(m, s, w, x, RETURN_ENTROPY)
    return best, best_start, m, s, w


@triton.jit
def _fold_full_tiles(row, lo, hi, state, SCORE: tl.constexpr, NOISE: tl.constexpr, RETURN_ENTROPY: tl.constexpr,
                     ACC: tl.constexpr, BF16_PAIRS: tl.constexpr, BLOCK_V: tl.constexpr):
    """``_fold_tile`` over the full tiles starting in ``[lo, hi)``, none holding the mask id."""
    for start in range(lo, hi, BLOCK_V):
        state = _fold_tile(row, start, state, False, False, SCORE, NOISE, RETURN_ENTROPY, ACC, BF16_PAIRS)
    return state


# The hash words are typed, so every value of them runs the same compiled kernel.
@triton.jit(do_not_specialize=["seed", "step", "stream", "mask_id"])
def _sample_step_kernel(
    logits_ptr,
    row_ids_ptr,
    tokens_ptr,
    confidence_ptr,
    entropy_ptr,
    V,
    stride_n,
    stride_v,
    logit_scale,
    noise_scale,
    seed: tl.uint32,
    step: tl.uint32,
    stream: tl.uint32,
    mask_id: tl.int32,
    ACC: tl.constexpr,
    SCORE: tl.constexpr,
    NOISE: tl.constexpr,
    EXCLUDE_MASK: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = logits_ptr + pid * stride_n
    key = tl.zeros([], tl.uint32)
    if SCORE != ARGMAX:
        key = hash3(seed, stream, step, tl.load(row_ids_ptr + pid))
    LANES: tl.constexpr = BLOCK_V // VEC
    lane_start = tl.arange(0, LANES) * VEC
    cols = lane_start[:, None] + tl.arange(0, VEC)[None, :]
    cols_wf = cols.to(tl.uint32) * WEYL_F1
    m, s, w = online_lse_start(LANES, ACC)
    state = (tl.full([LANES], float("-inf"), ACC), tl.zeros([LANES], tl.int32), m, s, w)

    # Tokens are counted from ``row_ptr``: the row's start, or with ``PROLOGUE`` (contiguous rows not
    # on 16 bytes) the first token on 16 bytes, ``shift`` tokens in. Token ``t`` of the row is then
    # ``t - shift``: its hash word ``(t - shift) * WEYL + key + shift * WEYL`` is the same, the mask
    # id and the row length lose the shift, and the tokens before it are a first tile at ``-shift``.
    shift = tl.zeros([], tl.int32)
    row_ptr = row_start
    if PROLOGUE:
        address = row_start.to(tl.int64)
        ELEMENT: tl.constexpr = logits_ptr.dtype.element_ty.primitive_bitwidth // 8
        shift = ((16 - address % 16) % 16 // ELEMENT).to(tl.int32)
        row_ptr = tl.multiple_of(row_start + shift, 16)
    length = V - shift
    mask_at = mask_id - shift
    row = (row_ptr, length, stride_v, cols, cols_wf, key + shift.to(tl.uint32) * WEYL, logit_scale, noise_scale,
           mask_at)
    # The prologue's tile: the tokens at [-shift, min(0, length)) (none without PROLOGUE).
    prologue_end = tl.minimum(length, 0)
    if PROLOGUE:
        prologue = (row_ptr, prologue_end, stride_v, cols, cols_wf, key + shift.to(tl.uint32) * WEYL, logit_scale,
                    noise_scale, mask_at)
        state = _fold_tile(prologue, -shift, state, True, EXCLUDE_MASK, SCORE, NOISE, RETURN_ENTROPY, ACC, False)

    # Full tiles before the mask id's tile, that tile, full tiles after it, the partial last tile.
    full_end = tl.maximum(length, 0) // BLOCK_V * BLOCK_V
    mask_tile = full_end
    if EXCLUDE_MASK:
        mask_tile = tl.minimum(tl.maximum(mask_at, 0) // BLOCK_V * BLOCK_V, full_end)
    state = _fold_full_tiles(row, 0, mask_tile, state, SCORE, NOISE, RETURN_ENTROPY, ACC, BF16_PAIRS, BLOCK_V)
    if mask_tile < full_end:
        state = _fold_tile(row, mask_tile, state, False, True, SCORE, NOISE, RETURN_ENTROPY, ACC, BF16_PAIRS)
    state = _fold_full_tiles(row, mask_tile + BLOCK_V, full_end, state, SCORE, NOISE, RETURN_ENTROPY, ACC, BF16_PAIRS,
                             BLOCK_V)
    if full_end < length:
        state = _fold_tile(row, full_end, state, True, EXCLUDE_MASK, SCORE, NOISE, RETURN_ENTROPY, ACC, False)
    best, best_start, m, s, w = state

    # Each lane's vector in its best tile, scored again as the tile was: its lowest id reaching the
    # maximum.
    offs = best_start[:, None] + cols
    end = length
    if PROLOGUE:
        end = tl.where(best_start < 0, prologue_end, length)[:, None]
    x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < end, other=float("-inf")).to(ACC)
    x, score = _tile_scores(x, offs, cols_wf, best_start[:, None], key + shift.to(tl.uint32) * WEYL, logit_scale,
                            noise_scale, mask_at, EXCLUDE_MASK, SCORE, NOISE)
    lane_token = best_start + lane_start + tl.argmax(score, axis=1, tie_break_left=True)
    top = tl.max(best, axis=0)
    token = (tl.min(tl.where(best == top, lane_token, length), axis=0) + shift).to(tl.int64)
    row_max, log_total, entropy = online_lse_finish(m, s, w, RETURN_ENTROPY)
    x_token = tl.load(row_start + token * stride_v, mask=token < V, other=float("nan")).to(ACC)
    tl.store(tokens_ptr + pid, token)
    tl.store(confidence_ptr + pid, tl.exp((x_token - row_max) - log_total))
    if RETURN_ENTROPY:
        tl.store(entropy_ptr + pid, entropy)


def sample_step_forward(
    logits: torch.Tensor,
    row_ids: torch.Tensor,
    logit_scale: float,
    noise_scale: float,
    seed: int,
    step: int,
    stream: int,
    mask_id: int,
    return_entropy: bool,
    fast_noise: bool | None = None,
):
    """Candidate, confidence and (optionally) entropy of every row of ``logits``.

    logits ``[N, V]`` of any float dtype and strides; row_ids int64 ``[N]`` in ``[0, 2**32)`` (the
    noise identity of each row); ``logit_scale`` and ``noise_scale`` Python floats in ``(0, 1]``,
    one of them 1, multiplying the logits and the Gumbel noise of the score, ``noise_scale`` 0 for
    the plain argmax; ``seed`` a 32-bit int, ``step`` and ``stream`` ints in ``[0, 2**32)``;
    ``mask_id`` the excluded id or -1. ``fast_noise``: the base-2 noise of
    ``daca_kernels.kernels.gumbel`` (default: on CUDA for 16- and 32-bit logits, where its
    logarithms are the hardware's; elsewhere ``tl.log2`` stands in for them). Returns int64 ``[N]``
    and two tensors of the accumulation dtype (float32, or float64 for float64 logits): ``[N]`` and
    ``[N]`` (``[0]`` without entropy).
    """
    n, V = logits.shape
    acc = accumulation_dtype(logits.dtype)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    confidence = torch.empty(n, dtype=acc, device=logits.device)
    entropy = torch.empty(n if return_entropy else 0, dtype=acc, device=logits.device)
    if n == 0:
        return tokens, confidence, entropy
    # Compiled kernels run on a GPU: CUDA's (lg2.approx) unless this is a ROCm build.
    hardware = not INTERPRETED and torch.version.hip is None
    if fast_noise is None:
        fast_noise = hardware and logits.dtype != torch.float64
    noise = (gumbel.FAST_HARDWARE if hardware else gumbel.FAST) if fast_noise else gumbel.EXACT
    if noise_scale == 0:
        score = gumbel.ARGMAX
    elif logit_scale == 1.0:
        score = gumbel.NOISE_SCALED
        noise_scale = noise_scale * math.log(2) if fast_noise else noise_scale  # base-2 noise
    else:
        score = gumbel.LOGITS_SCALED
        logit_scale = logit_scale / math.log(2) if fast_noise else logit_scale  # scores in units of log 2
    block_v = row_block(V, _gpu_block(logits.dtype))
    _sample_step_kernel[(n,)](
        logits,
        row_ids,
        tokens,
        confidence,
        entropy if return_entropy else confidence,
        V,
        logits.stride(0),
        logits.stride(1),
        float(logit_scale),
        float(noise_scale),
        int(seed),
        int(step),
        int(stream),
        int(mask_id),
        ACC=accumulator_dtype(logits.dtype),
        SCORE=score.value,
        NOISE=noise.value,
        EXCLUDE_MASK=mask_id >= 0,
        RETURN_ENTROPY=return_entropy,
        BF16_PAIRS=logits.dtype == torch.bfloat16 and logits.stride(1) == 1 and block_v >= 2,
        PROLOGUE=logits.stride(1) == 1 and not _on_16_bytes(logits),
        BLOCK_V=block_v,
        VEC=min(_vector(logits.dtype), block_v),
        num_warps=num_warps(block_v),
        maxnreg=_register_cap(logits),
    )
    return tokens, confidence, entropy


def cuda_launch_cases():
    """Launcher calls reaching every configuration this launcher chooses on a GPU: each logits
    dtype, rows starting on 16 bytes or not, or strided, sampling (at T < 1 and T > 1) or argmax, with or
    without a mask id and the entropy (see
    ``daca_kernels.tools.ahead_of_time``)."""
    row_ids = torch.arange(3)
    for dtype, vocab in product(FLOAT_DTYPES, gpu_row_lengths()):
        # Rows starting on 16 bytes, rows that do not (a prologue, then vectors) and strided rows
        # (loads per token, ptxas capped).
        rows = [torch.empty(3, vocab, dtype=dtype), torch.empty(3, vocab + 1, dtype=dtype)[:, 1:],
                torch.empty(3, 2 * vocab, dtype=dtype)[:, ::2]]
        scales = ((1.0, 0.0), (1.0, 0.8), (0.8, 1.0))  # argmax, then T < 1 and T > 1
        for logits, scales, mask_id, return_entropy in product(rows, scales, (-1, 7), (False, True)):
            yield partial(sample_step_forward, logits, row_ids, *scales, 1, 2, 3, mask_id, return_entropy)
