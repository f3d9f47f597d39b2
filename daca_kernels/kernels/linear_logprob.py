"""Triton kernels for ``linear_logprob``'s vocabulary chunks: a chunk's logits computed and consumed
in one pass, never written to memory.

Both kernels compute a ``[BLOCK_N, BLOCK_V]`` tile of the logits ``hidden @ weight.T + bias`` per
program, in registers (half-precision operands on tensor cores, float32 accumulation, as the GEMM
they replace), then finish the tile in the same program:

- forward (``head_stats``): the softmax statistics of each row of the tile, as the row kernel
  ``logprob._logprob_fwd_kernel`` returns them for a whole row (maximum, log-sum-exp above it,
  entropy, the target's log-prob); ``merge_chunk`` then folds a chunk's blocks into each row's
  running statistics, one launch per chunk;
- backward (``head_dlogits``): the tile's ``d logits`` from the forward's statistics, written in
  the dtype the gradient GEMMs read: ``logprob.softmax_grad``, the row kernel's gradient, plus the
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
from daca_kernels.kernels.online_softmax import exp_ftz

# The head dtypes the kernels read (tensor-core operands); float32 and float64 heads take the
# logits GEMM and the row kernels.
HEAD_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_N, BLOCK_V, BLOCK_H, GROUP_N = 128, 128, 64, 8
NUM_WARPS, NUM_STAGES = 8, 3
# The interpreter's dot multiplies bfloat16 operands wrongly (triton 3.7), so there they are
# upcast first: the products of half-precision values are exact in float32, the same numbers.
UPCAST_DOT = tl.constexpr(INTERPRETED)


@triton.jit
def _logits_tile(hidden_ptr, weight_ptr, bias_ptr, N, V, H, stride_hidden_n, stride_hidden_h, stride_weight_v,
                 stride_weight_h, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_H: tl.constexpr, GROUP_N: tl.constexpr):
    """This program's tile of ``hidden @ weight.T + bias``: ``(logits [BLOCK_N, BLOCK_V] float32,
    rows [BLOCK_N], cols [BLOCK_V], the tile's column block)``; rows and columns may run past
    ``N`` and ``V`` (their logits are garbage, never to be stored)."""
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
    # Rows and columns past the edge read row N - 1 / V - 1 again (no masks in the inner loop).
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
        acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
    return acc, rows, cols, block_v


@triton.jit
def _local_targets(targets_ptr, rows, in_rows, V, target_offset):
    """``[BLOCK_N, 1]`` int32 target ids of ``rows`` less ``target_offset`` (the slice's first head
    row; -1 outside ``[0, V)`` and past the rows): compared as int32, one instruction per element,
    not three."""
    target = tl.load(targets_ptr + rows, mask=in_rows, other=-1) - target_offset
    return tl.where((target >= 0) & (target < V), target, -1).to(tl.int32)[:, None]


@triton.jit(do_not_specialize=["target_offset"])
def _head_stats_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    targets_ptr,
    parts_ptr,
    N,
    V,
    H,
    stride_hidden_n,
    stride_hidden_h,
    stride_weight_v,
    stride_weight_h,
    inv_temperature,
    target_offset,
    HAS_BIAS: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    acc, rows, cols, block_v = _logits_tile(hidden_ptr, weight_ptr, bias_ptr, N, V, H, stride_hidden_n,
                                            stride_hidden_h, stride_weight_v, stride_weight_h, HAS_BIAS, BLOCK_N,
                                            BLOCK_V, BLOCK_H, GROUP_N)
    in_rows = rows < N
    x = tl.where((cols < V)[None, :], acc * inv_temperature, float("-inf"))
    tile_max = tl.max(x, axis=1)
    centred = x - tile_max[:, None]
    e = exp_ftz(centred)
    total = tl.sum(e, axis=1)
    log_total = tl.log(total)
    target = _local_targets(targets_ptr, rows, in_rows, V, target_offset)
    # The target's scaled logit minus the tile maximum (0 in the tiles that do not hold it).
    target_centred = tl.sum(tl.where(cols[None, :] == target, centred, 0.0), axis=1)
    # parts is [3 or 4, blocks, N]: one [blocks, N] plane per statistic.
    plane = tl.cdiv(V, BLOCK_V).to(tl.int64) * N
    part = parts_ptr + block_v.to(tl.int64) * N + rows
    tl.store(part, target_centred - log_total, mask=in_rows)
    tl.store(part + plane, tile_max, mask=in_rows)
    tl.store(part + 2 * plane, log_total, mask=in_rows)
    if RETURN_ENTROPY:
        mean_centred = tl.sum(e * tl.where(e > 0, centred, 0.0), axis=1) / total
        tl.store(part + 3 * plane, log_total - mean_centred, mask=in_rows)


@triton.jit(do_not_specialize=["target_offset"])
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
    target_offset,
    HAS_BIAS: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    acc, rows, cols, _ = _logits_tile(hidden_ptr, weight_ptr, bias_ptr, N, V, H, stride_hidden_n, stride_hidden_h,
                                      stride_weight_v, stride_weight_h, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, GROUP_N)
    in_rows, in_cols = rows < N, cols < V
    row_max = tl.load(stats_ptr + 2 * rows, mask=in_rows, other=0.0)[:, None]
    log_total = tl.load(stats_ptr + 2 * rows + 1, mask=in_rows, other=0.0)[:, None]
    g = tl.load(grad_out_ptr + rows, mask=in_rows, other=0.0)[:, None]
    entropy = 0.0
    ge = 0.0
    if ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + rows, mask=in_rows, other=0.0)[:, None]
        ge = tl.load(grad_entropy_ptr + rows, mask=in_rows, other=0.0)[:, None]
    d = softmax_grad(acc, row_max, log_total, g, entropy, ge, inv_temperature, ENTROPY_GRAD)
    d += tl.where(cols[None, :] == _local_targets(targets_ptr, rows, in_rows, V, target_offset), g, 0.0)
    d = d * inv_temperature
    out = dlogits_ptr + rows.to(tl.int64)[:, None] * V + cols[None, :]
    tl.store(out, d.to(dlogits_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


# The per-row state ``merge_chunk`` carries across a call's chunks: the running maximum M, the sum
# Z of exp(x - M) over the columns seen, A = sum exp(x - M) * (x - M) (for the entropy), and the
# target's logit as its block's statistics left it: centred on its block's maximum, and that maximum.
STATE = ("max", "sum", "entropy_sum", "target_centred", "target_max")
MERGE_ROWS = 1024


@triton.jit(do_not_specialize=["lo", "first"])
def _merge_chunk_kernel(parts_ptr, targets_ptr, state_ptr, out_ptr, stats_ptr, entropy_ptr, N, V, lo, first,
                        RETURN_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < N
    old_max = tl.load(state_ptr + rows, mask=in_rows, other=0.0)
    old_sum = tl.load(state_ptr + N + rows, mask=in_rows, other=0.0)
    old_a = tl.load(state_ptr + 2 * N + rows, mask=in_rows, other=0.0)
    target_centred = tl.load(state_ptr + 3 * N + rows, mask=in_rows, other=0.0)
    target_max = tl.load(state_ptr + 4 * N + rows, mask=in_rows, other=0.0)
    is_first = first != 0
    # Before the first chunk: no column seen (the sums are 0 whatever the maximum), no target.
    m = tl.where(is_first, float("-inf"), old_max)
    z = tl.where(is_first, 0.0, old_sum)
    a = tl.where(is_first, 0.0, old_a)
    target_centred = tl.where(is_first, float("nan"), target_centred)
    target_max = tl.where(is_first, float("nan"), target_max)
    blocks = tl.cdiv(V, BLOCK_V)
    plane = blocks.to(tl.int64) * N
    for b in range(0, blocks):
        part = parts_ptr + b * N + rows
        block_max = tl.load(part + plane, mask=in_rows, other=0.0)
        block_log = tl.load(part + 2 * plane, mask=in_rows, other=0.0)
        new_m = tl.maximum(m, block_max)
        shift = tl.where(z > 0, m - new_m, 0.0)  # before the first block m is -inf and z is 0
        rescale = tl.exp(shift)
        weight = tl.exp(block_max - new_m + block_log)
        if RETURN_ENTROPY:
            block_entropy = tl.load(part + 3 * plane, mask=in_rows, other=0.0)
            a = rescale * (a + shift * z) + weight * (block_log - block_entropy + (block_max - new_m))
        z = z * rescale + weight
        m = new_m
    # The target's block, where this chunk holds it: its log-prob within the block plus the block's
    # log-sum-exp is its logit centred on the block's maximum.
    target = tl.load(targets_ptr + rows, mask=in_rows, other=-1) - lo
    holds = in_rows & (target >= 0) & (target < V)
    part = parts_ptr + (target // BLOCK_V) * N + rows
    within = tl.load(part, mask=holds, other=0.0) + tl.load(part + 2 * plane, mask=holds, other=0.0)
    target_centred = tl.where(holds, within, target_centred)
    target_max = tl.where(holds, tl.load(part + plane, mask=holds, other=0.0), target_max)
    tl.store(state_ptr + rows, m, mask=in_rows)
    tl.store(state_ptr + N + rows, z, mask=in_rows)
    tl.store(state_ptr + 2 * N + rows, a, mask=in_rows)
    tl.store(state_ptr + 3 * N + rows, target_centred, mask=in_rows)
    tl.store(state_ptr + 4 * N + rows, target_max, mask=in_rows)
    log_total = tl.log(z)
    tl.store(out_ptr + rows, (target_centred + (target_max - m)) - log_total, mask=in_rows)
    tl.store(stats_ptr + 2 * rows, m, mask=in_rows)
    tl.store(stats_ptr + 2 * rows + 1, log_total, mask=in_rows)
    if RETURN_ENTROPY:
        tl.store(entropy_ptr + rows, log_total - a / z, mask=in_rows)


def merge_chunk(parts: torch.Tensor, targets: torch.Tensor, lo: int, hi: int, state: torch.Tensor, out: torch.Tensor,
                stats: torch.Tensor, entropy: torch.Tensor, first: bool) -> None:
    """Folds one chunk's block statistics (``parts``, ``[3 or 4, blocks, N]`` as ``head_stats_parts``
    writes them for head rows ``lo:hi``) into the rows' running ``state`` (float32 ``[5, N]``, see ``STATE``;
    ``first``: the call's first chunk, the state is not read) and writes the rows' log-prob ``out``,
    statistics ``stats`` (``[N, 2]``) and ``entropy`` (``[N]``, read when ``parts`` has four planes)
    as of the columns merged so far: after the last chunk, the whole head's. targets: int64 ``[N]``,
    ids in the whole head. One launch per chunk, in place of the merges of ``[blocks, N]``
    statistics by separate operations."""
    n = parts.shape[2]
    if n == 0:
        return
    _merge_chunk_kernel[(triton.cdiv(n, MERGE_ROWS),)](
        parts, targets, state, out, stats, entropy if parts.shape[0] == 4 else out, n, hi - lo, int(lo), int(first),
        RETURN_ENTROPY=parts.shape[0] == 4, BLOCK_V=BLOCK_V, BLOCK_R=MERGE_ROWS, num_warps=4)


def _launch(kernel, hidden, weight, bias, targets, target_offset, tensors, n, vocab, inv_temperature,
            **flags) -> None:
    """``kernel`` over the ``[n, vocab]`` tiles of ``hidden @ weight.T``; ``tensors``: its arguments
    between the targets and the sizes."""
    grid = (triton.cdiv(n, BLOCK_N) * triton.cdiv(vocab, BLOCK_V),)
    kernel[grid](hidden, weight, weight if bias is None else bias, flat_index(targets), *tensors, n, vocab,
                 hidden.shape[1], *hidden.stride(), *weight.stride(), float(inv_temperature), int(target_offset),
                 HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, GROUP_N=GROUP_N,
                 num_warps=NUM_WARPS, num_stages=NUM_STAGES, **flags)


def head_stats_parts(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: float,
    return_entropy: bool,
    target_offset: int = 0,
) -> torch.Tensor:
    """``head_stats`` as the one float32 ``[3 or 4, T, N]`` tensor the kernel writes (the planes:
    the target's log-prob within the block, the maximum, the log-sum-exp above it, the entropy)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    parts = torch.empty(4 if return_entropy else 3, triton.cdiv(vocab, BLOCK_V), n, dtype=torch.float32,
                        device=hidden.device)
    if n:
        _launch(_head_stats_kernel, hidden, weight, bias, targets, target_offset, (parts,), n, vocab,
                inv_temperature, RETURN_ENTROPY=return_entropy)
    return parts


def head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: float,
    return_entropy: bool,
    target_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax statistics of every block of ``BLOCK_V`` columns of the logits
    ``(hidden @ weight.T + bias) * inv_temperature``, as ``logprob.logprob_forward`` returns them
    for one row, without writing the logits.

    hidden ``[N, H]``, weight ``[V, H]`` (any strides) of one dtype of ``HEAD_DTYPES``, bias ``[V]``
    or None, targets integer ``[N]``: ids relative to this ``weight`` once ``target_offset`` (the
    head row a slice ``weight`` starts at, so that the ids of the whole head need no subtraction
    launched per slice) is subtracted. Returns four float32
    ``[T, N]`` tensors, ``T = ceil(V / BLOCK_V)``, for block t and row n: the log-prob of the
    target within the block (meaningful in the block that holds it), the block's maximum ``m``,
    ``log sum exp(x - m)`` over the block and the block's entropy (``[0, N]`` without
    ``return_entropy``).
    """
    n = hidden.shape[0]
    parts = head_stats_parts(hidden, weight, bias, targets, inv_temperature, return_entropy, target_offset)
    outs, maxima, logs, *entropies = parts.unbind(0)
    return outs, maxima, logs, entropies[0] if return_entropy else parts.new_empty(0, n)


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
    target_offset: int = 0,
) -> None:
    """Write into ``dlogits`` (contiguous ``[N, V]``, any float dtype) the ``d logits`` of the
    logits ``hidden @ weight.T + bias`` scaled by ``inv_temperature``, as
    ``logprob.logprob_backward`` writes them from those logits in float32.

    hidden ``[N, H]`` and weight ``[V, H]`` (e.g. a slice of a wider head; any strides), both of
    one dtype of ``HEAD_DTYPES``; bias ``[V]`` or None; targets integer ``[N]``, relative to this
    slice once ``target_offset`` (the head row the slice starts at) is subtracted (an id outside
    ``[0, V)`` then adds no one-hot term); grad_out,
    grad_entropy (or None) and entropy ``[N]`` and stats ``[N, 2]``: float32, for the whole head.
    """
    n, vocab = dlogits.shape
    if n == 0:
        return
    entropy_grad = grad_entropy is not None
    tensors = (grad_out, grad_entropy if entropy_grad else grad_out, stats, entropy if entropy_grad else grad_out,
               dlogits)
    _launch(_head_dlogits_kernel, hidden, weight, bias, targets, target_offset, tensors, n, vocab, inv_temperature,
            ENTROPY_GRAD=entropy_grad)


def cuda_launch_cases():
    """Launcher calls reaching every configuration on a GPU: each head dtype, with and without bias
    and entropy (its gradient), ``d logits`` in the head's dtype and (for the bias gradient) float32."""
    n, hidden_size, vocab = 3, 64, 256
    per_row, stats, targets = torch.empty(n), torch.empty(n, 2), torch.zeros(n, dtype=torch.int64)
    for dtype, with_bias, entropy_grad in product(HEAD_DTYPES, (False, True), (False, True)):
        hidden, weight = torch.empty(n, hidden_size, dtype=dtype), torch.empty(vocab, hidden_size, dtype=dtype)
        bias = torch.empty(vocab, dtype=dtype) if with_bias else None
        out_dtype = torch.float32 if with_bias else dtype
        yield partial(head_dlogits, hidden, weight, bias, targets, per_row, per_row if entropy_grad else None,
                      stats, per_row, 1.0, torch.empty(n, vocab, dtype=out_dtype))
        yield partial(head_stats, hidden, weight, bias, targets, 1.0, entropy_grad)  # the flag: return_entropy
    for return_entropy in (False, True):
        parts = torch.empty(4 if return_entropy else 3, 2, n)
        yield partial(merge_chunk, parts, targets, 128, 384, torch.empty(len(STATE), n), per_row, stats, per_row, True)
