"""The Gumbel-max candidate score of the sampler kernel: exact, or fast on an NVIDIA GPU.

A token's noise is ``g = -log(-log(u))`` with ``u = uniform_from_hash(keyed_hash(row_key,
token))`` (``daca_kernels.hashing``), and its score ``x * logit_scale + g * noise_scale``, one of the
scales being 1 (``daca_kernels.ops.sample_step.score_scales``); a constant factor or offset
common to a row's scores does not change their argmax.

- Exact (the interpreter, float64 logits, builds other than CUDA): ``g`` in float32 with natural
  logarithms, as the PyTorch path computes it (under the interpreter: the same bits).
- Fast (CUDA, 16- and 32-bit logits): the noise in base 2, ``-log2(t)`` with ``t = -log2(u)``, from
  two hardware ``lg2.approx.ftz.f32`` (one MUFU instruction each, against about 25 instructions for
  an accurate ``logf``). Its absolute error is ``2**-22`` for inputs in ``[1/2, 2]`` and 2 units in
  the last place elsewhere (NVIDIA's bound for ``__log2f``); near ``u = 1`` an absolute error is a
  large relative error of the small ``t``, so for ``v = 1 - u < 1/16`` (exact in float32) ``t`` is
  ``v * P(v)`` instead, ``P`` a quadratic fitted to ``-log2(1 - v) / v`` (relative error below
  ``2.3e-6`` in float32). The score is ``x + (-log2 t) * noise_scale * ln 2`` or
  ``x * logit_scale * log2(e) + (-log2 t)`` (the launcher scales the scale that is not 1), one
  fused multiply-add. Against the exact ``g``, in nats times the noise scale: within ``3e-6`` with
  exact logarithms (the quadratic's error and float32 rounding), and within ``5.5e-6`` with the
  hardware's error added to both (``2**-22`` over the smallest ``t`` of the hardware branch,
  ``0.093``, for the inner one; 2 units in the last place of ``log2 t``, up to 23 for the rarest
  draws, for the outer): a few units in the last place of a float32 score, so GPU candidates
  differ from the PyTorch path's only where two scores are that close.
  ``tests/kernels/test_gumbel_noise.py`` checks both figures over every one of the 2**23 uniforms
  (the formula run under the interpreter, ``tl.log2`` standing in for the hardware).
"""
from __future__ import annotations

import triton
import triton.language as tl

from daca_kernels.kernels.hashing import keyed_finish, uniform_from_hash

# -log2(1 - v) / v on [0, 1/16] (a least-squares fit of the relative error, reweighted towards
# its maximum): P0 + P1 v + P2 v**2.
P0 = tl.constexpr(1.4426981210708618)
P1 = tl.constexpr(0.7204898595809937)
P2 = tl.constexpr(0.5167803168296814)
SERIES_LIMIT = tl.constexpr(0.0625)

# The kernels' SCORE constexpr: the plain argmax of x, x + noise * noise_scale, x * logit_scale + noise.
ARGMAX = tl.constexpr(0)
NOISE_SCALED = tl.constexpr(1)
LOGITS_SCALED = tl.constexpr(2)
# The kernels' NOISE constexpr: which formula computes the noise.
EXACT = tl.constexpr(0)
FAST = tl.constexpr(1)
FAST_HARDWARE = tl.constexpr(2)


@triton.jit
def neg_log2(x, HARDWARE: tl.constexpr):
    """``-log2(x)`` of float32 ``x > 0``: ``lg2.approx.ftz.f32`` when ``HARDWARE`` (CUDA), else
    ``tl.log2``. The negation sits inside the assembly so that ptxas folds it into the consumer."""
    if HARDWARE:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 r; lg2.approx.ftz.f32 r, $1; neg.f32 $0, r; }", "=f,f", [x],
            dtype=tl.float32, is_pure=True, pack=1,
        )
    else:
        return -tl.log2(x)


@triton.jit
def fast_noise(u, HARDWARE: tl.constexpr):
    """``-log2(-log2(u))`` of float32 uniforms ``u`` in (0, 1): ``(g + log(log 2)) / log 2`` for
    the Gumbel noise ``g`` of ``u``."""
    v = 1.0 - u
    series = v * (P0 + v * (P1 + v * P2))
    return neg_log2(tl.where(v < SERIES_LIMIT, series, neg_log2(u, HARDWARE)), HARDWARE)


@triton.jit
def candidate_scores(x, h, logit_scale, noise_scale, UNIT_LOGIT: tl.constexpr, NOISE: tl.constexpr):
    """Scores of logits ``x`` whose tokens have the hash words ``h`` (uint32, ``(token * WEYL +
    row_key) * KEYED_F1``, see ``keyed_finish``). ``UNIT_LOGIT``: ``logit_scale`` is 1 and the score is
    ``x + noise * noise_scale``, else ``noise_scale`` is 1 and it is ``x * logit_scale + noise``.
    ``NOISE``: ``EXACT``, or the base-2 noise (the caller has scaled ``noise_scale`` by ln 2 or
    ``logit_scale`` by log2(e)) with ``tl.log2`` (``FAST``) or the GPU's MUFU (``FAST_HARDWARE``)."""
    u = uniform_from_hash(keyed_finish(h))
    if NOISE != EXACT:
        noise = fast_noise(u, NOISE == FAST_HARDWARE)
    else:
        noise = -tl.log(-tl.log(u))
    if UNIT_LOGIT:
        return x + noise.to(x.dtype) * noise_scale
    else:
        return x * logit_scale + noise.to(x.dtype)
