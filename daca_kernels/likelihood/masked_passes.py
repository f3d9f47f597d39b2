"""The engine of every estimator: masked forward passes run one at a time, and only the positions a
pass predicts go through the LM head.

An estimator is described by ``strata [B, L]`` (which masked copy predicts each completion
position, -1 for positions that do not count) and the copies themselves. For copy k the backbone
runs once, the hidden rows of the positions with ``strata == k`` are gathered (the row ``i - 1``
under the ``shift`` convention) and sent through [`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob], so the head
sees each counted position exactly once however many copies there are, and full ``[B, L, V]``
logits never exist. Copies no position reads from are not run.

Block-causal models (``lm.attention == ("block", size)``): position ``i`` of block ``c`` is read
from [`MaskedLM.block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden] of copy k with the *context* copy (copy k with the
positions it
scores restored to their tokens) as the clean earlier blocks: ``log p(y_i | context blocks < c,
block c of copy k)``. So the scored tokens are predicted from their own noisy block and the clean
blocks before it, the block-causal factorisation ``sum_c log p(y_c | prompt, y_<c)``; positions a
copy masks without scoring them (d1's prompt masking, the generated padding outside ``loss_mask``)
stay masked in the context too, as they are hidden from every prediction of a bidirectional model.
With ``hidden_with_keep`` (SDAR, LLaDA2 from ``from_hf``) a copy costs one forward pass of length
``2L``; otherwise one forward pass per block holding a scored position. ``shift=True`` block models
are refused (a block's first token would be read from the previous block's state).

Memory: the forward activations of every copy are kept for backward unless ``checkpoint=True``,
which keeps only each copy's inputs and recomputes its forward during backward, one copy at a time
(peak of one forward, at the cost of one extra forward per copy).

[`masked_logprob`][daca_kernels.likelihood.masked_passes.masked_logprob] is the single-copy case made public: one masked input, the
log-probabilities
of a chosen subset of its masked positions.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.linear_logprob import linear_logprob_unchecked
from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import (
    INDEX_DTYPES,
    check_index_range,
    check_same_device,
    check_sequence_length,
    check_shape,
    check_tensor,
    reads_values,
)


def check_positions(positions, name: str, input_ids: Tensor, ids_name: str = "input_ids") -> None:
    """``positions`` must be a bool ``[B, L]`` tensor shaped and placed like ``input_ids``."""
    check_tensor(positions, name, ndim=2, dtypes=(torch.bool,))
    check_shape(positions, name, input_ids.shape, f"[B, L] (from {ids_name})")
    check_same_device(input_ids, ids_name, **{name: positions})


def check_predictable(lm: MaskedLM, positions: Tensor, name: str) -> None:
    """Under ``lm.shift`` position 0 has no preceding hidden state and cannot be predicted."""
    if lm.shift and positions.shape[1] and reads_values(positions) and bool(positions[:, 0].any()):
        raise ValueError(f"{name}[:, 0] must be False when lm.shift: no hidden state precedes position 0")


def check_model_inputs(lm, input_ids, attention_mask, *, positions: dict, ids_name: str = "input_ids") -> None:
    """The model, the ids (the argument ``ids_name``, at most ``lm.max_length`` positions), the attention
    mask and the bool ``[B, L]`` ``positions`` (name -> tensor)."""
    if not isinstance(lm, MaskedLM):
        raise TypeError(f"lm must be a MaskedLM, got {type(lm).__name__}")
    if lm.shift and lm.block_size is not None:
        raise ValueError(f"lm: a block-causal model (attention={lm.attention!r}) with shift=True is not supported by "
                         "the estimators: a block's first token would be predicted from the previous block's state")
    check_tensor(input_ids, ids_name, ndim=2, dtypes=INDEX_DTYPES)
    check_sequence_length(input_ids.shape[1], lm.max_length, ids_name, f"the length L of {ids_name} [B, L]")
    for name, value in positions.items():
        check_positions(value, name, input_ids, ids_name)
    if attention_mask is not None:
        check_tensor(attention_mask, "attention_mask", ndim=2)
        check_shape(attention_mask, "attention_mask", input_ids.shape, f"[B, L] (from {ids_name})")
        check_same_device(input_ids, ids_name, attention_mask=attention_mask)
    if input_ids.device != lm.device:
        raise ValueError(f"{ids_name} is on {input_ids.device} but the model (lm) is on {lm.device}")
    if reads_values(input_ids):  # elsewhere: scored ids are NaN (linear_logprob), the embedding refuses the others
        check_index_range(input_ids, lm.vocab_size, ids_name)


def check_subset(inner: Tensor, inner_name: str, outer: Tensor, outer_name: str) -> None:
    """``inner`` must be True only where ``outer`` is (both bool ``[B, L]``); the error names the first offender."""
    outside = inner & ~outer
    if reads_values(outside) and bool(outside.any()):
        where = ", ".join(str(v) for v in outside.nonzero()[0].tolist())
        raise ValueError(
            f"{inner_name} must be a subset of {outer_name}: {inner_name}[{where}] is True but {outer_name}[{where}] is False"
        )


def check_estimator_inputs(lm, input_ids, completion_mask, attention_mask, loss_mask=None) -> Tensor:
    """Validate the arguments every estimator takes (errors name the argument); returns the loss
    mask (``completion_mask`` when ``loss_mask`` is None), which must lie inside ``completion_mask``.

    The checks that read values (ids in ``[0, V)``, ``loss_mask`` inside ``completion_mask``, no
    position 0 under ``lm.shift``) run where that costs no device synchronisation
    (``daca_kernels.validation.reads_values``); on CUDA the estimators' values are NaN where they
    would have raised instead."""
    positions = {"completion_mask": completion_mask}
    if loss_mask is not None:
        positions["loss_mask"] = loss_mask
    check_model_inputs(lm, input_ids, attention_mask, positions=positions)
    check_predictable(lm, completion_mask, "completion_mask")
    if loss_mask is None:
        return completion_mask
    check_subset(loss_mask, "loss_mask", completion_mask, "completion_mask")
    return loss_mask


def nan_where_unchecked(values: Tensor, lm: MaskedLM, region: Tensor, scored: Tensor) -> Tensor:
    """Per-token ``[B, L]`` ``values`` with NaN at the ``scored`` positions that the value-reading
    checks would have refused where they could not run
    ([`check_estimator_inputs`][daca_kernels.likelihood.masked_passes.check_estimator_inputs]): outside
    ``region`` (``completion_mask``, or [`masked_logprob`][daca_kernels.likelihood.masked_passes.masked_logprob]'s ``mask``), and
    column 0 under
    ``lm.shift``. Unchanged where the checks ran."""
    if reads_values(values):
        return values
    unchecked = scored & ~region
    if lm.shift and scored.shape[1]:
        unchecked = unchecked | (scored & (torch.arange(scored.shape[1], device=scored.device) == 0))
    return torch.where(unchecked, torch.full_like(values, float("nan")), values)


def output_dtype(lm: MaskedLM) -> torch.dtype:
    """float64 for a float64 head, float32 otherwise (as ``linear_logprob`` returns)."""
    return accumulation_dtype(lm.head_weight.dtype)


def _stratum_logprob(lm: MaskedLM, ids: Tensor, attention_mask: Tensor | None, b: Tensor, i: Tensor, targets: Tensor) -> Tensor:
    hidden = lm.hidden(ids, attention_mask)
    rows = hidden[b, i - 1 if lm.shift else i]
    return linear_logprob_unchecked(rows, lm.head_weight, targets, bias=lm.head_bias)


def _block_stratum_logprob(lm: MaskedLM, ids: Tensor, context: Tensor, attention_mask: Tensor | None,
                           needed: Tensor, b: Tensor, i: Tensor, targets: Tensor) -> Tensor:
    rows = lm.block_hidden(ids, context, attention_mask, needed=needed)[b, i]
    return linear_logprob_unchecked(rows, lm.head_weight, targets, bias=lm.head_bias)


def logprob_by_stratum(
    lm: MaskedLM,
    input_ids: Tensor,
    strata: Tensor,
    num_strata: int,
    copy: Callable[[int], Tensor],
    *,
    weights: Tensor | None = None,
    attention_mask: Tensor | None = None,
    checkpoint: bool = False,
) -> Tensor:
    """Per-token ``weights * log p(input_ids[b, i] | copy strata[b, i])``, 0 where ``strata < 0``.

    input_ids, strata: ``[B, L]``; copy(k): the ``[B, L]`` ids of masked copy k; weights: float
    ``[B, L]`` or None. Returns ``[B, L]`` in [`output_dtype`][daca_kernels.likelihood.masked_passes.output_dtype], differentiable
    through the model.
    """
    out = torch.zeros(strata.shape, dtype=output_dtype(lm), device=input_ids.device)
    for k in range(num_strata):
        b, i = (strata == k).nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        ids, targets = copy(k), input_ids[b, i]
        if lm.block_size is None:
            fn, args = _stratum_logprob, (lm, ids, attention_mask, b, i, targets)
        else:
            scored = strata == k
            fn, args = _block_stratum_logprob, (lm, ids, torch.where(scored, input_ids, ids), attention_mask, scored,
                                                b, i, targets)
        if checkpoint and torch.is_grad_enabled():
            values = activation_checkpoint(fn, *args, use_reentrant=False)
        else:
            values = fn(*args)
        out = out.index_put((b, i), values.to(out.dtype))
    if weights is not None:
        out = out * weights.to(out.dtype)
    return out


def masked_pass_logprob(
    lm: MaskedLM,
    input_ids: Tensor,
    mask: Tensor,
    scored: Tensor,
    *,
    attention_mask: Tensor | None = None,
    checkpoint: bool = False,
) -> Tensor:
    """[`masked_logprob`][daca_kernels.likelihood.masked_passes.masked_logprob] without the input checks (for estimators that ran them
    already)."""
    return logprob_by_stratum(
        lm, input_ids, torch.where(scored, 0, -1), 1, lambda _: input_ids.masked_fill(mask, lm.mask_id),
        attention_mask=attention_mask, checkpoint=checkpoint,
    )


def masked_logprob(
    lm: MaskedLM,
    input_ids: Tensor,
    mask: Tensor,
    *,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    checkpoint: bool = False,
) -> Tensor:
    """``log p(input_ids[b, i] | input_ids with mask_id where mask)`` at the positions of ``loss_mask``.

    The primitive every estimator is made of: one forward pass of the backbone on
    ``input_ids.masked_fill(mask, lm.mask_id)``; only the hidden rows of the scored positions
    (row ``i - 1`` under ``lm.shift``) go through the LM head ([`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob]).

    Args:
        lm: the model.
        input_ids: int64/int32 ``[B, L]`` ids in ``[0, V)``: the model input before masking and
            the targets; ``L`` at most ``lm.max_length`` when the model has one.
        mask: bool ``[B, L]``: the positions replaced by ``lm.mask_id`` in the model input (any
            positions, prompt included).
        loss_mask: bool ``[B, L]``: the positions whose log-probabilities are returned, a subset of
            ``mask`` (default: ``mask``); under ``lm.shift`` column 0 must be False.
        attention_mask: ``[B, L]`` passed to ``lm.hidden`` (1 = attend), or None.
        checkpoint: recompute the forward pass during backward instead of keeping its activations.

    On a block-causal model the scored position ``i`` of block ``c`` is predicted from block ``c`` of
    the masked input and the blocks before ``c`` of the masked input with the scored positions
    restored (module docstring): ``log p(y_i | clean earlier blocks, noisy block c)``.

    Returns:
        float32 ``[B, L]`` (float64 for a float64 model): the log-probabilities at ``loss_mask``, 0
        elsewhere; differentiable through the model. No forward pass runs when nothing is scored.
    """
    positions = {"mask": mask} if loss_mask is None else {"mask": mask, "loss_mask": loss_mask}
    check_model_inputs(lm, input_ids, attention_mask, positions=positions)
    if loss_mask is None:
        loss_mask = mask
        check_predictable(lm, loss_mask, "mask")
    else:
        check_predictable(lm, loss_mask, "loss_mask")
        check_subset(loss_mask, "loss_mask", mask, "mask")
    values = masked_pass_logprob(lm, input_ids, mask, loss_mask, attention_mask=attention_mask, checkpoint=checkpoint)
    return nan_where_unchecked(values, lm, mask, loss_mask)
