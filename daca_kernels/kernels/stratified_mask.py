"""Triton kernel building the strata and all K masked copies of a batch in one launch.

A program takes ``BLOCK_ROWS`` rows (one on a GPU; a tile of rows under the interpreter, which pays
per program) and walks them in tiles of ``TILE`` positions. ``scheme="random"``: a position's rank
among the row's maskable positions ordered by ``(key, position)``, with ``key`` the counter hash of
the position, is the number of maskable positions of the row that come before it: each tile of
positions is compared with every tile of the row (``TILE x TILE`` comparisons at a time), so no
sort, no scatter and no register-resident row are needed. ``scheme="interleave"``: the ordinal
among maskable positions is a running count carried across tiles. The stratum is ``rank mod K``
(or ``(ordinal + offset) mod K``), and each tile writes its strata and its slice of every copy.

The formulas are those of the project's mask specification (the reference masks), with the hashed
row ``row_offset + b`` for row ``b`` of the launch (its global index in a sharded batch). The work
per row grows as ``L**2 / TILE``; rows longer than ``MAX_ROW_LENGTH`` are the caller's to send to
the PyTorch path (a sort). Launchers here do no validation: the public op checks the inputs.
"""
from __future__ import annotations

from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl

from daca_kernels.kernels.hashing import hash4
from daca_kernels.kernels.launch import INTERPRETED, gpu_row_lengths

# Longest row sent to the kernel (its pairwise ranking costs L**2 comparisons per row).
MAX_ROW_LENGTH = 4096
# GPU tile: 64 x 64 comparisons per step over 8 warps (16 per thread).
GPU_TILE = 64
GPU_WARPS = 8
# Under the interpreter a step is one numpy operation over BLOCK_ROWS * TILE * TILE elements.
_INTERPRETER_TILE = 128
_INTERPRETER_STEP_ELEMENTS = 1 << 18

_INTS = ["B", "L", "copy_stride", "num_strata", "seed", "mask_id", "prompt_threshold", "row_offset",
         "stream_key", "stream_offset", "stream_prompt"]
_POINTERS = ["ids_ptr", "maskable_ptr", "prompt_ptr", "strata_ptr", "copies_ptr"]


# A small kernel off the hot path: integers are typed and neither they nor pointer alignment are
# specialised on, so one compiled kernel serves every shape, view and seed for a given dtype,
# flags and tile.
@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _stratified_mask_kernel(
    ids_ptr,
    maskable_ptr,
    prompt_ptr,
    strata_ptr,
    copies_ptr,
    B: tl.int32,
    L: tl.int32,
    copy_stride: tl.int64,
    num_strata: tl.int32,
    seed: tl.uint32,
    mask_id: tl.int64,
    prompt_threshold: tl.int64,
    row_offset: tl.int64,
    stream_key: tl.uint32,
    stream_offset: tl.uint32,
    stream_prompt: tl.uint32,
    INTERLEAVE: tl.constexpr,
    PROMPT_MASKING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    TILE: tl.constexpr,
):
    row = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64))[:, None]
    in_batch = row < B
    zero = tl.zeros([BLOCK_ROWS, TILE], tl.int32)
    # The row word of every hash: the row's global index.
    hashed_row = row + row_offset + zero
    row_start = row * L
    if INTERLEAVE:
        offset = hash4(seed, stream_offset + zero, hashed_row, zero, zero).to(tl.int64) % num_strata
        seen = tl.zeros([BLOCK_ROWS, 1], tl.int64)

    for start in range(0, L, TILE):
        pos = start + tl.arange(0, TILE)[None, :]
        valid = in_batch & (pos < L)
        maskable = tl.load(maskable_ptr + row_start + pos, mask=valid, other=0) != 0
        if INTERLEAVE:
            count = maskable.to(tl.int64)
            stratum = tl.where(maskable, (seen + tl.cumsum(count, 1) - count + offset) % num_strata, -1)
            seen += tl.sum(count, 1)[:, None]
        else:
            key = hash4(seed, stream_key + zero, hashed_row, pos + zero, zero)
            rank = tl.zeros([BLOCK_ROWS, TILE], tl.int32)
            for other in range(0, L, TILE):
                pos_j = other + tl.arange(0, TILE)[None, :]
                maskable_j = tl.load(maskable_ptr + row_start + pos_j, mask=in_batch & (pos_j < L), other=0) != 0
                key_j = hash4(seed, stream_key + zero, hashed_row, pos_j + zero, zero)
                # [rows, i, j]: does maskable position j come before position i?
                earlier_key = key_j[:, None, :] < key[:, :, None]
                tie_before = (key_j[:, None, :] == key[:, :, None]) & (pos_j[:, None, :] < pos[:, :, None])
                before = (earlier_key | tie_before) & maskable_j[:, None, :]
                rank += tl.sum(before.to(tl.int32), 2)
            stratum = tl.where(maskable, rank % num_strata, -1)
        tl.store(strata_ptr + row_start + pos, stratum, mask=valid)

        ids = tl.load(ids_ptr + row_start + pos, mask=valid, other=0)
        if PROMPT_MASKING:
            prompt = tl.load(prompt_ptr + row_start + pos, mask=valid, other=0) != 0
        dst = copies_ptr + row_start + pos
        for k in range(num_strata):
            masked = stratum == k
            if PROMPT_MASKING:
                h = hash4(seed, stream_prompt + zero, hashed_row, pos + zero, k + zero).to(tl.int64)
                masked = masked | (prompt & (h < prompt_threshold))
            tl.store(dst, tl.where(masked, mask_id, ids), mask=valid)
            dst += copy_stride


def launch_layout(batch: int, length: int) -> tuple[int, int]:
    """``(BLOCK_ROWS, TILE)`` of a launch: one row per program and ``GPU_TILE`` on a GPU; under the
    interpreter, the row's power of two up to ``_INTERPRETER_TILE`` and as many rows as fit a step."""
    if not INTERPRETED:
        return 1, GPU_TILE
    tile = min(triton.next_power_of_2(max(length, 1)), _INTERPRETER_TILE)
    return min(triton.next_power_of_2(batch), max(1, _INTERPRETER_STEP_ELEMENTS // (tile * tile))), tile


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
    ``L <= MAX_ROW_LENGTH``; prompt None disables prompt masking. ``folded_seed`` is the 32-bit
    folded seed, ``streams`` the hash streams of the stratum key, the interleave offset and the
    prompt mask, ``row_offset`` the global index of row 0 (``row_offset + B <= 2**32``).
    """
    batch, length = input_ids.shape
    if batch == 0 or length == 0:
        return
    block_rows, tile = launch_layout(batch, length)
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
        *streams,
        INTERLEAVE=interleave,
        PROMPT_MASKING=prompt is not None,
        BLOCK_ROWS=block_rows,
        TILE=tile,
        num_warps=4 if INTERPRETED else GPU_WARPS,
    )


def cuda_launch_cases():
    """Launcher calls reaching every configuration this launcher chooses on a GPU: each id dtype,
    scheme and prompt masking on or off, over row lengths up to ``MAX_ROW_LENGTH`` (see
    ``daca_kernels.tools.ahead_of_time``)."""
    for dtype, length in product((torch.int64, torch.int32), gpu_row_lengths(MAX_ROW_LENGTH)):
        ids = torch.empty(2, length, dtype=dtype)
        flags = torch.empty(2, length, dtype=torch.bool)
        for interleave, prompt in product((False, True), (None, flags)):
            yield partial(
                stratified_mask, ids, flags, prompt, 4, 1, 5, interleave, 6, (7, 8, 9),
                torch.empty(2, length, dtype=torch.int64), torch.empty(4, 2, length, dtype=dtype), 0,
            )
