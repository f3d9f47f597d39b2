"""Lane-wise online softmax statistics over a row read in blocks, shared by the row-pass kernels.

Each of the ``BLOCK`` lanes keeps a running maximum ``m``, the sum ``s`` of ``exp(x - m)`` and, for
the entropy, ``w = sum exp(x - m) * (x - m)``; lanes are combined once at the end of the row.

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


@triton.jit
def online_lse_start(BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Empty lane states ``(m, s, w)`` of ``BLOCK`` lanes in the accumulation dtype ``ACC``."""
    return tl.full([BLOCK], NEG_BIG, ACC), tl.zeros([BLOCK], ACC), tl.zeros([BLOCK], ACC)


@triton.jit
def online_lse_update(m, s, w, x, WITH_ENTROPY: tl.constexpr):
    """Folds one block ``x`` into the lane states; returns ``(m, s, w)``."""
    new_m = tl.maximum(m, x)
    rescale = tl.exp(m - new_m)
    e = tl.exp(x - new_m)
    if WITH_ENTROPY:
        # sum e^(x - new_m) (x - new_m) = rescale * (w + (m - new_m) * s) over the lane's past.
        w = rescale * (w + (m - new_m) * s) + e * tl.where(e > 0, x - new_m, 0.0)
    s = s * rescale + e
    return new_m, s, w


@triton.jit
def online_lse_finish(m, s, w, WITH_ENTROPY: tl.constexpr):
    """Combines the lanes: ``(row_max, log_total, entropy)`` of the row, the log-sum-exp being
    ``row_max + log_total``; without ``WITH_ENTROPY`` the entropy is not computed (the third value
    is ``log_total`` again)."""
    row_max = tl.max(m, axis=0)
    lane_scale = tl.exp(m - row_max)
    total = tl.sum(s * lane_scale, axis=0)
    log_total = tl.log(total)
    entropy = log_total
    if WITH_ENTROPY:
        mean_shift = tl.sum(lane_scale * (w + (m - row_max) * s), axis=0) / total
        entropy = log_total - mean_shift
    return row_max, log_total, entropy
