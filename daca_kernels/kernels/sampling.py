"""Triton kernel for one denoising step: Gumbel-max candidate and its noise-free confidence.

One program per row makes one pass over the row's logits ``x``, keeping lane-wise running states:
- the maximum of the candidate score ``x * logit_scale + g * noise_scale`` (``x`` alone for
  argmax; the scales are ``(1/T, 1)`` or ``(1, T)``, see ``daca_kernels.ops.sample_step``) and the
  lowest token id reaching it, where ``g = -log(-log(u))`` and ``u`` comes from the counter hash
  ``hash4(seed, stream, step, row_id, token)``, so the noise is never stored;
- the online softmax statistics of the raw ``x`` (``online_softmax``; and the entropy's sum).
The confidence is ``exp((x[candidate] - row_max) - log_total)``: the softmax probability of the
candidate without temperature or noise. The mask id's logit counts as ``-inf`` in both the
candidate and the softmax. Launchers do no validation: callers (``daca_kernels.ops``) check everything.
"""
from __future__ import annotations

from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl

from daca_kernels.kernels.hashing import hash4, uniform_from_hash
from daca_kernels.kernels.launch import (
    FLOAT_DTYPES,
    accumulation_dtype,
    accumulator_dtype,
    gpu_row_lengths,
    num_warps,
    row_block,
)
from daca_kernels.kernels.online_softmax import online_lse_finish, online_lse_start, online_lse_update


def _gpu_block(dtype: torch.dtype) -> int:
    """Vocabulary elements per loop step on a GPU: the running candidate and its id take registers
    beside the log-sum-exp state, so half the log-prob forward's block (float64: half again)."""
    return 1024 if dtype == torch.float64 else 2048


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
    SAMPLE: tl.constexpr,
    EXCLUDE_MASK: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + pid * stride_n
    if SAMPLE:
        row_id = tl.load(row_ids_ptr + pid)

    best = tl.full([BLOCK_V], float("-inf"), ACC)
    best_id = tl.zeros([BLOCK_V], tl.int32)
    m, s, w = online_lse_start(BLOCK_V, ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < V, other=float("-inf")).to(ACC)
        if EXCLUDE_MASK:
            x = tl.where(offs == mask_id, float("-inf"), x)
        if SAMPLE:
            u = uniform_from_hash(hash4(seed, stream, step, row_id, offs))
            score = x * logit_scale - tl.log(-tl.log(u)).to(ACC) * noise_scale
        else:
            score = x
        # Strictly greater: within a lane the earlier (lower) id keeps a tie.
        better = score > best
        best = tl.where(better, score, best)
        best_id = tl.where(better, offs, best_id)

        m, s, w = online_lse_update(m, s, w, x, RETURN_ENTROPY)

    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_id, V), axis=0).to(tl.int64)
    row_max, log_total, entropy = online_lse_finish(m, s, w, RETURN_ENTROPY)
    x_token = tl.load(row_ptr + token * stride_v, mask=token < V, other=float("nan")).to(ACC)
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
):
    """Candidate, confidence and (optionally) entropy of every row of ``logits``.

    logits ``[N, V]`` of any float dtype and strides; row_ids int64 ``[N]`` in ``[0, 2**32)`` (the
    noise identity of each row); ``logit_scale`` and ``noise_scale`` Python floats in ``(0, 1]``
    multiplying the logits and the Gumbel noise of the score, ``noise_scale`` 0 for the plain argmax;
    ``seed`` a 32-bit int, ``step`` and ``stream`` ints in ``[0, 2**32)``; ``mask_id`` the excluded
    id or -1. Returns int64 ``[N]`` and two tensors of the accumulation dtype (float32, or float64
    for float64 logits): ``[N]`` and ``[N]`` (``[0]`` without entropy).
    """
    n, V = logits.shape
    acc = accumulation_dtype(logits.dtype)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    confidence = torch.empty(n, dtype=acc, device=logits.device)
    entropy = torch.empty(n if return_entropy else 0, dtype=acc, device=logits.device)
    if n == 0:
        return tokens, confidence, entropy
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
        SAMPLE=noise_scale > 0,
        EXCLUDE_MASK=mask_id >= 0,
        RETURN_ENTROPY=return_entropy,
        BLOCK_V=block_v,
        num_warps=num_warps(block_v),
    )
    return tokens, confidence, entropy


def cuda_launch_cases():
    """Launcher calls reaching every configuration this launcher chooses on a GPU: each logits
    dtype, sampling or argmax, with or without a mask id and the entropy (see
    ``daca_kernels.kernels.ahead_of_time``)."""
    row_ids = torch.arange(3)
    for dtype, vocab in product(FLOAT_DTYPES, gpu_row_lengths()):
        logits = torch.empty(3, vocab, dtype=dtype)
        for noise_scale, mask_id, return_entropy in product((0.0, 0.8), (-1, 7), (False, True)):
            yield partial(sample_step_forward, logits, row_ids, 1.0, noise_scale, 1, 2, 3, mask_id, return_entropy)
