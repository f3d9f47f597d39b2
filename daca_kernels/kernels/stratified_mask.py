"""Triton kernel building the strata and all K masked copies of a batch in one launch.

One program per row holds the whole row in registers (``BLOCK_L = next_power_of_2(L)``, at most
``MAX_ROW_LENGTH``; under the interpreter a program takes a tile of rows): it hashes a key per
position, sorts the row's maskable positions by ``(key, position)`` with one ``tl.sort``, scatters
``rank mod K`` to their positions, and after a barrier reads the strata back in position order to
write every copy. The formulas are those of ``daca_kernels.reference.masking``, with the hashed
row ``row_offset + b`` for row ``b`` of the launch (its global index in a sharded batch); rows
longer than ``MAX_ROW_LENGTH`` are the caller's to send to the PyTorch path.

Launchers here do no validation: ``daca_kernels.ops.stratified_mask`` checks the inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from daca_kernels.kernels.hashing import hash4
from daca_kernels.kernels.launch import INTERPRETED

# Longest row one program handles; positions (and ranks) are packed into POSITION_BITS bits.
MAX_ROW_LENGTH = 4096
POSITION_BITS = 16


@triton.jit(do_not_specialize=["seed", "prompt_threshold", "row_offset"])
def _stratified_mask_kernel(
    ids_ptr,
    maskable_ptr,
    prompt_ptr,
    strata_ptr,
    copies_ptr,
    B,
    L,
    copy_stride,
    num_strata,
    seed,
    mask_id,
    prompt_threshold,
    row_offset,
    STREAM_KEY: tl.constexpr,
    STREAM_OFFSET: tl.constexpr,
    STREAM_PROMPT: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    PROMPT_MASKING: tl.constexpr,
    POSITION_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row = rows[:, None]
    pos = tl.arange(0, BLOCK_L)[None, :]
    in_batch = row < B
    valid = in_batch & (pos < L)
    offs = row * L + pos
    maskable = tl.load(maskable_ptr + offs, mask=valid, other=0) != 0
    zero = tl.zeros([BLOCK_ROWS, BLOCK_L], tl.int32)
    # The row word of every hash: the row's global index.
    hashed_row = row + row_offset + zero

    if INTERLEAVE:
        count = maskable.to(tl.int32)
        ordinal = tl.cumsum(count, 1) - count
        offset = hash4(seed, STREAM_OFFSET + zero, hashed_row, zero, zero).to(tl.int64) % num_strata
        stratum = tl.where(maskable, (ordinal + offset) % num_strata, -1)
        tl.store(strata_ptr + offs, stratum, mask=valid)
    else:
        pos64 = pos.to(tl.int64)
        key = hash4(seed, STREAM_KEY + zero, hashed_row, pos + zero, zero).to(tl.int64)
        # Maskable positions sort by (key, position); the others after all of them.
        packed = tl.where(maskable, (key << POSITION_BITS) | pos64, (1 << (32 + POSITION_BITS)) | pos64)
        position_by_rank = tl.sort(packed, 1) & ((1 << POSITION_BITS) - 1)
        num_maskable = tl.sum(maskable.to(tl.int32), 1)[:, None]
        # Column r of the sorted tile is rank r: scatter rank mod K to its position. The two stores
        # touch disjoint addresses (maskable positions, the rest).
        tl.store(strata_ptr + offs, tl.full([BLOCK_ROWS, BLOCK_L], -1, tl.int64), mask=valid & ~maskable)
        tl.store(strata_ptr + row * L + position_by_rank, (pos64 % num_strata), mask=in_batch & (pos < num_maskable))
        tl.debug_barrier()
        stratum = tl.load(strata_ptr + offs, mask=valid, other=-1)

    ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    if PROMPT_MASKING:
        prompt = tl.load(prompt_ptr + offs, mask=valid, other=0) != 0
    dst = copies_ptr + offs
    for k in range(num_strata):
        masked = stratum == k
        if PROMPT_MASKING:
            h = hash4(seed, STREAM_PROMPT + zero, hashed_row, pos + zero, k + zero).to(tl.int64)
            masked = masked | (prompt & (h < prompt_threshold))
        tl.store(dst, tl.where(masked, mask_id, ids), mask=valid)
        dst += copy_stride


def _block_rows(batch: int, block_l: int) -> int:
    # On a GPU one program per row; the interpreter pays per program and per operation (tl.sort
    # is many operations), so it takes a tile of rows at once.
    if not INTERPRETED:
        return 1
    return min(triton.next_power_of_2(batch), max(1, (1 << 14) // block_l))


def stratified_mask(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    prompt: torch.Tensor | None,
    num_strata: int,
    folded_seed: int,
    mask_id: int,
    interleave: bool,
    prompt_threshold: int,
    streams: tuple[int, int, int],
    strata: torch.Tensor,
    copies: torch.Tensor,
    row_offset: int,
) -> None:
    """Write ``strata`` (int64 ``[B, L]``) and ``copies`` (``[K, B, L]``, dtype of input_ids).

    input_ids integer, maskable and prompt bool, all contiguous ``[B, L]`` with
    ``L <= MAX_ROW_LENGTH``; prompt None disables prompt masking. ``folded_seed`` is ``seed32(seed)``,
    ``streams`` the hash streams of the stratum key, the interleave offset and the prompt mask,
    ``row_offset`` the global index of row 0 (``row_offset + B <= 2**32``).
    """
    batch, length = input_ids.shape
    if batch == 0 or length == 0:
        return
    block = triton.next_power_of_2(length)
    block_rows = _block_rows(batch, block)
    _stratified_mask_kernel[(triton.cdiv(batch, block_rows),)](
        input_ids,
        maskable,
        maskable if prompt is None else prompt,
        strata,
        copies,
        batch,
        length,
        batch * length,
        num_strata,
        folded_seed,
        mask_id,
        prompt_threshold,
        row_offset,
        STREAM_KEY=streams[0],
        STREAM_OFFSET=streams[1],
        STREAM_PROMPT=streams[2],
        INTERLEAVE=interleave,
        PROMPT_MASKING=prompt is not None,
        POSITION_BITS=POSITION_BITS,
        BLOCK_ROWS=block_rows,
        BLOCK_L=block,
        num_warps=4 if block <= 1024 else 8,
    )
