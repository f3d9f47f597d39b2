"""The engine of every estimator: masked forward passes run one at a time, and only the positions a
pass predicts go through the LM head.

An estimator is described by ``strata [B, L]`` (which masked copy predicts each completion
position, -1 for positions that do not count) and the copies themselves. For copy k the backbone
runs once, the hidden rows of the positions with ``strata == k`` are gathered (the row ``i - 1``
under the ``shift`` convention) and sent through :func:`daca_kernels.linear_logprob`, so the head
sees each counted position exactly once however many copies there are, and full ``[B, L, V]``
logits never exist. Copies no position reads from are not run.

Memory: the forward activations of every copy are kept for backward unless ``checkpoint=True``,
which keeps only each copy's inputs and recomputes its forward during backward, one copy at a time
(peak of one forward, at the cost of one extra forward per copy).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from daca_kernels.masked_lm import MaskedLM
from daca_kernels.ops import linear_logprob
from daca_kernels.ops.validation import INDEX_DTYPES, check_index_range, check_same_device, check_shape, check_tensor


def check_estimator_inputs(lm, input_ids, completion_mask, attention_mask) -> None:
    """Validate the arguments every estimator takes (errors name the argument)."""
    if not isinstance(lm, MaskedLM):
        raise TypeError(f"lm must be a MaskedLM, got {type(lm).__name__}")
    check_tensor(input_ids, "input_ids", ndim=2, dtypes=INDEX_DTYPES)
    check_tensor(completion_mask, "completion_mask", ndim=2, dtypes=(torch.bool,))
    check_shape(completion_mask, "completion_mask", input_ids.shape, "[B, L] (from input_ids)")
    if attention_mask is not None:
        check_tensor(attention_mask, "attention_mask", ndim=2)
        check_shape(attention_mask, "attention_mask", input_ids.shape, "[B, L] (from input_ids)")
    check_same_device(input_ids, "input_ids", completion_mask=completion_mask, attention_mask=attention_mask)
    if input_ids.device != lm.device:
        raise ValueError(f"input_ids is on {input_ids.device} but the model (lm) is on {lm.device}")
    check_index_range(input_ids, lm.vocab_size, "input_ids")
    if lm.shift and input_ids.shape[1] and bool(completion_mask[:, 0].any()):
        raise ValueError("completion_mask[:, 0] must be False when lm.shift: no hidden state precedes position 0")


def output_dtype(lm: MaskedLM) -> torch.dtype:
    """float64 for a float64 head, float32 otherwise (as ``linear_logprob`` returns)."""
    return torch.float64 if lm.head_weight.dtype == torch.float64 else torch.float32


def _stratum_logprob(lm: MaskedLM, ids: Tensor, attention_mask: Tensor | None, b: Tensor, i: Tensor, targets: Tensor) -> Tensor:
    hidden = lm.hidden(ids, attention_mask)
    rows = hidden[b, i - 1 if lm.shift else i]
    return linear_logprob(rows, lm.head_weight, targets, bias=lm.head_bias)


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
    ``[B, L]`` or None. Returns ``[B, L]`` in :func:`output_dtype`, differentiable through the model.
    """
    out = torch.zeros(strata.shape, dtype=output_dtype(lm), device=input_ids.device)
    for k in range(num_strata):
        b, i = (strata == k).nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        args = (lm, copy(k), attention_mask, b, i, input_ids[b, i])
        if checkpoint and torch.is_grad_enabled():
            values = activation_checkpoint(_stratum_logprob, *args, use_reentrant=False)
        else:
            values = _stratum_logprob(*args)
        out = out.index_put((b, i), values.to(out.dtype))
    if weights is not None:
        out = out * weights.to(out.dtype)
    return out
