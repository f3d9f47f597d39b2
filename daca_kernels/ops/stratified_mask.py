"""``stratified_mask``: the strata of Stratified Masking Likelihood and the K masked copies.

Three implementations give bit-identical results for the same seed: the reference
(``daca_kernels.reference.masking``, whose docstring holds the formulas), the Triton kernel
(``daca_kernels.kernels.stratified_mask``, one program per row) and the chunked PyTorch path below
(rows a chunk at a time, ranks by one sort of packed ``(key, position)`` integers). Rows longer
than the kernel's ``MAX_ROW_LENGTH`` take the PyTorch path whatever the backend.

Every hash takes the row's global index ``row_offset + b`` (``row_offset``: the index of the
call's row 0 in the global batch, 0 unless the batch is a shard), so the call on rows ``a:c``
with ``row_offset=a`` gives exactly rows ``a:c`` of the call on the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.hashing import STREAM_INTERLEAVE_OFFSET, STREAM_PROMPT_MASK, STREAM_STRATUM_KEY, hash4, seed32
from daca_kernels.ops import dispatch
from daca_kernels.validation import (
    INDEX_DTYPES,
    check_choice,
    check_disjoint_prompt,
    check_int,
    check_probability,
    check_row_offset,
    check_same_device,
    check_shape,
    check_tensor,
)

SCHEMES = ("random", "interleave")
STREAMS = (STREAM_STRATUM_KEY, STREAM_INTERLEAVE_OFFSET, STREAM_PROMPT_MASK)
# Rows per chunk of the PyTorch path: about this many positions at a time.
CHUNK_POSITIONS = 1 << 18
# Bits of a packed sort key reserved for the position (keys are 32-bit hashes).
_POSITION_BITS = 31


@dataclass(frozen=True)
class StratifiedMask:
    """The result of [`stratified_mask`][daca_kernels.ops.stratified_mask.stratified_mask].

    Attributes:
        strata: int64 ``[B, L]``: the stratum ``0 .. K-1`` of each maskable position, -1 elsewhere.
        input_ids: ``[K, B, L]`` (dtype of the input ids): copy ``k`` is the input with
            ``mask_id`` where ``strata == k`` (and on the prompt positions drawn for copy ``k``).
    """

    strata: Tensor
    input_ids: Tensor

    @property
    def num_strata(self) -> int:
        return self.input_ids.shape[0]


def _row_chunks(batch: int, length: int):
    step = max(1, CHUNK_POSITIONS // max(length, 1))
    for lo in range(0, batch, step):
        yield lo, min(batch, lo + step)


def _grid(lo: int, hi: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    rows = torch.arange(lo, hi, device=device)[:, None].expand(hi - lo, length)
    cols = torch.arange(length, device=device)[None, :].expand(hi - lo, length)
    return rows, cols


def _word(value: int, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.int64, device=device)


def _ranks_of_chunk(maskable: Tensor, folded_seed: int, stream: int, sample: int, lo: int) -> Tensor:
    """Ranks (``-1`` off maskable) of the rows of global index ``lo .. lo + len(maskable)`` by one
    sort per row."""
    chunk, length = maskable.shape
    rows, cols = _grid(lo, lo + chunk, length, maskable.device)
    key = hash4(folded_seed, _word(stream, maskable.device), rows, cols, _word(sample, maskable.device))
    packed = torch.where(maskable, (key << _POSITION_BITS) | cols, torch.iinfo(torch.int64).max)
    order = torch.argsort(packed, dim=1)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(length, device=maskable.device).expand(chunk, length))
    return torch.where(maskable, rank, -1)


def maskable_ranks(
    maskable: Tensor, seed: int, *, stream: int = STREAM_STRATUM_KEY, sample: int = 0, row_offset: int = 0
) -> Tensor:
    """Rank of each maskable position of a row by its hash key, ties broken by position.

    maskable: bool ``[B, L]``; ``stream`` and ``sample`` select the key
    ``hash4(seed32(seed), stream, row_offset + b, i, sample)``; row_offset: global index of row 0
    of this call, for sharded batches (int >= 0, ``row_offset + B <= 2**32``). Returns int64
    ``[B, L]``: a uniformly random permutation of ``0 .. n_b - 1`` over each row's maskable
    positions, -1 elsewhere.
    """
    check_tensor(maskable, "maskable", ndim=2, dtypes=(torch.bool,))
    seed32(seed)
    row_offset = check_row_offset(row_offset, maskable.shape[0])
    return maskable_ranks_unchecked(maskable, seed, stream=stream, sample=sample, row_offset=row_offset)


def maskable_ranks_unchecked(maskable: Tensor, seed: int, *, stream: int, sample: int, row_offset: int) -> Tensor:
    """[`maskable_ranks`][daca_kernels.ops.stratified_mask.maskable_ranks] without its checks, for callers that checked the arguments."""
    folded = seed32(seed)
    out = torch.empty(maskable.shape, dtype=torch.int64, device=maskable.device)
    for lo, hi in _row_chunks(*maskable.shape):
        out[lo:hi] = _ranks_of_chunk(maskable[lo:hi], folded, stream, sample, row_offset + lo)
    return out


def stratified_mask_torch(
    input_ids: Tensor,
    maskable: Tensor,
    prompt: Tensor | None,
    num_strata: int,
    folded_seed: int,
    mask_id: int,
    interleave: bool,
    prompt_threshold: int,
    streams: tuple[int, int, int],
    strata: Tensor,
    copies: Tensor,
    row_offset: int,
) -> None:
    """The PyTorch path, with the launcher signature of ``kernels.stratified_mask.stratified_mask``."""
    batch, length = input_ids.shape
    device = input_ids.device
    key_stream, offset_stream, prompt_stream = streams
    for lo, hi in _row_chunks(batch, length):
        m = maskable[lo:hi]
        first, last = row_offset + lo, row_offset + hi  # global indices of the chunk's rows
        if interleave:
            rows = torch.arange(first, last, device=device)[:, None]
            offset = hash4(folded_seed, _word(offset_stream, device), rows, _word(0, device), _word(0, device)) % num_strata
            count = m.long()
            stratum = (torch.cumsum(count, dim=1) - count + offset) % num_strata
        else:
            stratum = _ranks_of_chunk(m, folded_seed, key_stream, 0, first) % num_strata
        stratum = torch.where(m, stratum, -1)
        strata[lo:hi] = stratum
        ids = input_ids[lo:hi]
        if prompt is not None:
            rows, cols = _grid(first, last, length, device)
            chunk_prompt = prompt[lo:hi]
        for k in range(num_strata):
            masked = stratum == k
            if prompt is not None:
                drawn = hash4(folded_seed, _word(prompt_stream, device), rows, cols, _word(k, device)) < prompt_threshold
                masked |= chunk_prompt & drawn
            copies[k, lo:hi] = torch.where(masked, mask_id, ids)


def _uses_kernel(backend: str, device: torch.device, length: int) -> bool:
    if backend != "triton":
        return False
    return length <= dispatch.triton_module("stratified_mask", device).MAX_ROW_LENGTH


@torch.library.custom_op("daca::stratified_mask", mutates_args=())
def _stratified_mask_op(
    input_ids: Tensor,
    maskable: Tensor,
    prompt: Tensor | None,
    num_strata: int,
    folded_seed: int,
    mask_id: int,
    interleave: bool,
    prompt_threshold: int,
    row_offset: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``backend``: ``"triton"`` or ``"torch"``, the path to run (rows longer than the kernel's
    ``MAX_ROW_LENGTH`` take the PyTorch path on both)."""
    batch, length = input_ids.shape
    strata = torch.empty(batch, length, dtype=torch.int64, device=input_ids.device)
    copies = input_ids.new_empty(num_strata, batch, length)
    if _uses_kernel(backend, input_ids.device, length):
        launch = dispatch.triton_module("stratified_mask", input_ids.device).stratified_mask
    else:
        launch = stratified_mask_torch
    launch(
        input_ids.contiguous(), maskable.contiguous(), None if prompt is None else prompt.contiguous(),
        num_strata, folded_seed, mask_id, interleave, prompt_threshold, STREAMS, strata, copies, row_offset,
    )
    return strata, copies


@_stratified_mask_op.register_fake
def _(input_ids, maskable, prompt, num_strata, folded_seed, mask_id, interleave, prompt_threshold, row_offset, backend):
    batch, length = input_ids.shape
    return input_ids.new_empty(batch, length, dtype=torch.int64), input_ids.new_empty(num_strata, batch, length)


def stratified_mask(
    input_ids: Tensor,
    maskable: Tensor,
    num_strata: int,
    seed: int,
    mask_id: int,
    *,
    scheme: str = "random",
    prompt: Tensor | None = None,
    prompt_mask_prob: float = 0.0,
    row_offset: int = 0,
    backend: str | None = None,
) -> StratifiedMask:
    """Partition each row's maskable positions into K strata and build the K masked copies.

    Deterministic in ``(seed, row_offset + b, position)`` for row ``b`` of this call: the same
    seed gives bit-identical masks on every backend (reference, PyTorch, Triton interpreter, GPU)
    and for every batch that puts the row at the same global index, so the call on
    ``input_ids[a:c]`` with ``row_offset=a`` gives exactly rows ``a:c`` of the call on
    ``input_ids``. The formulas are in ``daca_kernels.reference.masking``.

    Args:
        input_ids: int64/int32 ``[B, L]`` token ids (not modified).
        maskable: bool ``[B, L]``: the positions that count (the completion).
        num_strata: K >= 1. K larger than a row's number of maskable positions is allowed: the
            extra strata of that row are empty (every position still in exactly one stratum).
        seed: int in ``[0, 2**64)``.
        mask_id: the ``[MASK]`` id (int >= 0).
        scheme: ``"random"`` (stratum = hash rank mod K) or ``"interleave"`` (stratum = (ordinal
            among maskable + a per-row random offset) mod K).
        prompt: bool ``[B, L]`` outside ``maskable``: positions eligible for prompt masking; None
            means every position that is not maskable. Only used when ``prompt_mask_prob > 0``, but
            checked whenever given: a position in both is a ValueError naming ``prompt`` (the rule of
            every mask function that takes a ``prompt``: the strata already mask ``maskable``).
        prompt_mask_prob: probability in ``[0, 1]`` that a prompt position is masked, drawn
            independently for each copy (d1's prompt masking; K = 1 is d1's one-step masking).
        row_offset: global index of row 0 of this call, for sharded batches (a data-parallel
            process passes the index of its first row in the global batch); masks depend on
            ``(seed, row_offset + b, position)``. An int >= 0 with ``row_offset + B <= 2**32``.
        backend: ``"triton"``, ``"torch"``, ``"reference"``, or None for ``DACA_BACKEND`` and
            then the device ([`daca_kernels.ops.dispatch`][daca_kernels.ops.dispatch]).

    Returns:
        [`StratifiedMask`][daca_kernels.ops.stratified_mask.StratifiedMask] with ``strata`` int64 ``[B, L]`` and ``input_ids`` ``[K, B,
        L]``.
    """
    check_tensor(input_ids, "input_ids", ndim=2, dtypes=INDEX_DTYPES)
    check_tensor(maskable, "maskable", ndim=2, dtypes=(torch.bool,))
    check_shape(maskable, "maskable", input_ids.shape, "[B, L] (from input_ids)")
    check_int(mask_id, "mask_id", low=0, high=torch.iinfo(input_ids.dtype).max + 1)
    if prompt is not None:
        check_tensor(prompt, "prompt", ndim=2, dtypes=(torch.bool,))
        check_shape(prompt, "prompt", input_ids.shape, "[B, L] (from input_ids)")
    check_same_device(input_ids, "input_ids", maskable=maskable, prompt=prompt)
    if prompt is not None:
        check_disjoint_prompt(prompt, maskable, "maskable")
    num_strata, prompt_mask_prob, row_offset = check_mask_settings(num_strata, seed, scheme, prompt_mask_prob,
                                                                   row_offset, rows=input_ids.shape[0])
    return stratified_mask_unchecked(input_ids, maskable, num_strata, seed, mask_id, scheme=scheme, prompt=prompt,
                            prompt_mask_prob=prompt_mask_prob, row_offset=row_offset, backend=backend)


def check_mask_settings(num_strata, seed, scheme, prompt_mask_prob, row_offset, *, rows: int) -> tuple[int, float, int]:
    """The checks of [`stratified_mask`][daca_kernels.ops.stratified_mask.stratified_mask]'s settings for ``rows`` rows (errors name the
    setting); returns ``(num_strata, prompt_mask_prob, row_offset)`` as int, float, int."""
    num_strata = check_int(num_strata, "num_strata", low=1)
    seed32(seed)
    check_choice(scheme, "scheme", SCHEMES)
    prompt_mask_prob = check_probability(prompt_mask_prob, "prompt_mask_prob")
    return num_strata, prompt_mask_prob, check_row_offset(row_offset, rows)


def stratified_mask_unchecked(input_ids: Tensor, maskable: Tensor, num_strata: int, seed: int, mask_id: int, *, scheme: str,
                     prompt: Tensor | None, prompt_mask_prob: float, row_offset: int,
                     backend: str | None = None) -> StratifiedMask:
    """[`stratified_mask`][daca_kernels.ops.stratified_mask.stratified_mask] without its checks, for callers that checked the arguments."""
    if prompt_mask_prob > 0 and prompt is None:
        prompt = ~maskable
    if prompt_mask_prob == 0:
        prompt = None
    strata, copies = dispatch.run("stratified_mask", backend, input_ids.device, _fused, input_ids, maskable, prompt,
                                  num_strata, seed, mask_id, scheme, prompt_mask_prob, row_offset)
    return StratifiedMask(strata=strata, input_ids=copies)


def _fused(backend: str, input_ids: Tensor, maskable: Tensor, prompt: Tensor | None, num_strata: int, seed: int,
           mask_id: int, scheme: str, prompt_mask_prob: float, row_offset: int) -> tuple[Tensor, Tensor]:
    # A prompt position of copy k is masked when its hash is below this integer threshold.
    threshold = int(prompt_mask_prob * 2**32)
    return torch.ops.daca.stratified_mask(input_ids, maskable, prompt, num_strata, seed32(seed), mask_id,
                                          scheme == "interleave", threshold, row_offset, backend)
