"""Triton kernel for the Denoising Progress Scores bookkeeping: the per-row confidence delta.

``out[b] = sum_j still_masked[b, j] * (current[b, j] - previous[b, j])``: one program per row sums
over the row in blocks. Entries outside ``still_masked`` are never loaded, so they may hold stale
values (a sampler keeps two dense buffers and swaps them between steps instead of copying).
Launchers do no validation: callers (``daca_kernels.ops``) check shapes and dtypes.
"""
from __future__ import annotations

from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl

from daca_kernels.kernels.launch import FLOAT_DTYPES, accumulation_dtype, accumulator_dtype, gpu_row_lengths, row_block

# Positions of a row per loop step on a GPU (4 warps).
_GPU_BLOCK = 1024


# A small kernel off the hot path: no specialisation on integer values or pointer alignment, so one
# compiled kernel serves every shape and view of a dtype and block.
@triton.jit(
    do_not_specialize=["L", "stride_cb", "stride_cl", "stride_pb", "stride_pl", "stride_mb", "stride_ml"],
    do_not_specialize_on_alignment=["current_ptr", "previous_ptr", "still_masked_ptr", "out_ptr"],
)
def _confidence_delta_kernel(
    current_ptr,
    previous_ptr,
    still_masked_ptr,
    out_ptr,
    L: tl.int32,
    stride_cb: tl.int64,
    stride_cl: tl.int64,
    stride_pb: tl.int64,
    stride_pl: tl.int64,
    stride_mb: tl.int64,
    stride_ml: tl.int64,
    ACC: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    total = tl.zeros([BLOCK_L], ACC)
    for start in range(0, L, BLOCK_L):
        offs = (start + tl.arange(0, BLOCK_L)).to(tl.int64)
        selected = tl.load(still_masked_ptr + pid * stride_mb + offs * stride_ml, mask=offs < L, other=0) != 0
        c = tl.load(current_ptr + pid * stride_cb + offs * stride_cl, mask=selected, other=0.0).to(ACC)
        p = tl.load(previous_ptr + pid * stride_pb + offs * stride_pl, mask=selected, other=0.0).to(ACC)
        total += c - p
    tl.store(out_ptr + pid, tl.sum(total, axis=0))


def confidence_delta(current: torch.Tensor, previous: torch.Tensor, still_masked: torch.Tensor) -> torch.Tensor:
    """Per-row sum of ``current - previous`` over ``still_masked``.

    current, previous: float ``[B, L]`` (any strides, same dtype); still_masked: bool ``[B, L]``.
    Returns ``[B]`` in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    batch, length = current.shape
    acc = accumulation_dtype(current.dtype)
    out = torch.empty(batch, dtype=acc, device=current.device)
    if batch == 0:
        return out
    flags = still_masked.view(torch.uint8)
    block_l = row_block(length, _GPU_BLOCK)
    _confidence_delta_kernel[(batch,)](
        current, previous, flags, out, length,
        current.stride(0), current.stride(1), previous.stride(0), previous.stride(1),
        flags.stride(0), flags.stride(1),
        ACC=accumulator_dtype(current.dtype),
        BLOCK_L=block_l,
    )
    return out


def cuda_launch_cases():
    """Launcher calls reaching every configuration this launcher chooses on a GPU: each dtype (see
    ``daca_kernels.tools.ahead_of_time``)."""
    for dtype, length in product(FLOAT_DTYPES, gpu_row_lengths(1 << 12)):
        current = torch.empty(2, length, dtype=dtype)
        yield partial(confidence_delta, current, torch.empty_like(current), torch.empty(2, length, dtype=torch.bool))
