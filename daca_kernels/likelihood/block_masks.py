"""The masks of the stratified (SML) and coupled estimators on block-causal models: drawn within each block.

A block-diffusion model factorises ``log p(y) = sum_c log p(y_c | prompt, y_<c)`` over its blocks
(block ``c`` of a row: the columns ``i`` with ``(i - first) // block_size == c``, ``first`` the row's
first attended column of ``attention_mask``, as
[`daca_kernels.models.masked_lm.block_index`][daca_kernels.models.masked_lm.block_index] counts them
for the model and the sampler decodes them), and
each factor is a masked-diffusion problem on block ``c`` with the earlier blocks clean. The
estimators of a block model therefore draw their masks per block, from the same counter hash as
for a bidirectional model (a function of ``(seed, row_offset + b, position)``):

- SML: block ``c``'s completion positions are split into K strata by their rank among the block's
  completion positions under the stratum key (``scheme="random"``: rank mod K, so each stratum
  holds ``floor`` or ``ceil`` of ``n_c / K`` of the block); ``scheme="interleave"`` keeps the
  row's cyclic strata, already balanced within every block.
- Coupled: block ``c``'s split is
  [`daca_kernels.likelihood.ratio_masks.coupled_split`][daca_kernels.likelihood.ratio_masks.coupled_split] of the
  completion restricted to block ``c`` (the row's ratio ``u``, ``round(u n_c)`` positions of lowest
  rank in the first mask, weights ``1 / (2 t_c)`` and ``1 / (2 (1 - t_c))`` with ``t_c`` the block's
  realised ratio; a block with one completion position has only the first mask, weight 1).

Prompt masking (d1's ``prompt_mask_prob``) draws the same prompt positions per copy as for a
bidirectional model.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.hashing import STREAM_STRATUM_KEY
from daca_kernels.likelihood.ratio_masks import coupled_split
from daca_kernels.models.masked_lm import block_index, leading_columns
from daca_kernels.ops.stratified_mask import StratifiedMask, maskable_ranks, stratified_mask


def _padding(attention_mask: Tensor | None, batch: int, device: torch.device) -> Tensor:
    """int64 ``[B]``: each row's columns before its first attended one (0 without a mask)."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    return leading_columns(attention_mask).to(device)


def within_block_ranks(maskable: Tensor, seed: int, block_size: int, *, row_offset: int = 0,
                       attention_mask: Tensor | None = None) -> Tensor:
    """int64 ``[B, L]``: the rank of each maskable position among the maskable positions of its block
    (module docstring; ``attention_mask`` ``[B, L]`` or None says where each row's blocks start) under
    the stratum key (``maskable_ranks``' key and tie rule), -1 elsewhere.

    The order of the row's ranks restricted to a block is the block's own order, so sorting by
    ``(block, row rank)`` and counting from each block's first maskable position gives the ranks.
    """
    batch, length = maskable.shape
    rank = maskable_ranks(maskable, seed, stream=STREAM_STRATUM_KEY, sample=0, row_offset=row_offset)
    # Blocks numbered from 0 at column 0 of a row moved right by extra = (-first) mod size columns.
    extra = -_padding(attention_mask, batch, maskable.device) % block_size
    block = (torch.arange(length, device=maskable.device)[None, :] + extra[:, None]) // block_size
    key = torch.where(maskable, block * length + rank, block.new_tensor(torch.iinfo(torch.int64).max))
    order = torch.argsort(key, dim=1)
    place = torch.empty_like(order).scatter_(1, order, torch.arange(length, device=maskable.device).expand(batch, length))
    count = maskable.long()
    start = (block * block_size - extra[:, None]).clamp(min=0)
    before = (torch.cumsum(count, dim=1) - count).gather(1, start)
    return torch.where(maskable, place - before, -1)


def block_stratified_mask(
    input_ids: Tensor,
    completion_mask: Tensor,
    num_strata: int,
    seed: int,
    mask_id: int,
    block_size: int,
    *,
    scheme: str = "random",
    prompt: Tensor | None = None,
    prompt_mask_prob: float = 0.0,
    row_offset: int = 0,
    attention_mask: Tensor | None = None,
) -> StratifiedMask:
    """[`daca_kernels.stratified_mask`][daca_kernels.ops.stratified_mask] with the strata drawn within each block (module docstring).

    Same arguments (checked by ``stratified_mask``) plus ``block_size`` (int >= 1) and ``attention_mask``
    (``[B, L]`` or None: where each row's blocks start, its first attended column); returns strata
    int64 ``[B, L]`` and the K copies ``[K, B, L]``: copy k masks stratum k of every block and the
    prompt positions drawn for copy k.
    """
    masks = stratified_mask(input_ids, completion_mask, num_strata, seed, mask_id, scheme=scheme, prompt=prompt,
                            prompt_mask_prob=prompt_mask_prob, row_offset=row_offset)
    if scheme != "random":
        return masks
    strata = torch.where(completion_mask,
                         within_block_ranks(completion_mask, seed, block_size, row_offset=row_offset,
                                            attention_mask=attention_mask) % num_strata, -1)
    k = torch.arange(masks.num_strata, device=input_ids.device)[:, None, None]
    copies = torch.where(completion_mask, torch.where(strata == k, mask_id, input_ids), masks.input_ids)
    return StratifiedMask(strata=strata, input_ids=copies)


def block_coupled_split(
    completion_mask: Tensor, seed: int, block_size: int, t_range: tuple[float, float] = (0.2, 0.8), *,
    row_offset: int = 0, attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The coupled estimator's complementary masks of every block (module docstring).

    completion_mask: bool ``[B, L]``; attention_mask: ``[B, L]`` or None (where each row's blocks
    start); returns ``(strata int64 [B, L] in {-1, 0, 1}, weights float64
    [B, L])``, each block's part equal to ``coupled_split(completion_mask & block, seed, t_range,
    row_offset=row_offset)``. One ``coupled_split`` per block holding a completion position.
    """
    batch, length = completion_mask.shape
    block = block_index(block_size, attention_mask, batch, length, completion_mask.device)
    strata = torch.full(completion_mask.shape, -1, dtype=torch.int64, device=completion_mask.device)
    weights = torch.zeros(completion_mask.shape, dtype=torch.float64, device=completion_mask.device)
    for c in torch.unique(block[completion_mask]).tolist():
        region = completion_mask & (block == c)
        split = coupled_split(region, seed, t_range, row_offset=row_offset)
        strata = torch.where(region, split.strata, strata)
        weights = torch.where(region, split.weights, weights)
    return strata, weights
