"""Lane-wise online log-sum-exp over a row read in blocks, shared by the row-pass kernels.

Each of the ``BLOCK`` lanes keeps a running maximum ``m``, the sum ``s`` of ``exp(x - m)`` and, for
the entropy, ``w = sum exp(x - m) * x``; lanes are combined once at the end of the row. ``m`` starts
at a finite stand-in for -inf so that ``exp(m - new_m)`` stays defined for all--inf lanes.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf in the running maxima. A constexpr: a @triton.jit function may read a
# module global only when it is one (the GPU compiler rejects plain Python globals).
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
    s = s * rescale + e
    if WITH_ENTROPY:
        w = w * rescale + e * tl.where(e > 0, x, 0.0)
    return new_m, s, w


@triton.jit
def online_lse_finish(m, s, w, WITH_ENTROPY: tl.constexpr):
    """Combines the lanes: ``(log-sum-exp, entropy)`` of the row; without ``WITH_ENTROPY`` the
    entropy is not computed and the second value is the log-sum-exp again."""
    row_max = tl.max(m, axis=0)
    lane_scale = tl.exp(m - row_max)
    total = tl.sum(s * lane_scale, axis=0)
    lse = row_max + tl.log(total)
    entropy = lse
    if WITH_ENTROPY:
        entropy = lse - tl.sum(w * lane_scale, axis=0) / total
    return lse, entropy
