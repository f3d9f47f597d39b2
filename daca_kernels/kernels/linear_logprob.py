"""Triton kernel for the ``d logits`` of a vocabulary chunk of an LM head, in one GEMM.

``linear_logprob``'s backward needs, per vocabulary chunk, the logits ``hidden @ weight.T + bias``
only to turn them into ``d logits`` (softmax minus one-hot, from the forward's statistics). One
program computes a ``[BLOCK_N, BLOCK_V]`` tile of the logits in registers (half-precision
operands, float32 accumulation, as the GEMM it replaces) and writes the tile's ``d logits``
directly, in the dtype the gradient GEMMs read: the float32 logits are never written to memory nor
read back. The gradient is ``logprob.softmax_grad``'s, the one the row kernel writes, plus the
one-hot term of each row's target.

Tiles are ordered in groups of ``GROUP_N`` row blocks, so that the programs running together share
head rows and hidden rows in the L2 cache. Launchers do no validation: callers
(``daca_kernels.ops``) check shapes and index ranges.
"""
from __future__ import annotations

from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl

from daca_kernels.kernels.launch import INTERPRETED
from daca_kernels.kernels.logprob import flat_index, softmax_grad

# The head dtypes the kernel reads (tensor-core operands); float32 and float64 heads take the
# logits GEMM and the row kernel.
HEAD_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_N, BLOCK_V, BLOCK_H, GROUP_N = 128, 128, 64, 8
NUM_WARPS, NUM_STAGES = 8, 3
# The interpreter's dot multiplies bfloat16 operands wrongly (triton 3.7), so there they are
# upcast first: the products of half-precision values are exact in float32, the same numbers.
UPCAST_DOT = tl.constexpr(INTERPRETED)


@triton.jit
def _head_dlogits_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    targets_ptr,
    grad_out_ptr,
    grad_entropy_ptr,
    stats_ptr,
    entropy_ptr,
    dlogits_ptr,
    N,
    V,
    H,
    stride_hidden_n,
    stride_hidden_h,
    stride_weight_v,
    stride_weight_h,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_n, blocks_v = tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V)
    per_group = GROUP_N * blocks_v
    first_n = (pid // per_group) * GROUP_N
    group_n = min(blocks_n - first_n, GROUP_N)
    block_n = first_n + (pid % per_group) % group_n
    block_v = (pid % per_group) // group_n

    rows = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = block_v * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    in_rows, in_cols = rows < N, cols < V
    # Rows and columns past the edge read row N - 1 / V - 1 again (no masks in the inner loop);
    # their results are never stored.
    a_ptrs = hidden_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_hidden_n + ks[None, :] * stride_hidden_h
    b_ptrs = weight_ptr + tl.minimum(cols, V - 1).to(tl.int64)[None, :] * stride_weight_v + ks[:, None] * stride_weight_h
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k in range(0, H, BLOCK_H):
        a = tl.load(a_ptrs, mask=ks[None, :] < H - k, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < H - k, other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_H * stride_hidden_h
        b_ptrs += BLOCK_H * stride_weight_h
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]

    row_max = tl.load(stats_ptr + 2 * rows, mask=in_rows, other=0.0)[:, None]
    log_total = tl.load(stats_ptr + 2 * rows + 1, mask=in_rows, other=0.0)[:, None]
    g = tl.load(grad_out_ptr + rows, mask=in_rows, other=0.0)[:, None]
    entropy = 0.0
    ge = 0.0
    if ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + rows, mask=in_rows, other=0.0)[:, None]
        ge = tl.load(grad_entropy_ptr + rows, mask=in_rows, other=0.0)[:, None]
    d = softmax_grad(acc, row_max, log_total, g, entropy, ge, inv_temperature, ENTROPY_GRAD)
    # Compared as int32 (one instruction per element, not three): ids outside the slice become -1.
    target = tl.load(targets_ptr + rows, mask=in_rows, other=-1)
    target = tl.where((target >= 0) & (target < V), target, -1).to(tl.int32)[:, None]
    d += tl.where(cols[None, :] == target, g, 0.0)
    d = d * inv_temperature
    out = dlogits_ptr + rows.to(tl.int64)[:, None] * V + cols[None, :]
    tl.store(out, d.to(dlogits_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


def head_dlogits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    grad_out: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    inv_temperature: float,
    dlogits: torch.Tensor,
) -> None:
    """Write into ``dlogits`` (contiguous ``[N, V]``, any float dtype) the ``d logits`` of the
    logits ``hidden @ weight.T + bias`` scaled by ``inv_temperature``, as
    ``logprob.logprob_backward`` writes them from those logits in float32.

    hidden ``[N, H]`` and weight ``[V, H]`` (e.g. a slice of a wider head; any strides), both of
    one dtype of ``HEAD_DTYPES``; bias ``[V]`` or None; targets integer
    ``[N]`` relative to this slice (an id outside ``[0, V)`` adds no one-hot term); grad_out,
    grad_entropy (or None) and entropy ``[N]`` and stats ``[N, 2]``: float32, for the whole head.
    """
    n, vocab = dlogits.shape
    if n == 0:
        return
    entropy_grad = grad_entropy is not None
    grid = (triton.cdiv(n, BLOCK_N) * triton.cdiv(vocab, BLOCK_V),)
    _head_dlogits_kernel[grid](
        hidden,
        weight,
        weight if bias is None else bias,
        flat_index(targets),
        grad_out,
        grad_entropy if entropy_grad else grad_out,
        stats,
        entropy if entropy_grad else grad_out,
        dlogits,
        n,
        vocab,
        hidden.shape[1],
        *hidden.stride(),
        *weight.stride(),
        float(inv_temperature),
        HAS_BIAS=bias is not None,
        ENTROPY_GRAD=entropy_grad,
        BLOCK_N=BLOCK_N,
        BLOCK_V=BLOCK_V,
        BLOCK_H=BLOCK_H,
        GROUP_N=GROUP_N,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def cuda_launch_cases():
    """Launcher calls reaching every configuration on a GPU: each head dtype, with and without bias
    and entropy gradient, ``d logits`` in the head's dtype and (for the bias gradient) float32."""
    n, hidden_size, vocab = 3, 64, 256
    per_row, stats, targets = torch.empty(n), torch.empty(n, 2), torch.zeros(n, dtype=torch.int64)
    for dtype, with_bias, entropy_grad in product(HEAD_DTYPES, (False, True), (False, True)):
        hidden, weight = torch.empty(n, hidden_size, dtype=dtype), torch.empty(vocab, hidden_size, dtype=dtype)
        bias = torch.empty(vocab, dtype=dtype) if with_bias else None
        out_dtype = torch.float32 if with_bias else dtype
        yield partial(head_dlogits, hidden, weight, bias, targets, per_row, per_row if entropy_grad else None,
                      stats, per_row, 1.0, torch.empty(n, vocab, dtype=out_dtype))
