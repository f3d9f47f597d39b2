"""The record every decoder of the package returns: [`Rollout`][daca_kernels.rollout.record.Rollout], with the
[`Decoding`][daca_kernels.rollout.record.Decoding]
options that produced it, and the answer mask of a batch of sequences."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.rollout.branch_states import BranchState
from daca_kernels.validation import INDEX_DTYPES, check_int, check_same_device, check_tensor

# Token ids are int64: an id at or past this cannot occur in a sequence.
ID_LIMIT = 1 << 63


@dataclass(frozen=True)
class Decoding:
    """Which decoding options produced a [`Rollout`][daca_kernels.rollout.record.Rollout]
    ([`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate]'s arguments of those names).

    Attributes:
        kv_cache: None (every forward runs the whole sequence), ``"prefix"`` or ``"dual"`` (Fast-dLLM's
            approximate cache, full-attention models), or a block-causal model's ``kv_cache`` argument.
        threshold: the confidence threshold of parallel decoding, or None.
        tokens_per_step: the fixed number of tokens per step it was asked for, or None.
    """

    kv_cache: bool | str | None = None
    threshold: float | None = None
    tokens_per_step: int | None = None

    @property
    def exact(self) -> bool:
        """True when no option approximates the exact sampler (a full-attention model's prefix or dual
        cache, or a threshold); ``tokens_per_step`` is LLaDA's schedule with ``steps = G / k``."""
        return self.kv_cache in (None, False, True) and self.threshold is None


@dataclass(frozen=True)
class Rollout:
    """What [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] returns, whichever decoder ran (``B`` rows, ``L =
    P + G`` positions, ``S`` steps).

    Attributes:
        sequences: long ``[B, L]``, prompt (as given, padding included) then completion. Under
            ``mask_candidate="llada"`` or ``"dream"`` a completion position may still hold the mask id,
            and so do a block-causal row's positions after its stop (``stop_at_eos``).
        commit_step: long ``[B, L]``, the step that committed each completion token; -1 on the
            prompt (and on a position left masked: with the mask id a candidate, or after a stop).
        commit_confidence: ``[B, L]``, ``c_s[i]`` at each token's commit step; 0 where
            ``commit_step`` is -1.
        step_gain: ``[B, S]``, ``sum_{j in U_s} (c_{s+1}[j] - c_s[j])`` (0 at the last step).
        attention_mask: long ``[B, L]`` (0 on left padding), or None when ``generate`` got no
            ``prompt_mask``; pass it to the model for any later forward on these sequences.
        prompt_length: ``P``.
        nfe: the number of backbone calls made.
        forward_tokens: the token columns those calls ran, summed over rows and calls.
        branches: one [`daca_kernels.rollout.branch_states.BranchState`][daca_kernels.rollout.branch_states.BranchState] per requested
            branch step, in step order.
        mask_id: the model's mask id.
        commit_logprob: ``[B, L]``, the sampling-time log-probability of each committed token under
            the model's softmax (mask id included, untempered) from the hidden row the sampler used at
            its commit step (a cached row under ``kv_cache``); 0 where ``commit_step`` is -1. None for
            a block-causal model. [`daca_kernels.rollout.rescore_commits`][daca_kernels.rollout.sampler.rescore_commits] gives the same
            tokens scored by full
            forwards.
        decoding: the [`Decoding`][daca_kernels.rollout.record.Decoding] options that produced it.

    Floating tensors are float32 (float64 for a float64 model).
    """

    sequences: Tensor
    commit_step: Tensor
    commit_confidence: Tensor
    step_gain: Tensor
    attention_mask: Tensor | None
    prompt_length: int
    nfe: int
    branches: tuple[BranchState, ...]
    mask_id: int
    forward_tokens: int = 0
    commit_logprob: Tensor | None = None
    decoding: Decoding = Decoding()

    @property
    def completion_mask(self) -> Tensor:
        """bool ``[B, L]``: the generated region, the last ``G`` columns (every position the sampler
        wrote, the padding after an end-of-sequence token included). Pass it as the estimators'
        ``completion_mask``: the positions they mask."""
        columns = torch.arange(self.sequences.shape[1], device=self.sequences.device)
        return (columns >= self.prompt_length).expand(self.sequences.shape).clone()

    def answer_mask(self, eos_id: int) -> Tensor:
        """bool ``[B, L]``: the generated positions up to and including the first ``eos_id`` of each
        row (the whole generated region of a row without one): the tokens a reward reads and a loss
        scores. Pass it as the estimators' ``loss_mask`` and as the losses' completion mask (d1,
        DiffuCoder and SPG score these tokens, EOS included)."""
        return answer_mask(self.sequences, self.completion_mask, eos_id)

    @property
    def num_steps(self) -> int:
        return self.step_gain.shape[1]


def answer_mask(sequences: Tensor, completion_mask: Tensor, eos_id: int) -> Tensor:
    """bool, shaped like ``sequences``: the positions of ``completion_mask`` up to and including the
    first ``eos_id`` of ``sequences`` within them, each row's whole completion when it has none.

    Args:
        sequences: int64/int32 ``[..., L]`` (at least 1-D).
        completion_mask: bool, the shape of ``sequences`` or of its last dimensions (``[B, L]`` for
            the ``[Z, B, L]`` fillings of [`daca_kernels.rollout.branch`][daca_kernels.rollout.sampler.branch]), on the same device.
        eos_id: int in ``[0, 2**63)``.

    [`Rollout.answer_mask`][daca_kernels.rollout.record.Rollout.answer_mask] of a rollout; of
    [`daca_kernels.rollout.branch`][daca_kernels.rollout.sampler.branch] fillings,
    ``answer_mask(fills.sequences, rollout.completion_mask, eos_id)`` (or ``fills.fillings`` with
    ``rollout.completion_mask.repeat_interleave(Z, dim=0)``)."""
    check_tensor(sequences, "sequences", min_ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(completion_mask, "completion_mask", min_ndim=1, dtypes=(torch.bool,))
    eos_id = check_int(eos_id, "eos_id", low=0, high=ID_LIMIT)
    check_same_device(sequences, "sequences", completion_mask=completion_mask)
    trailing = tuple(sequences.shape[sequences.dim() - completion_mask.dim():])
    if completion_mask.dim() > sequences.dim() or tuple(completion_mask.shape) != trailing:
        raise ValueError(f"completion_mask must have the shape of sequences {tuple(sequences.shape)} or of its last "
                         f"dimensions, got {tuple(completion_mask.shape)}")
    is_eos = completion_mask & (sequences == eos_id)
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return completion_mask & (eos_before == 0)
