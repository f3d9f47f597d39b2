"""The top-k and top-p logit filters of the released samplers (Dream, SDAR, LLaDA2): what a
candidate is drawn from once the logits are tempered. Dream applies top-p then top-k, SDAR and
LLaDA2 top-k then top-p; the filters themselves are the same."""
from __future__ import annotations

import torch
from torch import Tensor


def top_p_filter(logits: Tensor, top_p: float | None) -> Tensor:
    """``logits [n, V]`` with ``-inf`` outside each row's nucleus (None: unchanged). The released
    filter of Dream, SDAR and LLaDA2: walk the tokens by decreasing logit and drop each one whose
    predecessors' probabilities already sum past ``top_p`` (the most probable always stays)."""
    if top_p is None:
        return logits
    ordered, order = torch.sort(logits, dim=1, descending=True, stable=True)
    before = torch.softmax(ordered, dim=1).cumsum(dim=1)
    drop = torch.zeros_like(before, dtype=torch.bool)
    drop[:, 1:] = before[:, :-1] > top_p
    return logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))


def top_k_filter(logits: Tensor, top_k: int | None) -> Tensor:
    """``logits [n, V]`` with ``-inf`` below each row's ``top_k``-th largest (ties with it kept;
    None: unchanged)."""
    if top_k is None:
        return logits
    kth = torch.topk(logits, min(top_k, logits.shape[1]), dim=1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))
