"""DiffuCoder's coupled estimator: two complementary masks per completion.

Each row draws a ratio in ``t_range``
([`daca_kernels.likelihood.ratio_masks.coupled_split`][daca_kernels.likelihood.ratio_masks.coupled_split]): the
first pass masks ``m = round(t n)`` random completion positions, the second pass masks the other
``n - m``. Every completion token is predicted exactly once, and with ``t = m / n``

    sum_i out[b, i] = 1/2 * (1/t * sum_{i in M1} log p(y_i | y outside M1)
                             + 1/(1-t) * sum_{i in M2} log p(y_i | y outside M2)),

the mean of the two single-mask ELBO estimates (a row with one completion token has only the first
mask and gets its log-probability). At ``m = n / 2`` the weights are 1 and this is SML with K = 2
on that split.

The split covers ``completion_mask``, the generated region (``n`` counts its positions, the padding
after an end-of-sequence token included); ``loss_mask`` (default: ``completion_mask``) is the subset
that is scored and sent to the LM head. The split does not depend on ``loss_mask``.

Block-causal models (``lm.attention == ("block", S)``): each block is split on its own
([`daca_kernels.likelihood.block_masks.block_coupled_split`][daca_kernels.likelihood.block_masks.block_coupled_split]: the row's ratio,
the block's
realised ``t_c``) and each pass predicts its half of every block from that block and the clean
blocks before it (one forward pass of the noisy/clean layout per pass), so the row sums to the
coupled estimate of every factor ``log p(y_c | prompt, y_<c)``:
``sum_c 1/2 (1/t_c sum_{M1 in c} + 1/(1 - t_c) sum_{M2 in c})``.

Compared with DiffuCoder's released coupled-GRPO trainer (``src/open_r1/coupled_grpo.py``:
``DiffuGRPOTrainer.forward_process`` and ``selective_log_softmax``): it splits every completion column (the
whole generated region, as here) and its loss counts the completion up to and including the first
EOS (``loss_mask`` here). It draws one ratio per batch and masks each position independently with
probability t, weighting by the drawn t; here the ratio is per row and the first mask has exactly
``round(t n)`` positions, weighted by the realised ``t = m / n`` (both masks non-empty whenever
n >= 2). That trainer also averages in a third, fully masked pass: its per-token estimate is
``(full + w * pair) / 2`` with ``w`` the pair's ``1 / t`` or ``1 / (1 - t)``, and this estimator is
the pair term ``w * pair / 2`` alone, so DiffuCoder's estimate is
``coupled_logprob(...) + one_step_logprob(...) / 2`` (the one-step pass with the same
``completion_mask`` and ``loss_mask`` and no prompt masking), not their sum.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.hashing import seed32
from daca_kernels.likelihood.block_masks import block_coupled_split
from daca_kernels.likelihood.masked_passes import check_estimator_inputs, logprob_by_stratum, nan_where_unchecked
from daca_kernels.likelihood.ratio_masks import check_t_range, coupled_split_unchecked
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.validation import check_row_offset

# DiffuCoder's range of the per-row masking ratio.
T_RANGE = (0.2, 0.8)


def coupled_logprob(
    lm: MaskedLM,
    input_ids: Tensor,
    completion_mask: Tensor,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    *,
    seed: int,
    t_range: tuple[float, float] = T_RANGE,
    checkpoint: bool = False,
    row_offset: int = 0,
) -> Tensor:
    """Coupled (complementary-mask) per-token log-probability estimates.

    Args:
        lm: the model, as in [`daca_kernels.likelihood.stratified_logprob`][daca_kernels.likelihood.stratified.stratified_logprob].
        input_ids: ``[B, L]`` ids, as there.
        completion_mask: bool ``[B, L]``: the generated region that is split.
        attention_mask: ``[B, L]`` or None, as there.
        checkpoint: as there.
        loss_mask: bool ``[B, L]`` or None: the subset of ``completion_mask`` scored.
        seed: int; the split is ``coupled_split(completion_mask, seed, t_range, row_offset=row_offset)``
            (for a block-causal model ``block_coupled_split`` with ``lm``'s block size and
            ``attention_mask``).
        t_range: ``(low, high)`` with ``0 < low <= high < 1``: the range the per-row ratio is drawn from.
        row_offset: global index of row 0 of this call, for sharded batches; masks depend on
            ``(seed, row_offset + b, position)``.

    Returns:
        float32 ``[B, L]`` (float64 for a float64 model): ``weight * log p(y_i | pass of i)`` on
        ``loss_mask`` (weights ``1 / (2t)`` and ``1 / (2(1-t))``, per block for a block model), 0
        elsewhere; differentiable.
    """
    loss_mask = check_estimator_inputs(lm, input_ids, completion_mask, attention_mask, loss_mask)
    seed32(seed)
    t_range = check_t_range(t_range)
    row_offset = check_row_offset(row_offset, input_ids.shape[0])
    return coupled_logprob_unchecked(lm, input_ids, completion_mask, loss_mask, seed=seed, t_range=t_range,
                            attention_mask=attention_mask, checkpoint=checkpoint, row_offset=row_offset)


def coupled_logprob_unchecked(lm: MaskedLM, input_ids: Tensor, completion_mask: Tensor, loss_mask: Tensor, *, seed: int,
                     attention_mask: Tensor | None, row_offset: int, t_range: tuple[float, float] = T_RANGE,
                     checkpoint: bool = False) -> Tensor:
    """[`coupled_logprob`][daca_kernels.likelihood.coupled.coupled_logprob] without its checks (``loss_mask`` given), for callers that
    checked
    the arguments."""
    if lm.block_size is None:
        split = coupled_split_unchecked(completion_mask, seed, t_range, row_offset=row_offset)
        strata, weights = split.strata, split.weights
    else:
        strata, weights = block_coupled_split(completion_mask, seed, lm.block_size, t_range, row_offset=row_offset,
                                              attention_mask=attention_mask)
    mask_id = lm.mask_id

    def copy(k: int) -> Tensor:
        return input_ids.masked_fill(strata == k, mask_id)

    values = logprob_by_stratum(
        lm, input_ids, torch.where(loss_mask, strata, -1), 2, copy,
        weights=weights, attention_mask=attention_mask, checkpoint=checkpoint,
    )
    return nan_where_unchecked(values, lm, completion_mask, loss_mask)
