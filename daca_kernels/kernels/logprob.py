"""Triton kernels for the log-probability of chosen targets under a row-wise softmax.

Forward: one program per target makes one pass over its logits row with a lane-wise online
log-sum-exp (a lane holds vectors of 16 bytes of consecutive logits: one running-maximum update
per vector) and saves only the row's softmax statistics ``(max, log of the sum of exp(x - max))``
(and entropy) in fp32: the log-sum-exp split in two, so that log-probabilities near 0 keep full
precision (see ``online_softmax``). Backward: one program per distinct selected row recomputes the
softmax from the saved statistics and writes ``d logits`` for that row, folding in the upstream
gradients of every target that reads it.

Rows are addressed through int64 row starts computed on the host, so logits of any
leading-dimension strides are read in place and only the selected rows are ever touched. A start
is stored in units of ``row_unit`` elements (the gcd of the leading strides) and multiplied in the
kernel: Triton specialises an integer argument divisible by 16, so with the usual vocabulary sizes
(multiples of 16) the compiler knows every row start is aligned and reads rows with 16-byte vector
loads; a start loaded as a plain element offset carries no alignment and compiles to scalar loads.
Launchers here do no validation: callers (``daca_kernels.ops``) check shapes and index ranges.
"""
from __future__ import annotations

import math
from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl

from daca_kernels.kernels.launch import (
    FLOAT_DTYPES,
    accumulation_dtype,
    accumulator_dtype,
    gpu_row_lengths,
    num_warps,
    row_block,
)
from daca_kernels.kernels.online_softmax import exp_ftz, online_lse_finish, online_lse_start, online_lse_update


def _gpu_block(dtype: torch.dtype, backward: bool) -> int:
    """Vocabulary elements per loop step on a GPU (8 warps). The backward keeps more values live
    per element (it spills at 4096), and float64 doubles the registers of the forward."""
    return 2048 if backward or dtype == torch.float64 else 4096


@triton.jit
def softmax_grad(x, row_max, log_total, g_sum, entropy, ge_sum, inv_temperature, ENTROPY_GRAD: tl.constexpr):
    """``d loss / d x`` before the one-hot terms and the final factor ``inv_temperature``, for logits
    ``x`` (accumulation dtype) of a row with softmax statistics ``(row_max, log_total)``, entropy
    ``entropy`` and upstream gradients ``g_sum`` (of the log-probs of the row's targets) and
    ``ge_sum`` (of its entropy; read only with ``ENTROPY_GRAD``). The statistics and gradients
    broadcast against ``x``: scalars for a row block, ``[BLOCK_N, 1]`` for a tile of rows."""
    logp = (x * inv_temperature - row_max) - log_total
    p = exp_ftz(logp)
    d = p * -g_sum  # the same numbers as -p * g_sum, the negation once per row
    if ENTROPY_GRAD:
        # d H / d x_j = -p_j (log p_j + H)
        d -= ge_sum * p * tl.where(p > 0, logp + entropy, 0.0)
    return d


@triton.jit
def _logprob_fwd_kernel(
    logits_ptr,
    row_starts_ptr,
    row_unit,
    targets_ptr,
    out_ptr,
    stats_ptr,
    entropy_ptr,
    V,
    stride_v,
    inv_temperature,
    ACC: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + tl.load(row_starts_ptr + pid) * row_unit
    target = tl.load(targets_ptr + pid).to(tl.int64)

    # A tile is [BLOCK_V // VEC, VEC]: each lane holds whole vectors of VEC consecutive logits (16
    # bytes), so its running maximum is updated once per vector.
    LANES: tl.constexpr = BLOCK_V // VEC
    cols = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m, s, w = online_lse_start(LANES, ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < V, other=float("-inf"))
        x = x.to(ACC) * inv_temperature
        m, s, w = online_lse_update(m, s, w, x, RETURN_ENTROPY)
    row_max, log_total, entropy = online_lse_finish(m, s, w, RETURN_ENTROPY)

    # A target outside [0, V) is not read: its log-prob and entropy are NaN.
    valid = (target >= 0) & (target < V)
    x_target = tl.load(row_ptr + target * stride_v, mask=valid, other=float("nan")).to(ACC)
    tl.store(out_ptr + pid, (x_target * inv_temperature - row_max) - log_total)
    tl.store(stats_ptr + 2 * pid, row_max)
    tl.store(stats_ptr + 2 * pid + 1, log_total)
    if RETURN_ENTROPY:
        tl.store(entropy_ptr + pid, tl.where(valid, entropy, float("nan")))


@triton.jit
def _logprob_bwd_kernel(
    logits_ptr,
    row_starts_ptr,
    row_unit,
    grad_rows_ptr,
    group_ends_ptr,
    order_ptr,
    targets_ptr,
    grad_out_ptr,
    grad_entropy_ptr,
    stats_ptr,
    entropy_ptr,
    dlogits_ptr,
    V,
    stride_v,
    inv_temperature,
    ACC: tl.constexpr,
    GROUPED: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    length = V
    if GROUPED:
        # One program per target in row order; the first target of each row handles the row's group
        # ``[pid, group_ends[pid])``, the others do nothing (no count of groups on the host).
        lo = pid
        row = tl.load(grad_rows_ptr + pid)
        previous = tl.load(grad_rows_ptr + tl.maximum(pid - 1, 0))
        leads = (pid == 0) | (previous != row)
        hi = tl.where(leads, tl.load(group_ends_ptr + pid).to(tl.int64), lo)
        length = tl.where(leads, V, 0)
        first = tl.load(order_ptr + lo).to(tl.int64)
    else:
        lo = pid
        hi = pid + 1
        first = pid
    row_ptr = logits_ptr + tl.load(row_starts_ptr + first) * row_unit
    dst_ptr = dlogits_ptr + tl.load(grad_rows_ptr + pid) * V
    # Every target of a group reads the same row, so they share its statistics and entropy.
    row_max = tl.load(stats_ptr + 2 * first).to(ACC)
    log_total = tl.load(stats_ptr + 2 * first + 1).to(ACC)
    g_sum = tl.load(grad_out_ptr + first).to(ACC)
    entropy = 0.0
    ge_sum = 0.0
    if ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + first).to(ACC)
        ge_sum = tl.load(grad_entropy_ptr + first).to(ACC)
    if GROUPED:
        for j in range(lo + 1, hi):
            n = tl.load(order_ptr + j).to(tl.int64)
            g_sum += tl.load(grad_out_ptr + n).to(ACC)
            if ENTROPY_GRAD:
                ge_sum += tl.load(grad_entropy_ptr + n).to(ACC)

    for start in range(0, length, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_row = offs < V
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=in_row, other=float("-inf"))
        d = softmax_grad(x.to(ACC), row_max, log_total, g_sum, entropy, ge_sum, inv_temperature, ENTROPY_GRAD)
        for j in range(lo, hi):
            if GROUPED:
                n = tl.load(order_ptr + j).to(tl.int64)
            else:
                n = j
            t = tl.load(targets_ptr + n).to(tl.int64)
            d += tl.where(offs == t, tl.load(grad_out_ptr + n).to(ACC), 0.0)
        d = d * inv_temperature
        tl.store(dst_ptr + offs, d.to(dlogits_ptr.dtype.element_ty), mask=in_row)


def flat_index(index: torch.Tensor) -> torch.Tensor:
    """``index`` as a contiguous int64 tensor: the kernels read entry n at ``ptr + n``.

    Index tensors may arrive strided, expanded (stride 0), offset or as int32; ``.to(torch.int64)``
    alone keeps an int64 view's strides. Copying on the host costs N integers against the N * V
    logits a call reads, and keeps one compiled kernel for every layout and id dtype.
    """
    return index.to(torch.int64).contiguous()


def _rows_or_identity(rows: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) if rows is None else flat_index(rows)


def row_starts(logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where each selected row of ``logits[..., V]`` starts: ``(starts, unit)``, the element offset
    from ``logits.data_ptr()`` of row n being ``starts[n] * unit``.

    ``rows`` indexes the flattened leading dimensions; any leading strides are honoured, 0 (an
    expanded dimension) included. ``unit`` is the gcd of the nonzero strides of the leading
    dimensions longer than 1 (0 when there are none: every row starts at offset 0); ``starts`` is
    a contiguous int64 tensor shaped like ``rows``.
    """
    moving = [(size, stride) for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]) if size > 1 and stride]
    unit = math.gcd(*(stride for _, stride in moving))
    remaining = flat_index(rows)
    if sum(size > 1 for size in logits.shape[:-1]) <= 1:
        # One leading dimension (the others of size 1): a row's index is its start in units of the
        # stride, and no arithmetic is launched.
        return remaining, unit
    starts = torch.zeros_like(remaining)
    for size, stride in zip(reversed(logits.shape[:-1]), reversed(logits.stride()[:-1])):
        if size > 1 and stride:
            starts += (remaining % size) * (stride // unit)
        remaining = remaining // size
    return starts, unit


def logprob_forward(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: float,
    return_entropy: bool,
):
    """Per-target log-prob, softmax statistics and (optionally) entropy.

    logits ``[..., V]`` any dtype/strides; targets integer ``[N]`` (read as int64, so one compiled
    kernel serves int32 and int64 ids); rows integer ``[N]`` indexing the flattened leading dims,
    or None for row n of target n. Returns three tensors of the accumulation dtype (float32, or
    float64 for float64 logits): log-probs ``[N]``; statistics ``[N, 2]``, each selected row's
    maximum and ``log sum exp(x - max)`` of the temperature-scaled logits (their sum is the
    log-sum-exp), which the backward needs; entropies ``[N]`` (``[0]`` without entropy). A target
    outside ``[0, V)`` gets a NaN log-prob and entropy (its row's statistics are still written).
    """
    n, V = targets.shape[0], logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    out = torch.empty(n, dtype=acc, device=logits.device)
    stats = torch.empty(n, 2, dtype=acc, device=logits.device)
    entropy = torch.empty(n if return_entropy else 0, dtype=acc, device=logits.device)
    if n == 0:
        return out, stats, entropy
    block_v = row_block(V, _gpu_block(logits.dtype, backward=False))
    _logprob_fwd_kernel[(n,)](
        logits,
        *row_starts(logits, _rows_or_identity(rows, n, logits.device)),
        flat_index(targets),
        out,
        stats,
        entropy if return_entropy else out,
        V,
        logits.stride(-1),
        float(inv_temperature),
        ACC=accumulator_dtype(logits.dtype),
        RETURN_ENTROPY=return_entropy,
        BLOCK_V=block_v,
        VEC=min(16 // logits.element_size(), block_v),
        num_warps=num_warps(block_v),
    )
    return out, stats, entropy


def logprob_backward(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    rows_unique: bool,
    targets: torch.Tensor,
    grad_out: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    inv_temperature: float,
    dlogits: torch.Tensor,
) -> None:
    """Write ``d logits`` of every selected row into ``dlogits`` (contiguous ``[R, V]``), from the
    forward's statistics ``[N, 2]`` and entropies.

    ``rows`` None means row n for target n; otherwise ``rows_unique`` says whether it has no
    repeats. Rows no target selects are left untouched. ``dlogits`` may be ``logits`` itself when
    the latter is contiguous ``[R, V]`` and rows are unique: each element is read before it is written.
    The softmax comes from ``stats`` alone, so ``logits`` may be one slice of a wider vocabulary
    (with that vocabulary's statistics); a target outside ``[0, V)`` then adds no one-hot term.
    """
    n, V = targets.shape[0], logits.shape[-1]
    if n == 0:
        return
    rows64 = _rows_or_identity(rows, n, logits.device)
    starts, unit = row_starts(logits, rows64)
    grouped = rows is not None and not rows_unique
    if not grouped:
        grad_rows, group_ends, order = rows64, starts, starts
    else:
        # Targets sorted by row; each target knows where its row's run of targets ends. Device
        # work only: the launch does not wait for the number of distinct rows.
        order = torch.argsort(rows64, stable=True)
        grad_rows = rows64[order]
        group_ends = torch.searchsorted(grad_rows, grad_rows, right=True)
    entropy_grad = grad_entropy is not None
    block_v = row_block(V, _gpu_block(logits.dtype, backward=True))
    _logprob_bwd_kernel[(n,)](
        logits,
        starts,
        unit,
        grad_rows,
        group_ends,
        order,
        flat_index(targets),
        grad_out,
        grad_entropy if entropy_grad else grad_out,
        stats,
        entropy if entropy_grad else grad_out,
        dlogits,
        V,
        logits.stride(-1),
        float(inv_temperature),
        ACC=accumulator_dtype(logits.dtype),
        GROUPED=grouped,
        ENTROPY_GRAD=entropy_grad,
        BLOCK_V=block_v,
        num_warps=num_warps(block_v),
    )


def cuda_launch_cases():
    """Launcher calls reaching every configuration these launchers choose on a GPU: each logits
    dtype, entropy flag and row grouping (see ``daca_kernels.tools.ahead_of_time``), with row
    starts known to be 16-aligned (vocabularies that are multiples of 16) and not (an odd one)."""
    n = 3
    targets = torch.zeros(n, dtype=torch.int64)
    for dtype, vocab in product(FLOAT_DTYPES, [*gpu_row_lengths(), 32001]):
        logits = torch.empty(n, vocab, dtype=dtype)
        acc = accumulation_dtype(dtype)
        per_row, stats = torch.empty(n, dtype=acc), torch.empty(n, 2, dtype=acc)
        for return_entropy in (False, True):
            yield partial(logprob_forward, logits, None, targets, 1.0, return_entropy)
        for (rows, unique), entropy_grad in product(((None, True), (torch.tensor([0, 2, 2]), False)), (False, True)):
            yield partial(
                logprob_backward, logits, rows, unique, targets, per_row, per_row if entropy_grad else None,
                stats, per_row, 1.0, torch.empty_like(logits),
            )
