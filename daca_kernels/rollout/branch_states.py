"""DiSPO branch states: a denoising state kept by a sampler, with the top-k cache of its distribution.

Both samplers keep them ([`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] for bidirectional models,
[`daca_kernels.rollout.blockwise.decode_blockwise`][daca_kernels.rollout.blockwise.decode_blockwise] for block-causal ones) and
[`daca_kernels.rollout.branch`][daca_kernels.rollout.sampler.branch] resamples them. The cache holds, for every masked position, the
``k`` most probable tokens other than the mask id and their log-probabilities under the model's full
softmax (mask id included), which is what [`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob]
computes, so
a filling's cached log-probability is the policy's own.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops import linear_topk_logprob
from daca_kernels.validation import check_int

DEFAULT_BRANCH_TOPK = 64


@dataclass(frozen=True)
class BranchState:
    """A denoising state kept for branching: the input of step ``step`` and its cached distribution.

    Attributes:
        step: the global step (``0 <= step < S``; for a block-causal model the steps are counted over
            all blocks in decoding order).
        sequences: long ``[B, L]``, the input of that step (``mask_id`` at the masked positions).
        masked: bool ``[B, L]``, the positions still masked at the start of the step.
        token_ids: long ``[N, k]``, for each masked position (rows in ``masked.nonzero()`` order,
            i.e. by row then position) the ``k`` most probable tokens other than the mask id, most
            probable first.
        logprobs: ``[N, k]`` float32 (float64 for a float64 model): their log-probabilities under
            ``softmax(logits)`` of the model's raw logits, mask id included (no temperature), i.e.
            [`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob]'s value for that token at the state.
    """

    step: int
    sequences: Tensor
    masked: Tensor
    token_ids: Tensor
    logprobs: Tensor


def topk_cache(lm: MaskedLM, rows: Tensor, k: int, chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """The ``k`` (``1 <= k <= V - 1``) most probable tokens other than the mask id of each hidden row
    ``[N, H]`` (long ``[N, k]``) and their log-probabilities under the full softmax, mask id included
    (``[N, k]``, float32, float64 for a float64 head)."""
    ids, logprobs = linear_topk_logprob(
        rows, lm.head_weight, k=min(k + 1, lm.vocab_size), bias=lm.head_bias, chunk_size=chunk_size
    )
    # Each row drops one of its k + 1 tokens: the mask id where it made the list, else the last.
    drop = ids == lm.mask_id
    drop[:, -1] |= ~drop.any(dim=1)
    keep = ~drop
    return ids[keep].view(-1, k), logprobs[keep].view(-1, k)


def check_branch_steps(branch_steps, steps: int) -> list[int]:
    """``branch_steps`` (an iterable of ints in ``[0, steps)``, or None) as a sorted list without repeats."""
    if branch_steps is None:
        return []
    if isinstance(branch_steps, (int, Tensor)) or not isinstance(branch_steps, Iterable):
        raise TypeError(f"branch_steps must be an iterable of ints or None, got {type(branch_steps).__name__}")
    return sorted({check_int(s, "branch_steps", low=0, high=steps) for s in branch_steps})


def check_branch_topk(branch_topk, lm: MaskedLM) -> int:
    """``branch_topk`` (an int >= 1, or None for every token but the mask id) capped at ``V - 1``."""
    candidates = lm.vocab_size - 1
    if branch_topk is None:
        return candidates
    return min(check_int(branch_topk, "branch_topk", low=1), candidates)
