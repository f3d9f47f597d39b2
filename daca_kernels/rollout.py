"""The denoising sampler: LLaDA's block-wise remasking, with online DPS bookkeeping and branch states.

:func:`generate` decodes a completion of ``G`` tokens after a (left-padded) prompt of ``P``
tokens, so sequences have ``L = P + G`` positions. The completion is cut into blocks of
``block_length`` decoded left to right, each over ``steps / num_blocks`` steps. At every step
each still-masked position (in every block) gets a candidate and a confidence from
:func:`daca_kernels.sample_step_linear` on its hidden row, so full ``[B, L, V]`` logits are never
formed. Then the ``k`` still-masked positions up to the end of the current block with the highest
score are committed, ``k`` from an even split of the block's mask count over its steps with the
remainder going to the first steps (LLaDA's schedule); ties go to the lowest position. The score
is the confidence (``remasking="low_confidence"``) or a uniform number from the counter hash
(``"random"``). Committed tokens never change.

The candidate rule. By default (``mask_candidate="exclude"``) the mask id is never a candidate:
its logit counts as ``-inf`` for both the candidate and the confidence, so every commit writes a
real token and the positions still masked are exactly those of the current and later blocks.
``mask_candidate="llada"`` is the rule of LLaDA's released ``generate.py``: the mask id competes
like any token and stays in the confidence's softmax; committing it leaves the position masked, so
it is predicted again at the next steps and competes, up to the end of the current block, with the
block's own positions, and may still be a hole in the finished sequence. The released options
``cfg_scale``, ``logits_eos_inf`` and ``confidence_eos_eot_inf`` are available under either rule
(see :func:`generate`). With the same uniforms for the Gumbel noise and the random remasking score,
``mask_candidate="llada"`` and these options give LLaDA's tokens (``tests/test_llada_sampler.py``
holds them to a plain re-implementation of the released code, token for token).

Noise identity: position ``j`` of row ``b`` is row id ``(row_offset + b) * L + j`` at global step
``s``, where ``row_offset`` (default 0) is the index of the call's row 0 in the global batch, so a
position's noise depends neither on which other positions are still masked nor on the batch size
nor on how the batch is sharded across processes. :func:`daca_kernels.reference.reference_generate`
is the plain sampler this one reproduces under the default rule.

What the Denoising Progress Scores (:mod:`daca_kernels.credit`) need is recorded online:
``commit_step``, ``commit_confidence`` and ``step_gain[b, s] = sum_{j in U_s} (c_{s+1}[j] - c_s[j])``,
where ``U_s`` are the positions still masked after step s commits. Only the previous step's
confidences are kept (two dense ``[B, L]`` buffers, swapped each step) and the sum is
:func:`daca_kernels.confidence_delta`.

Model calls: a step that follows a step which committed nothing sees the same input and reuses the
previous hidden rows instead of running the backbone (RADD's caching), and at temperature 0 also the
previous candidates and confidences (only the noise, which depends on the step, could change them);
``Rollout.nfe`` counts the backbone calls (two per step with ``cfg_scale > 0``). Every row commits
the same number of tokens at every step (each block starts fully masked), so the whole batch either
changes or does not.

Branching (DiSPO): at ``branch_steps`` the state (the step's input and its masked positions) is kept
with the ``branch_topk`` most probable tokens other than the mask id of every masked position and
their log-probabilities under the model's softmax (mask id included, as
:func:`daca_kernels.likelihood.branch_logprob` computes them, so a filling's cached log-probability
is the policy's own); :func:`branch` resamples all masked positions of such a state from that cache
with no model call. The cache is the model's distribution at the state whatever the candidate rule
and options (the conditional pass under ``cfg_scale``). Full logits would take ``N * V`` floats per
state (V = 126,464 for LLaDA); the top k take ``N * k`` ids and floats, and ``branch_topk=None``
keeps every token but the mask id, which makes the cache exact.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.hashing import seed32
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.ops import confidence_delta, linear_logprob, linear_topk_logprob, sample_step, sample_step_linear
from daca_kernels.ops.gather_logprob import accumulation_dtype
from daca_kernels.ops.validation import (
    INDEX_DTYPES,
    check_bool,
    check_index_range,
    check_int,
    check_nonnegative_float,
    check_row_offset,
    check_same_device,
    check_shape,
    check_tensor,
)
from daca_kernels.remasking import remasking_uniforms, transfer_counts

REMASKING = ("low_confidence", "random")
MASK_CANDIDATES = ("exclude", "llada")
DEFAULT_BRANCH_TOPK = 64
# Token ids are int64: an id at or past this cannot occur in a sequence.
_ID_LIMIT = 1 << 63


@dataclass(frozen=True)
class BranchState:
    """A denoising state kept for branching: the input of step ``step`` and its cached distribution.

    Attributes:
        step: the global step (``0 <= step < S``).
        sequences: long ``[B, L]``, the input of that step (``mask_id`` at the masked positions).
        masked: bool ``[B, L]``, the positions still masked at the start of the step.
        token_ids: long ``[N, k]``, for each masked position (rows in ``masked.nonzero()`` order,
            i.e. by row then position) the ``k`` most probable tokens other than the mask id, most
            probable first.
        logprobs: ``[N, k]`` float32 (float64 for a float64 model): their log-probabilities under
            ``softmax(logits)`` of the model's raw logits, mask id included (no temperature), i.e.
            :func:`daca_kernels.likelihood.branch_logprob`'s value for that token at the state.
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
        sequences: long ``[B, L]``, prompt (as given, padding included) then completion. Under
            ``mask_candidate="llada"`` a completion position may still hold the mask id.
        commit_step: long ``[B, L]``, the step that committed each completion token; -1 on the
            prompt (and on a position left masked under ``mask_candidate="llada"``).
        commit_confidence: ``[B, L]``, ``c_s[i]`` at each token's commit step; 0 where
            ``commit_step`` is -1.
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
            the ``[Z, B, L]`` fillings of :func:`branch`), on the same device.
        eos_id: int in ``[0, 2**63)``.

    :meth:`Rollout.answer_mask` of a rollout; of :func:`branch` fillings,
    ``answer_mask(fills.sequences, rollout.completion_mask, eos_id)`` (or ``fills.fillings`` with
    ``rollout.completion_mask.repeat_interleave(Z, dim=0)``)."""
    check_tensor(sequences, "sequences", min_ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(completion_mask, "completion_mask", min_ndim=1, dtypes=(torch.bool,))
    eos_id = check_int(eos_id, "eos_id", low=0, high=_ID_LIMIT)
    check_same_device(sequences, "sequences", completion_mask=completion_mask)
    trailing = tuple(sequences.shape[sequences.dim() - completion_mask.dim():])
    if completion_mask.dim() > sequences.dim() or tuple(completion_mask.shape) != trailing:
        raise ValueError(f"completion_mask must have the shape of sequences {tuple(sequences.shape)} or of its last "
                         f"dimensions, got {tuple(completion_mask.shape)}")
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
        old_logprob: ``[Z, B, L]``, each filled token's cached log-probability under the model's
            softmax (mask id included; not the top-k, tempered distribution it was drawn from), the
            value :func:`daca_kernels.likelihood.branch_logprob` gives on-policy; 0 elsewhere.
        attention_mask: the rollout's attention mask (long ``[B, L]``) or None.

    The consumers (:func:`daca_kernels.likelihood.branch_logprob`,
    :func:`daca_kernels.dispo_step_loss`) take ``R = B * Z`` rows grouped by state, row ``b * Z + z``
    being filling z of state b: :attr:`fillings`, :attr:`fillings_filled` and
    :attr:`fillings_old_logprob` give that layout (``sequences.reshape(-1, L)`` does not: it puts
    the rows in ``z * B + b`` order).
    """

    step: int
    state: Tensor
    filled: Tensor
    sequences: Tensor
    old_logprob: Tensor
    attention_mask: Tensor | None

    @property
    def num_fillings(self) -> int:
        """``Z``."""
        return self.sequences.shape[0]

    @property
    def fillings(self) -> Tensor:
        """long ``[B * Z, L]``: row ``b * Z + z`` is ``sequences[z, b]``."""
        return self.sequences.transpose(0, 1).flatten(0, 1)

    @property
    def fillings_filled(self) -> Tensor:
        """bool ``[B * Z, L]``: the filled positions of each row of :attr:`fillings`."""
        return self.filled.repeat_interleave(self.num_fillings, dim=0)

    @property
    def fillings_old_logprob(self) -> Tensor:
        """``[B * Z, L]``: :attr:`old_logprob` in the layout of :attr:`fillings` (``old_logp`` of
        :func:`daca_kernels.dispo_step_loss`)."""
        return self.old_logprob.transpose(0, 1).flatten(0, 1)


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


@dataclass(frozen=True)
class _CandidateRule:
    """How a step turns hidden rows into candidates and confidences (see :func:`generate`).

    Attributes:
        excluded: the id ``sample_step_linear`` leaves out of both (the mask id), or None.
        candidate_bias: the head bias of the candidate's logits (``-inf`` at the EOS id under
            ``logits_eos_inf``), ``[V]`` in the head's dtype, or None.
        confidence_bias: None when the confidence is the candidate's softmax probability; else the
            head bias of the confidence's own softmax (``-inf`` at every id it leaves out).
        cfg_scale: the classifier-free guidance scale (0: none).
    """

    excluded: int | None
    candidate_bias: Tensor | None
    confidence_bias: Tensor | None
    cfg_scale: float


def _bias_without(lm: MaskedLM, ids: list[int]) -> Tensor | None:
    """The head bias with ``-inf`` at ``ids`` (a zero bias when the head has none); the head's own
    bias (or None) when ``ids`` is empty."""
    if not ids:
        return lm.head_bias
    if lm.head_bias is None:
        bias = torch.zeros(lm.vocab_size, dtype=lm.head_weight.dtype, device=lm.device)
    else:
        bias = lm.head_bias.detach().clone()
    bias[torch.tensor(ids, device=lm.device)] = float("-inf")
    return bias


def _check_token_id(value, name: str, vocab: int) -> int | None:
    return None if value is None else check_int(value, name, low=0, high=vocab)


def _candidate_rule(lm: MaskedLM, temperature: float, mask_candidate, cfg_scale, logits_eos_inf,
                    confidence_eos_eot_inf, eos_id, eot_id) -> _CandidateRule:
    if not isinstance(mask_candidate, str) or mask_candidate not in MASK_CANDIDATES:
        raise ValueError(f"mask_candidate must be one of {', '.join(MASK_CANDIDATES)}, got {mask_candidate!r}")
    cfg_scale = check_nonnegative_float(cfg_scale, "cfg_scale")
    check_bool(logits_eos_inf, "logits_eos_inf")
    check_bool(confidence_eos_eot_inf, "confidence_eos_eot_inf")
    eos_id = _check_token_id(eos_id, "eos_id", lm.vocab_size)
    eot_id = _check_token_id(eot_id, "eot_id", lm.vocab_size)
    if (logits_eos_inf or confidence_eos_eot_inf) and eos_id is None:
        flag = "logits_eos_inf" if logits_eos_inf else "confidence_eos_eot_inf"
        raise ValueError(f"eos_id must be given with {flag}=True (the model's end-of-sequence id)")
    if confidence_eos_eot_inf and eot_id is None:
        raise ValueError("eot_id must be given with confidence_eos_eot_inf=True (the model's end-of-turn id)")

    excluded = lm.mask_id if mask_candidate == "exclude" else None
    never_proposed = [eos_id] if logits_eos_inf else []
    confidence_bias = None
    if confidence_eos_eot_inf:
        # The released code writes -inf at EOT in the logits and at EOS in the noisy logits, after
        # the argmax; at temperature 0 the noisy logits are the logits themselves, so there EOS
        # leaves the confidence's softmax too.
        dropped = never_proposed + [eot_id] + ([eos_id] if temperature == 0 else [])
        confidence_bias = _bias_without(lm, dropped + ([] if excluded is None else [excluded]))
    return _CandidateRule(excluded, _bias_without(lm, never_proposed), confidence_bias, cfg_scale)


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
    mask_candidate: str = "exclude",
    cfg_scale: float = 0.0,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    eos_id: int | None = None,
    eot_id: int | None = None,
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
        mask_candidate: ``"exclude"`` (default) or ``"llada"``. ``"exclude"``: the mask id is never
            a candidate and its logit counts as ``-inf`` in the confidence's softmax too.
            ``"llada"``: LLaDA's released rule, the mask id competes like any token and stays in
            the softmax. The default is kept because a committed mask id leaves a hole: the
            position is masked again, competes with the current block's positions for the
            block's commits, and may stay masked in the returned sequence (with ``commit_step``
            -1), where a reward reads the mask token and the likelihood estimators score it.
        cfg_scale: float >= 0, LLaDA's classifier-free guidance: a second backbone pass on the
            input with every prompt column (padding included) replaced by the mask id, and the
            candidate and confidence read from ``un + (cfg_scale + 1) * (cond - un)`` (formed on
            the head's input, the head being affine). 0: no second pass.
        logits_eos_inf: LLaDA's option of that name: ``eos_id``'s logit counts as ``-inf`` for
            the candidate and the confidence (the model never proposes EOS).
        confidence_eos_eot_inf: LLaDA's option of that name as released: ``eot_id`` leaves the
            confidence's softmax (the candidate is drawn as before; an EOT candidate gets
            confidence 0, so it is committed after the block's other positions), and at
            temperature 0 ``eos_id`` leaves it as well (at a temperature > 0 the released code's
            write to EOS lands on the noisy copy of the logits after the draw and has no effect).
        eos_id, eot_id: the model's end-of-sequence and end-of-turn ids in ``[0, V)`` (126081 and
            126348 for LLaDA-8B-Instruct), needed by the two options above; None otherwise.

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
    rule = _candidate_rule(lm, temperature, mask_candidate, cfg_scale, logits_eos_inf, confidence_eos_eot_inf,
                           eos_id, eot_id)

    with torch.no_grad():
        return _sample(
            lm, prompt_ids.long(), gen_length, steps, block_length, temperature, remasking, seed,
            prompt_mask, chosen_branch_steps, branch_topk, chunk_size, row_offset, rule,
        )


def _hidden_rows(lm: MaskedLM, x: Tensor, attention_mask: Tensor | None, b_idx: Tensor, pos: Tensor) -> Tensor:
    """``[N, H]``: the hidden rows that predict positions ``(b_idx, pos)`` of ``x`` (one backbone call)."""
    return lm.hidden(x, attention_mask)[b_idx, pos - 1 if lm.shift else pos]


def _propose(lm: MaskedLM, rule: _CandidateRule, rows: Tensor, temperature: float, seed: int, step: int,
             row_ids: Tensor, chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """Candidates (long ``[N]``) and confidences (``[N]``, accumulation dtype) of ``rows`` under ``rule``."""
    candidate, confidence = sample_step_linear(
        rows, lm.head_weight, bias=rule.candidate_bias, temperature=temperature, seed=seed, step=step,
        row_ids=row_ids, mask_id=rule.excluded, chunk_size=chunk_size,
    )
    if rule.confidence_bias is not None:
        logprob = linear_logprob(rows, lm.head_weight, candidate, bias=rule.confidence_bias, chunk_size=chunk_size)
        confidence = logprob.exp()
    return candidate, confidence


def _branch_cache(lm: MaskedLM, rows: Tensor, k: int, chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """The ``k`` most probable tokens other than the mask id of each row (long ``[N, k]``) and their
    log-probabilities under the full softmax, mask id included (``[N, k]``)."""
    ids, logprobs = linear_topk_logprob(
        rows, lm.head_weight, k=min(k + 1, lm.vocab_size), bias=lm.head_bias, chunk_size=chunk_size
    )
    # Each row drops one of its k + 1 tokens: the mask id where it made the list, else the last.
    drop = ids == lm.mask_id
    drop[:, -1] |= ~drop.any(dim=1)
    keep = ~drop
    return ids[keep].view(-1, k), logprobs[keep].view(-1, k)


def _sample(lm, prompt_ids, gen_length, steps, block_length, temperature, remasking, seed, prompt_mask,
            branch_steps, branch_topk, chunk_size, row_offset, rule: _CandidateRule) -> Rollout:
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
        end = prompt_length + (step // steps_per_block + 1) * block_length
        num_commits = schedule[step % steps_per_block]
        if input_changed:
            b_idx, pos = masked.nonzero(as_tuple=True)
            row_ids = (row_offset + b_idx) * length + pos
            hidden_rows = _hidden_rows(lm, x, attention_mask, b_idx, pos)
            sampled_rows = hidden_rows
            nfe += 1
            if rule.cfg_scale > 0:
                unconditional = x.clone()
                unconditional[:, :prompt_length] = mask_id
                un_rows = _hidden_rows(lm, unconditional, attention_mask, b_idx, pos)
                sampled_rows = (rule.cfg_scale + 1) * hidden_rows - rule.cfg_scale * un_rows
                nfe += 1
        # Without noise an unchanged input gives the same candidates and confidences as before.
        if input_changed or temperature > 0:
            candidate, confidence = _propose(lm, rule, sampled_rows, temperature, seed, step, row_ids, chunk_size)
            if bool(torch.isnan(confidence).any()):
                raise ValueError(f"lm produced NaN logits at step {step}")

        # DPS: c_step of every masked position; the positions masked now are U_{step - 1}.
        current[b_idx, pos] = confidence
        if step > 0:
            step_gain[:, step - 1] = confidence_delta(current, previous, masked)
        current, previous = previous, current

        if step in branch_steps:
            token_ids, logprobs = _branch_cache(lm, hidden_rows, branch_topk, chunk_size)
            branches.append(BranchState(step, x.clone(), masked.clone(), token_ids, logprobs))

        if num_commits:
            # Every masked position up to the block's end competes: under the default rule these are
            # the block's own; under "llada" also the holes a committed mask id left in earlier blocks.
            eligible = (pos < end).nonzero().squeeze(1)
            eb, ep = b_idx[eligible], pos[eligible] - prompt_length
            if remasking == "random":
                score_values = remasking_uniforms(seed, step, row_ids[eligible]).to(acc)
            else:
                score_values = confidence[eligible]
            width = end - prompt_length
            score = torch.full((batch, width), float("-inf"), dtype=acc, device=device)
            score[eb, ep] = score_values
            window_candidate = torch.zeros(batch, width, dtype=torch.long, device=device)
            window_candidate[eb, ep] = candidate[eligible]
            window_confidence = torch.zeros(batch, width, dtype=acc, device=device)
            window_confidence[eb, ep] = confidence[eligible]
            # Stable descending sort: among equal scores the lowest position comes first.
            chosen = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :num_commits]
            tokens = window_candidate.gather(1, chosen)
            columns = prompt_length + chosen
            written = tokens != mask_id
            x[rows, columns] = tokens
            masked[rows, columns] = ~written
            commit_step[rows, columns] = torch.where(written, step, -1)
            commit_confidence[rows, columns] = torch.where(written, window_confidence.gather(1, chosen), 0.0)
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
    to the cached tokens (at temperature 1 the model's distribution given that the token is not the
    mask id, exactly when the cache kept every such token); ``temperature=0`` gives the most
    probable token in every filling. A filling never holds the mask id at a filled position.

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
        A :class:`Branch` with ``sequences [Z, B, L]``; its ``fillings``, ``fillings_filled`` and
        ``fillings_old_logprob`` (``[B * Z, L]``, grouped by state) are what
        :func:`daca_kernels.likelihood.branch_logprob` and :func:`daca_kernels.dispo_step_loss` take.
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
