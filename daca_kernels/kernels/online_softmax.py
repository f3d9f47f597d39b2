"""Lane-wise online softmax statistics over a row read in blocks, shared by the row-pass kernels.

Each of the ``BLOCK`` lanes keeps a running maximum ``m``, the sum ``s`` of ``exp(x - m)`` and, for
the entropy, ``w = sum exp(x - m) * (x - m)``; lanes are combined once at the end of the row. A
block is ``[BLOCK]`` (one element per lane) or ``[BLOCK, VEC]`` (a vector per lane: its maximum
and sums are taken within the lane, so the running maximum is updated once per vector).

The row's log-sum-exp is returned split as ``(row_max, log_total)`` with
``log_total = log sum exp(x - row_max)``, and log-probabilities are formed as
``(x - row_max) - log_total``: both terms are small near the row maximum, so a probability near 1
keeps full precision (``x - lse`` with ``lse`` rounded to float32 would lose a few units of
``|lse|``). ``w`` is kept relative to the lane maximum for the same reason: the entropy is
``log_total - E[x - row_max]``, a difference of small terms.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf in the running maxima, so that exp(m - new_m) stays defined for lanes
# that have seen only -inf. A constexpr: a @triton.jit function may read a module global only when
# it is one (the GPU compiler rejects plain Python globals).
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_ftz(x):
    """``e ** x``, float32 results below ``2 ** -126`` flushed to zero (float64: ``tl.exp``).

    ``tl.exp`` on float32 compiles to ``ex2.approx.f32`` of ``x * log2(e)``, which ptxas wraps in
    three range fix-up instructions to produce subnormal results; ``tl.exp2`` is the flush-to-zero
    ``ex2.approx.ftz.f32``, a single MUFU instruction. Same product, same MUFU: the results are the
    same bits except for the subnormal ones, which no softmax statistic or gradient here can tell
    from zero. ``x`` stays the exact difference the callers form (the scaling by log2(e) is
    applied to it, not to the logits), so a probability near 1 keeps full precision.
    """
    if x.dtype == tl.float64:
        return tl.exp(x)
    else:
        return tl.exp2(x * LOG2E)


@triton.jit
def online_lse_start(BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Empty lane states ``(m, s, w)`` of ``BLOCK`` lanes in the accumulation dtype ``ACC``."""
    return tl.full([BLOCK], NEG_BIG, ACC), tl.zeros([BLOCK], ACC), tl.zeros([BLOCK], ACC)


@triton.jit
def _lane_max(x):
    if len(x.shape) == 2:
        return tl.max(x, axis=1)
    else:
        return x


@triton.jit
def _lane_sum(x):
    if len(x.shape) == 2:
        return tl.sum(x, axis=1)
    else:
        return x


@triton.jit
def _per_element(lane_value, x):
    if len(x.shape) == 2:
        return lane_value[:, None]
    else:
        return lane_value


@triton.jit
def online_lse_update(m, s, w, x, WITH_ENTROPY: tl.constexpr):
    """Folds one block ``x`` (``[BLOCK]`` or ``[BLOCK, VEC]``) into the lane states; returns
    ``(m, s, w)``."""
    new_m = tl.maximum(m, _lane_max(x))
    rescale = exp_ftz(m - new_m)
    d = x - _per_element(new_m, x)
    e = exp_ftz(d)
    if WITH_ENTROPY:
        # sum e^(x - new_m) (x - new_m) = rescale * (w + (m - new_m) * s) over the lane's past.
        w = rescale * (w + (m - new_m) * s) + _lane_sum(e * tl.where(e > 0, d, 0.0))
    s = s * rescale + _lane_sum(e)
    return new_m, s, w


@triton.jit
def online_lse_finish(m, s, w, WITH_ENTROPY: tl.constexpr):
    """Combines the lanes: ``(row_max, log_total, entropy)`` of the row, the log-sum-exp being
    ``row_max + log_total``; without ``WITH_ENTROPY`` the entropy is not computed (the third value
    is ``log_total`` again)."""
    row_max = tl.max(m, axis=0)
    lane_scale = exp_ftz(m - row_max)
    total = tl.sum(s * lane_scale, axis=0)
    log_total = tl.log(total)
    entropy = log_total
    if WITH_ENTROPY:
        mean_shift = tl.sum(lane_scale * (w + (m - row_max) * s), axis=0) / total
        entropy = log_total - mean_shift
    return row_max, log_total, entropy
