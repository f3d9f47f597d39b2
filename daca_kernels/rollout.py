"""The denoising sampler: LLaDA's block-wise remasking, with online DPS bookkeeping and branch states.

:func:`generate` decodes a completion of ``G`` tokens after a (left-padded) prompt of ``P``
tokens, so sequences have ``L = P + G`` positions. The completion is cut into blocks of
``block_length`` decoded left to right, each over ``steps / num_blocks`` steps. At every step
each still-masked position (in every block) gets a candidate and a confidence from
:func:`daca_kernels.sample_step_linear` on its hidden row, so full ``[B, L, V]`` logits are never
formed. Then the ``k`` positions of the current block with the highest score are committed, ``k``
from an even split of the block's mask count over its steps with the remainder going to the first
steps (LLaDA's schedule); ties go to the lowest position. The score is the confidence
(``remasking="low_confidence"``) or a uniform number from the counter hash (``"random"``).
Committed tokens never change.

Noise identity: position ``j`` of row ``b`` is row id ``(row_offset + b) * L + j`` at global step
``s``, where ``row_offset`` (default 0) is the index of the call's row 0 in the global batch, so a
position's noise depends neither on which other positions are still masked nor on the batch size
nor on how the batch is sharded across processes. :func:`daca_kernels.reference.reference_generate`
is the plain sampler this one reproduces.

What the Denoising Progress Scores (:mod:`daca_kernels.credit`) need is recorded online:
``commit_step``, ``commit_confidence`` and ``step_gain[b, s] = sum_{j in U_s} (c_{s+1}[j] - c_s[j])``,
where ``U_s`` are the positions still masked after step s commits. Only the previous step's
confidences are kept (two dense ``[B, L]`` buffers, swapped each step) and the sum is
:func:`daca_kernels.confidence_delta`.

Model calls: a step that follows a step which committed nothing sees the same input and reuses the
previous hidden rows instead of running the backbone (RADD's caching), and at temperature 0 also the
previous candidates and confidences (only the noise, which depends on the step, could change them);
``Rollout.nfe`` counts the backbone calls. Every row commits the same number of tokens at every
step (each block starts fully masked), so the whole batch either changes or does not.

Branching (DiSPO): at ``branch_steps`` the state (the step's input and its masked positions) is kept
with the ``branch_topk`` most probable tokens and log-probabilities of every masked position (the
mask id excluded, as for the confidence); :func:`branch` resamples all masked positions of such a
state from that cache with no model call. Full logits would take ``N * V`` floats per state
(V = 126,464 for LLaDA); the top k take ``N * k`` ids and floats, and ``branch_topk=None`` keeps
every candidate token, which makes the cache exact.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.hashing import seed32
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.ops import confidence_delta, linear_topk_logprob, sample_step, sample_step_linear
from daca_kernels.ops.gather_logprob import accumulation_dtype
from daca_kernels.ops.validation import (
    INDEX_DTYPES,
    check_index_range,
    check_int,
    check_nonnegative_float,
    check_row_offset,
    check_shape,
    check_tensor,
)
from daca_kernels.remasking import remasking_uniforms, transfer_counts

REMASKING = ("low_confidence", "random")
DEFAULT_BRANCH_TOPK = 64


@dataclass(frozen=True)
class BranchState:
    """A denoising state kept for branching: the input of step ``step`` and its cached distribution.

    Attributes:
        step: the global step (``0 <= step < S``).
        sequences: long ``[B, L]``, the input of that step (``mask_id`` at the masked positions).
        masked: bool ``[B, L]``, the positions still masked at the start of the step.
        token_ids: long ``[N, k]``, for each masked position (rows in ``masked.nonzero()`` order,
            i.e. by row then position) the ``k`` most probable tokens, most probable first.
        logprobs: ``[N, k]`` float32 (float64 for a float64 model): their log-probabilities under
            ``softmax(logits)`` with the mask id excluded (no temperature).
    """

    step: int
    sequences: Tensor
    masked: Tensor
    token_ids: Tensor
    logprobs: Tensor


@dataclass(frozen=True)
class Rollout:
    """What :func:`generate` returns (``B`` rows, ``L = P + G`` positions, ``S`` steps).

    Attributes:
        sequences: long ``[B, L]``, prompt (as given, padding included) then completion.
        commit_step: long ``[B, L]``, the step that committed each completion token; -1 on the prompt.
        commit_confidence: ``[B, L]``, ``c_s[i]`` at each token's commit step; 0 on the prompt.
        step_gain: ``[B, S]``, ``sum_{j in U_s} (c_{s+1}[j] - c_s[j])`` (0 at the last step).
        attention_mask: long ``[B, L]`` (0 on left padding), or None when ``generate`` got no
            ``prompt_mask``; pass it to the model for any later forward on these sequences.
        prompt_length: ``P``.
        nfe: the number of backbone calls made.
        branches: one :class:`BranchState` per requested branch step, in step order.
        mask_id: the model's mask id.

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

    @property
    def completion_mask(self) -> Tensor:
        """bool ``[B, L]``: the generated region, every position the sampler committed (the last
        ``G`` columns; the padding after an end-of-sequence token included). Pass it as the
        estimators' ``completion_mask``: the positions they mask."""
        return self.commit_step >= 0

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
    """bool ``[..., L]``: the positions of ``completion_mask`` (bool, shaped like ``sequences``)
    up to and including the first ``eos_id`` of ``sequences`` (long ``[..., L]``) within them, each
    row's whole completion when it has none. :meth:`Rollout.answer_mask` of a rollout; of
    :func:`branch` fillings, ``answer_mask(fills.sequences, rollout.completion_mask, eos_id)``."""
    eos_id = check_int(eos_id, "eos_id", low=0)
    check_tensor(sequences, "sequences", min_ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(completion_mask, "completion_mask", min_ndim=1, dtypes=(torch.bool,))
    if completion_mask.shape[-1] != sequences.shape[-1] or completion_mask.device != sequences.device:
        raise ValueError(f"completion_mask must have the last dimension and device of sequences, got "
                         f"{tuple(completion_mask.shape)} on {completion_mask.device} for {tuple(sequences.shape)} on "
                         f"{sequences.device}")
    is_eos = completion_mask & (sequences == eos_id)
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return completion_mask & (eos_before == 0)


@dataclass(frozen=True)
class Branch:
    """``Z`` fillings of one cached state, from :func:`branch`.

    Attributes:
        step: the step of the state.
        state: long ``[B, L]``, the state's sequences (``mask_id`` where ``filled``).
        filled: bool ``[B, L]``, the positions every filling filled (the state's masked positions).
        sequences: long ``[Z, B, L]``, the completed sequences (equal to ``state`` outside ``filled``).
        old_logprob: ``[Z, B, L]``, each filled token's cached log-probability under the model
            (softmax of the raw logits, mask id excluded; not the top-k, tempered distribution it
            was drawn from); 0 elsewhere.
        attention_mask: the rollout's attention mask (long ``[B, L]``) or None.
    """

    step: int
    state: Tensor
    filled: Tensor
    sequences: Tensor
    old_logprob: Tensor
    attention_mask: Tensor | None


def _check_prompt_mask(prompt_mask, prompt_ids: Tensor, shift: bool) -> Tensor | None:
    if prompt_mask is None:
        if shift and prompt_ids.shape[1] == 0:
            raise ValueError("prompt_ids must have at least one column for a shift=True model (position i is predicted from i - 1)")
        return None
    check_tensor(prompt_mask, "prompt_mask", ndim=2, dtypes=(torch.bool,) + INDEX_DTYPES)
    if prompt_mask.device != prompt_ids.device:
        raise ValueError(f"prompt_mask is on {prompt_mask.device} but prompt_ids is on {prompt_ids.device}")
    check_shape(prompt_mask, "prompt_mask", prompt_ids.shape, "[B, P] (from prompt_ids)")
    if prompt_mask.dtype != torch.bool:
        if bool(((prompt_mask != 0) & (prompt_mask != 1)).any()):
            raise ValueError("prompt_mask must hold only 0 and 1 (1 = prompt token, 0 = padding)")
        prompt_mask = prompt_mask != 0
    if bool((prompt_mask[:, 1:].long() < prompt_mask[:, :-1].long()).any()):
        raise ValueError("prompt_mask must describe left padding: in each row, padding (False) only before the prompt")
    if shift and (prompt_mask.shape[1] == 0 or not bool(prompt_mask[:, -1].all())):
        raise ValueError("prompt_mask must leave at least one prompt token per row for a shift=True model")
    return prompt_mask


def _check_branch_steps(branch_steps, steps: int) -> list[int]:
    if branch_steps is None:
        return []
    if isinstance(branch_steps, (int, Tensor)) or not isinstance(branch_steps, Iterable):
        raise TypeError(f"branch_steps must be an iterable of ints or None, got {type(branch_steps).__name__}")
    chosen = sorted({check_int(s, "branch_steps", low=0, high=steps) for s in branch_steps})
    return chosen


def generate(
    lm: MaskedLM,
    prompt_ids: Tensor,
    *,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    seed: int,
    prompt_mask: Tensor | None = None,
    branch_steps: Iterable[int] | None = None,
    branch_topk: int | None = DEFAULT_BRANCH_TOPK,
    chunk_size: int | None = None,
    row_offset: int = 0,
) -> Rollout:
    """Sample completions with LLaDA's block-wise remasking and record what DPS and DiSPO need.

    Args:
        lm: the model (:class:`daca_kernels.MaskedLM`); it is called under ``torch.no_grad()`` and
            its train/eval mode is left as it is (use eval mode for reproducible samples).
        prompt_ids: int64/int32 ``[B, P]`` ids in ``[0, V)``, none equal to ``lm.mask_id``; rows
            of different prompt lengths are left padded (any non-mask id as padding).
        gen_length: ``G`` > 0, a multiple of ``block_length``.
        steps: ``S`` > 0, a multiple of the number of blocks ``G / block_length``.
        block_length: > 0.
        temperature: float >= 0: Gumbel-max sampling at this temperature, argmax at 0.
        remasking: ``"low_confidence"`` or ``"random"``. With ``"random"`` the commit order uses
            uniform scores, while ``commit_confidence`` and ``step_gain`` still use the model's
            confidence.
        seed: int in ``[0, 2**64)``.
        prompt_mask: bool (or 0/1 int) ``[B, P]``, True on prompt tokens and False on left padding;
            None when no row is padded. The backbone then gets the attention mask
            ``[prompt_mask, ones(G)]`` (the model's own position handling applies).
        branch_steps: steps (in ``[0, S)``) whose state to keep for :func:`branch`, or None.
        branch_topk: tokens kept per masked position at a branch step (capped at ``V - 1``, every
            token except the mask id; None keeps them all, which is exact).
        chunk_size: rows per head chunk in :func:`daca_kernels.sample_step_linear`, or None.
        row_offset: global index of row 0 of this call, for sharded batches: noise and random
            remasking scores depend on ``(seed, step, (row_offset + b) * L + position)``, so the
            call on ``prompt_ids[a:c]`` with ``row_offset=a`` samples rows ``a:c`` of the call on
            the whole batch. An int >= 0 with ``(row_offset + B) * L <= 2**32``.

    Returns:
        A :class:`Rollout`.
    """
    if not isinstance(lm, MaskedLM):
        raise TypeError(f"lm must be a daca_kernels.MaskedLM, got {type(lm).__name__}")
    check_tensor(prompt_ids, "prompt_ids", ndim=2, dtypes=INDEX_DTYPES)
    if prompt_ids.device != lm.device:
        raise ValueError(f"prompt_ids is on {prompt_ids.device} but lm is on {lm.device}")
    if prompt_ids.shape[0] == 0:
        raise ValueError("prompt_ids must have at least one row (B > 0)")
    check_index_range(prompt_ids, lm.vocab_size, "prompt_ids")
    if bool((prompt_ids == lm.mask_id).any()):
        where = tuple((prompt_ids == lm.mask_id).nonzero()[0].tolist())
        raise ValueError(f"prompt_ids must not contain mask_id = {lm.mask_id} (found at {where}); pad with another id")
    check_int(gen_length, "gen_length", low=1)
    check_int(steps, "steps", low=1)
    check_int(block_length, "block_length", low=1)
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be divisible by block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(
            f"steps ({steps}) must be divisible by the number of blocks gen_length / block_length = {num_blocks}"
        )
    temperature = check_nonnegative_float(temperature, "temperature")
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {', '.join(REMASKING)}, got {remasking!r}")
    seed32(seed)
    row_offset = check_row_offset(row_offset, prompt_ids.shape[0], positions=prompt_ids.shape[1] + gen_length)
    prompt_mask = _check_prompt_mask(prompt_mask, prompt_ids, lm.shift)
    chosen_branch_steps = _check_branch_steps(branch_steps, steps)
    candidates = lm.vocab_size - 1
    if branch_topk is None:
        branch_topk = candidates
    else:
        branch_topk = min(check_int(branch_topk, "branch_topk", low=1), candidates)

    with torch.no_grad():
        return _sample(
            lm, prompt_ids.long(), gen_length, steps, block_length, temperature, remasking, seed,
            prompt_mask, chosen_branch_steps, branch_topk, chunk_size, row_offset,
        )


def _sample(lm, prompt_ids, gen_length, steps, block_length, temperature, remasking, seed, prompt_mask,
            branch_steps, branch_topk, chunk_size, row_offset) -> Rollout:
    device, mask_id = lm.device, lm.mask_id
    batch, prompt_length = prompt_ids.shape
    length = prompt_length + gen_length
    steps_per_block = steps // (gen_length // block_length)
    schedule = transfer_counts(block_length, steps_per_block)
    acc = accumulation_dtype(lm.head_weight.dtype)

    x = torch.full((batch, length), mask_id, dtype=torch.long, device=device)
    x[:, :prompt_length] = prompt_ids
    masked = torch.zeros(batch, length, dtype=torch.bool, device=device)
    masked[:, prompt_length:] = True
    attention_mask = None
    if prompt_mask is not None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
        attention_mask[:, :prompt_length] = prompt_mask.long()
    commit_step = torch.full((batch, length), -1, dtype=torch.long, device=device)
    commit_confidence = torch.zeros(batch, length, dtype=acc, device=device)
    step_gain = torch.zeros(batch, steps, dtype=acc, device=device)
    current = torch.zeros(batch, length, dtype=acc, device=device)
    previous = torch.zeros_like(current)
    rows = torch.arange(batch, device=device)[:, None]
    branches = []
    input_changed, nfe = True, 0

    for step in range(steps):
        start = prompt_length + (step // steps_per_block) * block_length
        num_commits = schedule[step % steps_per_block]
        if input_changed:
            hidden = lm.hidden(x, attention_mask)
            nfe += 1
            b_idx, pos = masked.nonzero(as_tuple=True)
            hidden_rows = hidden[b_idx, pos - 1 if lm.shift else pos]
            row_ids = (row_offset + b_idx) * length + pos
            del hidden
        # Without noise an unchanged input gives the same candidates and confidences as before.
        if input_changed or temperature > 0:
            candidate, confidence = sample_step_linear(
                hidden_rows, lm.head_weight, bias=lm.head_bias, temperature=temperature, seed=seed, step=step,
                row_ids=row_ids, mask_id=mask_id, chunk_size=chunk_size,
            )
            if bool(torch.isnan(confidence).any()):
                raise ValueError(f"lm produced NaN logits at step {step}")

        # DPS: c_step of every masked position; the positions masked now are U_{step - 1}.
        current[b_idx, pos] = confidence
        if step > 0:
            step_gain[:, step - 1] = confidence_delta(current, previous, masked)
        current, previous = previous, current

        if step in branch_steps:
            token_ids, logprobs = linear_topk_logprob(
                hidden_rows, lm.head_weight, k=branch_topk, bias=lm.head_bias, mask_id=mask_id, chunk_size=chunk_size
            )
            branches.append(BranchState(step, x.clone(), masked.clone(), token_ids, logprobs))

        if num_commits:
            in_block = ((pos >= start) & (pos < start + block_length)).nonzero().squeeze(1)
            ib, ip = b_idx[in_block], pos[in_block] - start
            if remasking == "random":
                score_values = remasking_uniforms(seed, step, row_ids[in_block]).to(acc)
            else:
                score_values = confidence[in_block]
            score = torch.full((batch, block_length), float("-inf"), dtype=acc, device=device)
            score[ib, ip] = score_values
            block_candidate = torch.zeros(batch, block_length, dtype=torch.long, device=device)
            block_candidate[ib, ip] = candidate[in_block]
            block_confidence = torch.zeros(batch, block_length, dtype=acc, device=device)
            block_confidence[ib, ip] = confidence[in_block]
            # Stable descending sort: among equal scores the lowest position comes first.
            chosen = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :num_commits]
            x[rows, start + chosen] = block_candidate.gather(1, chosen)
            masked[rows, start + chosen] = False
            commit_step[rows, start + chosen] = step
            commit_confidence[rows, start + chosen] = block_confidence.gather(1, chosen)
        input_changed = num_commits > 0

    return Rollout(
        sequences=x,
        commit_step=commit_step,
        commit_confidence=commit_confidence,
        step_gain=step_gain,
        attention_mask=attention_mask,
        prompt_length=prompt_length,
        nfe=nfe,
        branches=tuple(branches),
        mask_id=mask_id,
    )


def branch(
    rollout: Rollout, index: int, num_fillings: int, *, seed: int, temperature: float = 1.0, row_offset: int = 0
) -> Branch:
    """Resample every masked position of a cached state ``num_fillings`` times, with no model call.

    Filling z of masked position j (row b) is the Gumbel-max sample at ``temperature`` over the
    cached top-k log-probabilities (:func:`daca_kernels.sample_step` with step ``z`` and row id
    ``(row_offset + b) * L + j``), i.e. a draw from ``softmax(logprobs / temperature)`` restricted
    to the cached tokens (the exact model distribution when the cache kept every token);
    ``temperature=0`` gives the most probable token in every filling.

    Args:
        rollout: a :class:`Rollout` generated with ``branch_steps``.
        index: which of ``rollout.branches`` (0-based, in step order).
        num_fillings: ``Z`` >= 1.
        seed: int in ``[0, 2**64)``; use a different seed for every branching of the same rollout.
        temperature: float >= 0.
        row_offset: global index of row 0 of the rollout's batch, for sharded batches (pass the
            value given to :func:`generate`); the noise depends on ``(seed, z, (row_offset + b) * L
            + position)``. An int >= 0 with ``(row_offset + B) * L <= 2**32``.

    Returns:
        A :class:`Branch` with ``sequences [Z, B, L]``.
    """
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a Rollout, got {type(rollout).__name__}")
    if not rollout.branches:
        raise ValueError("rollout has no cached states: generate it with branch_steps")
    check_int(index, "index", low=0, high=len(rollout.branches))
    check_int(num_fillings, "num_fillings", low=1)
    temperature = check_nonnegative_float(temperature, "temperature")
    seed32(seed)

    state = rollout.branches[index]
    batch, length = state.sequences.shape
    row_offset = check_row_offset(row_offset, batch, positions=length)
    b_idx, pos = state.masked.nonzero(as_tuple=True)
    row_ids = (row_offset + b_idx) * length + pos
    sequences = state.sequences.expand(num_fillings, batch, length).clone()
    old_logprob = torch.zeros(num_fillings, batch, length, dtype=state.logprobs.dtype, device=state.logprobs.device)
    for z in range(num_fillings):
        column, _ = sample_step(state.logprobs, temperature=temperature, seed=seed, step=z, row_ids=row_ids)
        sequences[z, b_idx, pos] = state.token_ids.gather(1, column[:, None]).squeeze(1)
        old_logprob[z, b_idx, pos] = state.logprobs.gather(1, column[:, None]).squeeze(1)
    return Branch(
        step=state.step,
        state=state.sequences,
        filled=state.masked,
        sequences=sequences,
        old_logprob=old_logprob,
        attention_mask=rollout.attention_mask,
    )
