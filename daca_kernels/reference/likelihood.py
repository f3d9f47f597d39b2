"""Readable reference of the likelihood estimators: full logits, ``log_softmax``, gather.

Every estimator of ``daca_kernels.likelihood`` is a weighted sum of log-probabilities read from a
few masked copies of the input: position ``i`` of row ``b`` is read from copy ``strata[b, i]``.
This module computes that sum the direct way, materialising the full ``[B, L, V]`` logits of each
copy, so the fused estimators can be checked against it (values and gradients).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def masked_copies_logprob(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    copies: torch.Tensor,
    strata: torch.Tensor,
    weights: torch.Tensor | None = None,
    shift: bool = False,
) -> torch.Tensor:
    """``out[b, i] = weights[b, i] * log_softmax(logits_fn(copies[k])[b, i'])[input_ids[b, i]]``.

    logits_fn: maps integer ``[B, L]`` ids to ``[B, L, V]`` logits (e.g. ``model(ids).logits``).
    input_ids: integer ``[B, L]`` (the targets); copies: ``[K, B, L]``; strata: integer ``[B, L]``
    with ``k = strata[b, i]`` (-1: the position does not count and ``out`` is 0 there);
    weights: float ``[B, L]`` or None (all ones). ``i' = i - 1`` with ``shift`` (Dream style),
    else ``i``. Returns ``[B, L]`` in the logits' dtype (float32 for half precision).
    """
    out = None
    for k in range(copies.shape[0]):
        logits = logits_fn(copies[k])
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids.long().unsqueeze(-1)).squeeze(-1)
        if out is None:
            out = torch.zeros_like(logp)
        out = torch.where(strata == k, logp, out)
    if weights is not None:
        out = out * weights
    return out
