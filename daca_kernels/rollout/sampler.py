"""The denoising sampler: LLaDA's block-wise remasking or Dream's sampler, with online DPS bookkeeping
and branch states. Block-causal models (SDAR, LLaDA2) are decoded block by block with a KV cache
([`daca_kernels.rollout.blockwise`][daca_kernels.rollout.blockwise], which [`generate`][daca_kernels.rollout.sampler.generate] calls
for them).

[`generate`][daca_kernels.rollout.sampler.generate] decodes a completion of ``G`` tokens after a (left-padded) prompt of ``P``
tokens, so sequences have ``L = P + G`` positions. One loop serves both rules: at every step each
still-masked position gets a candidate, a confidence and a commit score from its hidden row, then
the commit rule of [`daca_kernels.rollout.remasking`][daca_kernels.rollout.remasking] says which positions to commit; committed tokens
never change.

``rule="llada"`` (default). The completion is cut into blocks of ``block_length`` decoded left to
right, each over ``steps / num_blocks`` steps. Candidates and confidences come from
[`daca_kernels.sample_step_linear`][daca_kernels.ops.sample_step.sample_step_linear], so full ``[B, L, V]`` logits are never formed.
Then the
``k`` still-masked positions up to the end of the current block with the highest score are
committed, ``k`` from an even split of the block's mask count over its steps with the remainder
going to the first steps (LLaDA's schedule); ties go to the lowest position. The score is the
confidence (``remasking="low_confidence"``) or a uniform number from the counter hash
(``"random"``).

``rule="dream"``: the rule of ``diffusion_generate`` in Dream's released ``generation_utils.py``
(Dream-7B, DiffuCoder). One block; the candidate is drawn from the softmax of the logits divided
by the temperature and filtered by top-p then top-k (rows go through the head a chunk at a time:
the filters need a row's whole logits); the commit rule is Dream's ``alg`` over the schedule
``linspace(1, eps, steps + 1)`` ([`daca_kernels.rollout.remasking.DreamCommits`][daca_kernels.rollout.remasking.DreamCommits]).
[`generate`][daca_kernels.rollout.sampler.generate]
lists where it differs from the released code.

The candidate rule. By default (``mask_candidate="exclude"``) the mask id is never a candidate:
its logit counts as ``-inf`` for both the candidate and the confidence, so every commit writes a
real token and the positions still masked are exactly those of the current and later blocks.
``mask_candidate="llada"`` is the rule of LLaDA's released ``generate.py``: the mask id competes
like any token and stays in the confidence's softmax; committing it leaves the position masked, so
it is predicted again at the next steps and competes, up to the end of the current block, with the
block's own positions, and may still be a hole in the finished sequence; ``mask_candidate="dream"``
is the same for Dream's sampler. LLaDA's released options ``cfg_scale``, ``logits_eos_inf`` and
``confidence_eos_eot_inf`` are available under either candidate rule of ``rule="llada"`` (see
[`generate`][daca_kernels.rollout.sampler.generate]). With the same uniforms for the Gumbel noise and the random remasking score,
``mask_candidate="llada"`` and these options give LLaDA's tokens (``tests/sampler/test_llada_sampler.py``
holds them to a plain re-implementation of the released code, token for token).

Noise identity: position ``j`` of row ``b`` is row id ``(row_offset + b) * L + j`` at global step
``s``, where ``row_offset`` (default 0) is the index of the call's row 0 in the global batch, so a
position's noise depends neither on which other positions are still masked nor on the batch size
nor on how the batch is sharded across processes.
[`daca_kernels.reference.reference_generate`][daca_kernels.reference.sampling.reference_generate]
is the plain sampler this one reproduces under the default rule.

What the Denoising Progress Scores ([`daca_kernels.credit`][daca_kernels.credit]) need is recorded online:
``commit_step``, ``commit_confidence`` and ``step_gain[b, s] = sum_{j in U_s} (c_{s+1}[j] - c_s[j])``,
where ``U_s`` are the positions still masked after step s commits. Only the previous step's
confidences are kept (two dense ``[B, L]`` buffers, swapped each step) and the sum is
[`daca_kernels.confidence_delta`][daca_kernels.ops.confidence_delta].

Model calls: a step that follows a step which committed nothing sees the same input and reuses the
previous hidden rows instead of running the backbone (RADD's caching), and at temperature 0 also the
previous candidates and confidences (only the noise, which depends on the step, could change them);
``Rollout.nfe`` counts the backbone calls (two per step with ``cfg_scale > 0``) and
``Rollout.forward_tokens`` the token columns they ran. The batch is run
again after any row committed (under ``rule="llada"`` and Dream's top-k algs every row commits the
same number of positions; under ``alg="origin"`` each row its own).

Branching (DiSPO): at ``branch_steps`` the state (the step's input and its masked positions) is kept
with the ``branch_topk`` most probable tokens other than the mask id of every masked position and
their log-probabilities under the model's softmax (mask id included, as
[`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob] computes them, so a filling's cached
log-probability
is the policy's own); [`branch`][daca_kernels.rollout.sampler.branch] resamples all masked positions of such a state from that cache
with no model call. The cache is the model's distribution at the state whatever the candidate rule
and options (the conditional pass under ``cfg_scale``). Full logits would take ``N * V`` floats per
state (V = 126,464 for LLaDA); the top k take ``N * k`` ids and floats, and ``branch_topk=None``
keeps every token but the mask id, which makes the cache exact. Block-causal models keep branch
states too (their definition, with steps counted over all blocks and one extra forward per branch
step: [`daca_kernels.rollout.blockwise`][daca_kernels.rollout.blockwise]).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.hashing import seed32
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.confidence_delta import confidence_delta_unchecked
from daca_kernels.ops.linear_logprob import linear_logprob_unchecked
from daca_kernels.ops.sample_step import sample_step_linear_unchecked, sample_step_unchecked
from daca_kernels.ops.shared import chunk_rows
from daca_kernels.precision import accumulation_dtype
from daca_kernels.rollout import fast_decoding
from daca_kernels.rollout.blockwise import decode_blockwise
from daca_kernels.rollout.branch_states import (
    DEFAULT_BRANCH_TOPK,
    BranchState,
    check_branch_steps,
    check_branch_topk,
    topk_cache,
)
from daca_kernels.rollout.logit_filters import top_k_filter, top_p_filter
from daca_kernels.rollout.prefix_cache import CACHE_MODES, full_backbone
from daca_kernels.rollout.record import Decoding, Rollout
from daca_kernels.rollout.remasking import DREAM_ALGS, BlockCommits, DreamCommits
from daca_kernels.rollout.rules import RULE_OPTIONS, BlockSampler, DreamSampler, LLaDASampler, sampler_keywords
from daca_kernels.validation import (
    INDEX_DTYPES,
    check_bool,
    check_choice,
    check_index_range,
    check_int,
    check_nonnegative_float,
    check_not_nan,
    check_positive_float,
    check_row_offset,
    check_sequence_length,
    check_shape,
    check_tensor,
)

RULES = ("llada", "dream")
REMASKING = ("low_confidence", "random")
MASK_CANDIDATES = ("exclude", "llada", "dream")


@dataclass(frozen=True)
class Branch:
    """``Z`` fillings of one cached state, from [`branch`][daca_kernels.rollout.sampler.branch].

    Attributes:
        step: the step of the state.
        state: long ``[B, L]``, the state's sequences (``mask_id`` where ``filled``).
        filled: bool ``[B, L]``, the positions every filling filled (the state's masked positions).
        sequences: long ``[Z, B, L]``, the completed sequences (equal to ``state`` outside ``filled``).
        old_logprob: ``[Z, B, L]``, each filled token's cached log-probability under the model's
            softmax (mask id included; not the top-k, tempered distribution it was drawn from), the
            value [`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob] gives on-policy; 0 elsewhere.
        attention_mask: the rollout's attention mask (long ``[B, L]``) or None.

    The consumers ([`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob],
    [`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss]) take ``R = B * Z`` rows grouped by state, row ``b * Z + z``
    being filling z of state b: [`fillings`][daca_kernels.rollout.sampler.Branch.fillings],
    [`fillings_filled`][daca_kernels.rollout.sampler.Branch.fillings_filled] and
    [`fillings_old_logprob`][daca_kernels.rollout.sampler.Branch.fillings_old_logprob] give that layout (``sequences.reshape(-1, L)``
    does not: it puts
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
        """bool ``[B * Z, L]``: the filled positions of each row of [`fillings`][daca_kernels.rollout.sampler.Branch.fillings]."""
        return self.filled.repeat_interleave(self.num_fillings, dim=0)

    @property
    def fillings_old_logprob(self) -> Tensor:
        """``[B * Z, L]``: [`old_logprob`][daca_kernels.rollout.sampler.Branch.old_logprob] in the layout of
        [`fillings`][daca_kernels.rollout.sampler.Branch.fillings] (``old_logp`` of
        [`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss])."""
        return self.old_logprob.transpose(0, 1).flatten(0, 1)


def _check_prompt_ids(lm: MaskedLM, prompt_ids: Tensor) -> None:
    """``prompt_ids``: int64/int32 ``[B, P]`` with ``B > 0`` on ``lm``'s device, ids in ``[0, V)``,
    none the mask id."""
    check_tensor(prompt_ids, "prompt_ids", ndim=2, dtypes=INDEX_DTYPES)
    if prompt_ids.device != lm.device:
        raise ValueError(f"prompt_ids is on {prompt_ids.device} but lm is on {lm.device}")
    if prompt_ids.shape[0] == 0:
        raise ValueError("prompt_ids must have at least one row (B > 0)")
    check_index_range(prompt_ids, lm.vocab_size, "prompt_ids")
    if bool((prompt_ids == lm.mask_id).any()):
        where = tuple((prompt_ids == lm.mask_id).nonzero()[0].tolist())
        raise ValueError(f"prompt_ids must not contain mask_id = {lm.mask_id} (found at {where}); pad with another id")


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


@dataclass(frozen=True)
class _CandidateRule:
    """LLaDA's candidates: how a step turns hidden rows into candidates and confidences (see
    [`generate`][daca_kernels.rollout.sampler.generate]).

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

    def propose(self, lm: MaskedLM, rows: Tensor, temperature: float, seed: int, step: int, row_ids: Tensor,
                chunk_size: int | None) -> tuple[Tensor, Tensor, Tensor]:
        """``(candidate long [N], confidence [N], score [N])`` of the hidden rows ``rows [N, H]``
        (floats in the accumulation dtype); the commit score is the confidence."""
        candidate, confidence = sample_step_linear_unchecked(
            rows, lm.head_weight, bias=self.candidate_bias, temperature=temperature, seed=seed, step=step,
            row_ids=row_ids, mask_id=self.excluded, chunk_size=chunk_size,
        )
        if self.confidence_bias is not None:
            logprob = linear_logprob_unchecked(rows, lm.head_weight, candidate, bias=self.confidence_bias,
                                               chunk_size=chunk_size)
            confidence = logprob.exp()
        return candidate, confidence, confidence


@dataclass(frozen=True)
class _DreamCandidateRule:
    """Dream's candidates (``sample_tokens`` of Dream's released ``generation_utils.py``).

    Attributes:
        excluded: the mask id (``mask_candidate="exclude"``) or None (``"dream"``: it competes).
        top_p: nucleus filter in ``(0, 1)``, or None (no filter).
        top_k: top-k filter, an int >= 1, or None.
        alg: one of [`daca_kernels.rollout.remasking.DREAM_ALGS`][daca_kernels.rollout.remasking.DREAM_ALGS], which says what the
            commit score is.
        cfg_scale: always 0 (Dream's sampler has no guidance).
    """

    excluded: int | None
    top_p: float | None
    top_k: int | None
    alg: str
    cfg_scale: float = 0.0

    def filtered_logits(self, lm: MaskedLM, rows: Tensor, temperature: float) -> Tensor:
        """The logits a candidate is drawn from, ``[n, V]`` in the accumulation dtype: the head's
        logits (computed in its dtype, as the model computes them) divided by the temperature (when
        > 0), then the top-p and top-k filters (removed tokens get ``-inf``)."""
        logits = torch.nn.functional.linear(rows, lm.head_weight, lm.head_bias)
        logits = logits.to(accumulation_dtype(lm.head_weight.dtype))
        if self.excluded is not None:
            logits[:, self.excluded] = float("-inf")
        if temperature > 0:
            logits = logits / temperature
        return top_k_filter(top_p_filter(logits, self.top_p), self.top_k)

    def propose(self, lm: MaskedLM, rows: Tensor, temperature: float, seed: int, step: int, row_ids: Tensor,
                chunk_size: int | None) -> tuple[Tensor, Tensor, Tensor]:
        """As `_CandidateRule.propose`. Rows go through the head ``chunk_size`` at a time (the
        filters need a row's whole logits). The candidate is the argmax at temperature 0, else a
        draw from ``softmax`` of `filtered_logits` (Gumbel-max with the sampler's noise); the
        confidence is its probability there; the score is that probability (``origin``,
        ``maskgit_plus``), the top-1 minus top-2 probability (``topk_margin``) or
        ``sum p log(p + 1e-10)`` (``entropy``)."""
        n = rows.shape[0]
        acc = accumulation_dtype(lm.head_weight.dtype)
        candidate = torch.empty(n, dtype=torch.long, device=rows.device)
        confidence = torch.empty(n, dtype=acc, device=rows.device)
        score = torch.empty(n, dtype=acc, device=rows.device)
        rows_per_chunk = chunk_rows(chunk_size, n)
        for lo in range(0, n, rows_per_chunk):
            hi = min(n, lo + rows_per_chunk)
            logits = self.filtered_logits(lm, rows[lo:hi], temperature)
            # The logits are already tempered: a draw at temperature 1 samples softmax(logits).
            chosen, _ = sample_step_unchecked(logits, temperature=1.0 if temperature > 0 else 0.0, seed=seed, step=step,
                                              row_ids=row_ids[lo:hi])
            probs = torch.softmax(logits, dim=1)
            candidate[lo:hi] = chosen
            confidence[lo:hi] = probs.gather(1, chosen[:, None]).squeeze(1)
            if self.alg == "topk_margin":
                top2 = torch.topk(probs, min(2, probs.shape[1]), dim=1).values
                score[lo:hi] = top2[:, 0] - top2[:, -1]
            elif self.alg == "entropy":
                score[lo:hi] = (probs * torch.log(probs + 1e-10)).sum(dim=1)
            else:
                score[lo:hi] = confidence[lo:hi]
        return candidate, confidence, score


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


def _check_mask_candidate(mask_candidate, rule: str) -> str:
    if not isinstance(mask_candidate, str) or mask_candidate not in MASK_CANDIDATES:
        raise ValueError(f"mask_candidate must be one of {', '.join(MASK_CANDIDATES)}, got {mask_candidate!r}")
    if mask_candidate not in ("exclude", rule):
        raise ValueError(f"mask_candidate={mask_candidate!r} is the rule of the {mask_candidate} sampler; with "
                         f"rule={rule!r} use 'exclude' or {rule!r}")
    return mask_candidate


def _dream_rule(lm: MaskedLM, mask_candidate: str, steps: int, alg, alg_temp, eps, top_p, top_k,
                llada_options: dict) -> tuple[_DreamCandidateRule, DreamCommits]:
    """Dream's candidate and commit rules from [`generate`][daca_kernels.rollout.sampler.generate]'s options (checked here)."""
    for name, value in llada_options.items():
        if value:
            raise ValueError(f"{name} is an option of rule='llada' (LLaDA's sampler); Dream's sampler has no "
                             f"{name}, got {value!r}")
    alg = check_choice("origin" if alg is None else alg, "alg", DREAM_ALGS)
    alg_temp = 0.0 if alg_temp is None else check_nonnegative_float(alg_temp, "alg_temp")
    eps = 1e-3 if eps is None else check_nonnegative_float(eps, "eps")
    if eps >= 1:
        raise ValueError(f"eps must lie in [0, 1) (the schedule's last time), got {eps}")
    if top_p is not None and check_positive_float(top_p, "top_p") > 1:
        raise ValueError(f"top_p must be <= 1 (1: no filter), got {top_p}")
    if top_k is not None:
        top_k = check_int(top_k, "top_k", low=1)
    excluded = lm.mask_id if mask_candidate == "exclude" else None
    candidates = _DreamCandidateRule(excluded, top_p if top_p is not None and top_p < 1 else None, top_k, alg)
    return candidates, DreamCommits(steps, eps, alg, alg_temp)


def _candidate_rule(lm: MaskedLM, temperature: float, mask_candidate, cfg_scale, logits_eos_inf,
                    confidence_eos_eot_inf, eos_id, eot_id) -> _CandidateRule:
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
    steps: int | None = None,
    seed: int,
    temperature: float = 0.0,
    sampler: LLaDASampler | DreamSampler | BlockSampler | None = None,
    prompt_mask: Tensor | None = None,
    branch_steps: Iterable[int] | None = None,
    branch_topk: int | None = DEFAULT_BRANCH_TOPK,
    chunk_size: int | None = None,
    row_offset: int = 0,
    **rule_options,
) -> Rollout:
    """Sample completions with LLaDA's block-wise remasking (``rule="llada"``) or Dream's sampler
    (``rule="dream"``) and record what DPS and DiSPO need.

    ``rule="dream"`` is the rule of ``diffusion_generate`` in the ``generation_utils.py`` that
    Dream-7B and DiffuCoder ship (see the module docstring). Given the same random numbers it gives
    the released tokens, with these differences:

    * Random numbers: the counter hash, not the global torch RNG. A token at temperature > 0 is the
      Gumbel-max draw of [`daca_kernels.sample_step`][daca_kernels.ops.sample_step] on the filtered, tempered logits (released:
      ``Categorical(probs).sample()``); ``"origin"``'s reveal draw is
      [`daca_kernels.rollout.remasking.remasking_uniforms`][daca_kernels.rollout.remasking.remasking_uniforms] (released:
      ``torch.rand``); the positions of
      ``alg_temp > 0`` are the Gumbel-top-k of ``score / alg_temp`` with noise from the same
      uniforms (released: ``torch.multinomial(softmax(score / alg_temp), k)`` without
      replacement). Each is an exact sampler of the released distribution, so the rollouts are
      equal in distribution; fed these numbers, the released code gives the same tokens
      (``tests/families/test_dream_sampler.py``).
    * Tokens are drawn for every masked position at every step (released ``"origin"``: only for
      the revealed ones); the draw of a position is the same either way.
    * With the mask id a candidate (``mask_candidate="dream"``), rows can have different masked
      counts and the per-row count ``k`` (from the batch mean) can exceed a row's: the released
      code then writes the mask id over ``k - count`` of the row's unmasked positions (prompt or
      committed tokens; which ones depends on ``torch.topk``'s order among ``-inf`` scores);
      ``generate`` commits the row's masked positions and nothing else. With the default
      ``"exclude"`` every row has the same count and this cannot happen. For the same reason a
      shard (``row_offset``) samples the rows of the whole batch only under ``"exclude"`` (or
      ``alg="origin"``, whose reveals are per position).
    * Ties: equal scores commit the lowest position first, and the top-p sort is stable (released:
      ``torch.topk``/``torch.sort``, order unspecified). With logits in bfloat16 (the released
      code computes the logits, the filters and the confidences in the model's dtype; this
      function in float32) ties are common, so equality with a bfloat16 model holds only where no
      tie or rounding decides. The schedule ``1 - s / t`` is computed on the CPU in float32 (the
      released code computes it on the model's device).
    * Model calls: a step whose input did not change reuses the last hidden rows (the released
      code calls the model at every step); ``Rollout.nfe`` counts the calls made.
    * Not available: ``generation_tokens_hook_func``, ``generation_logits_hook_func``,
      ``num_return_sequences`` (repeat the prompts), ``output_history``.

    DPS under ``rule="dream"``: ``commit_confidence`` and the ``c_s`` of ``step_gain`` are the
    candidate's probability under the distribution it is drawn from (the tempered, top-p / top-k
    filtered softmax; at temperature 0 the filtered softmax), which is what ``"maskgit_plus"``
    commits by. ``"topk_margin"`` and ``"entropy"`` commit by their own score (the top-1 minus
    top-2 probability, ``sum p log(p + 1e-10)``) and ``alg_temp`` adds noise to the order, but, as
    with LLaDA's ``remasking="random"``, the recorded confidence stays the candidate's probability:
    the DPS weights read ``1 - c`` as the uncertainty of a commit.

    Args:
        lm: the model ([`daca_kernels.MaskedLM`][daca_kernels.models.masked_lm.MaskedLM]); it is called under ``torch.no_grad()`` and
            its train/eval mode is left as it is (use eval mode for reproducible samples).
        prompt_ids: int64/int32 ``[B, P]`` ids in ``[0, V)``, none equal to ``lm.mask_id``; rows
            of different prompt lengths are left padded (any non-mask id as padding).
        gen_length: ``G`` > 0, a multiple of ``block_length``; ``P + G`` at most ``lm.max_length``
            when the model has one (a ValueError naming ``gen_length`` otherwise).
        steps: ``S`` > 0, a multiple of the number of blocks ``G / block_length`` (None with
            ``tokens_per_step``, which sets it).
        sampler: the rule and its options as one object: a [`daca_kernels.rollout.LLaDASampler`][daca_kernels.rollout.rules.LLaDASampler]
            or [`daca_kernels.rollout.DreamSampler`][daca_kernels.rollout.rules.DreamSampler] for a full-attention ``lm``, a
            [`daca_kernels.rollout.BlockSampler`][daca_kernels.rollout.rules.BlockSampler] for a block-causal one; or None, when the rule's
            options come as keywords (``**rule_options``), LLaDA's rule by default.
        **rule_options: the options of the rules as keywords, each a field of the sampler object of
            its rule (with ``rule``): the other parameters below. Not together with
            ``sampler``; an unknown keyword is a TypeError.
        temperature: float >= 0: Gumbel-max sampling at this temperature, argmax at 0. Under
            ``rule="llada"`` the confidence is the untempered probability; under ``"dream"`` the
            logits are divided by the temperature before the filters and the confidence.
        seed: int in ``[0, 2**64)``.
        prompt_mask: bool (or 0/1 int) ``[B, P]``, True on prompt tokens and False on left padding;
            None when no row is padded. The backbone then gets the attention mask
            ``[prompt_mask, ones(G)]`` (the model's own position handling applies).
        branch_steps: steps (in ``[0, S)``) whose state to keep for [`branch`][daca_kernels.rollout.sampler.branch], or None (a
            block-causal ``lm``: see below).
        branch_topk: tokens kept per masked position at a branch step (capped at ``V - 1``, every
            token except the mask id; None keeps them all, which is exact).
        chunk_size: rows per head chunk in [`daca_kernels.sample_step_linear`][daca_kernels.ops.sample_step.sample_step_linear], or None.
        row_offset: global index of row 0 of this call, for sharded batches: noise and random
            remasking scores depend on ``(seed, step, (row_offset + b) * L + position)``, so the
            call on ``prompt_ids[a:c]`` with ``row_offset=a`` samples rows ``a:c`` of the call on
            the whole batch. An int >= 0 with ``(row_offset + B) * L <= 2**32``.

    Other Parameters:
        block_length: > 0, or None for one block of ``G`` (the only choice under ``rule="dream"``).
        remasking: ``rule="llada"`` only: ``"low_confidence"`` or ``"random"``. With ``"random"`` the commit order uses
            uniform scores, while ``commit_confidence`` and ``step_gain`` still use the model's
            confidence.
        mask_candidate: ``"exclude"`` (default), ``"llada"`` (with ``rule="llada"``) or ``"dream"``
            (with ``rule="dream"``). ``"exclude"``: the mask id is never a candidate and its logit
            counts as ``-inf`` in the confidence's softmax too. ``"dream"``: the released rule of
            Dream's sampler, which, as LLaDA's, lets the mask id compete (same consequences).
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
        eos_id: the model's end-of-sequence id in ``[0, V)`` (126081 for LLaDA-8B-Instruct), needed
            by the two options above and by ``stop_at_eos`` of block-wise decoding; None otherwise.
        eot_id: the end-of-turn id in ``[0, V)`` (126348 for LLaDA-8B-Instruct), needed by the two
            options above; None otherwise.
            ``cfg_scale``, ``logits_eos_inf`` and ``confidence_eos_eot_inf`` are ``rule="llada"``
            options (an error under ``"dream"``).
        rule: ``"llada"`` (default) or ``"dream"``. The options below are ``rule="dream"`` only
            (None under ``"llada"``), with the released defaults when None.
        alg: ``"origin"`` (default), ``"maskgit_plus"``, ``"topk_margin"`` or ``"entropy"``: what
            decides the commits ([`daca_kernels.rollout.remasking`][daca_kernels.rollout.remasking]).
        alg_temp: float >= 0, or None (= 0): above 0 the committed positions are drawn from
            ``softmax(score / alg_temp)`` instead of taken by highest score (not read by ``"origin"``).
        eps: float in ``[0, 1)``, the schedule's last time (default 1e-3).
        top_p: float in ``(0, 1]`` (1 or None: no filter): keep the most probable tokens up to and
            including the first at which their probabilities sum past ``top_p``.
        top_k: int >= 1 or None: keep the ``top_k`` largest logits (ties with the k-th kept);
            applied after ``top_p``, as released.
        threshold: float in ``[0, 1]`` or None. For a full-attention ``lm`` (``rule="llada"``): confidence-
            threshold parallel decoding, each step commits every masked position of the current block
            whose confidence exceeds it when there are at least the schedule's ``k`` of them, else the
            ``k`` most confident, and a block ends when its positions run out
            ([`daca_kernels.rollout.fast_decoding`][daca_kernels.rollout.fast_decoding]). For a block-causal ``lm``: see below.
        kv_cache: for a full-attention ``lm``: None (default, exact: every forward runs the whole
            sequence), ``"prefix"`` or ``"dual"``: Fast-dLLM's block-wise approximate KV cache
            ([`daca_kernels.rollout.prefix_cache`][daca_kernels.rollout.prefix_cache]: which families' code can serve it, and why not where
            not). For a block-causal ``lm`` a bool or None: see below.
        tokens_per_step: int >= 1 dividing ``block_length``, or None: commit that many tokens per step
            (DARE's setting), i.e. ``steps = gen_length / tokens_per_step`` (``steps`` then None or that
            number). Full-attention ``lm`` only. The schedule itself is exact; combine it with
            ``kv_cache`` for the cache's savings.
        stop_at_eos: an option of block-wise decoding (False otherwise); see below.

    A block-causal ``lm`` (``lm.attention == ("block", size)``: SDAR / TraDo, LLaDA2) is decoded block
    by block by [`daca_kernels.rollout.blockwise.decode_blockwise`][daca_kernels.rollout.blockwise.decode_blockwise], which reads
    ``gen_length``,
    ``steps`` (then the denoising steps *per block*, in ``[1, size]``, as the released decoders
    count them), ``seed``, ``temperature``, ``top_k`` and ``top_p`` (filtered in the released order
    of those models: top-k first), ``threshold`` (SDAR's ``low_confidence_dynamic`` / LLaDA2's
    confidence threshold), ``prompt_mask``, ``row_offset``, ``kv_cache`` (None: the family's KV cache
    when there is one), ``chunk_size``, ``branch_steps`` (global steps counted over all blocks in
    decoding order, each below ``steps`` times the number of blocks and reached by the decode; one
    extra full forward per branch step), ``branch_topk``, and ``stop_at_eos`` with ``eos_id`` (stop
    each row after its block holding EOS, as the released decoders do; its later positions keep the
    mask id); ``block_length`` must be None or the model's size and the other options left at their
    defaults (a ValueError naming the option otherwise).

    Returns:
        A [`Rollout`][daca_kernels.rollout.record.Rollout].

    Arguments are checked once per call, the prompt's values included (ids in range and not the mask
    id; a 0/1 left-padding ``prompt_mask``). A NaN logit of the model is a ValueError naming the step,
    except on CUDA, where that check would wait for the device at every step: there the rollout's
    ``commit_confidence`` (and so the DPS weights) carries the NaN.
    """
    unknown = sorted(set(rule_options) - RULE_OPTIONS)
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    if sampler is not None:
        if rule_options:
            raise ValueError(f"sampler: give the rule's options in sampler or as keywords, not both; got sampler and "
                             f"{', '.join(sorted(rule_options))}")
        if not isinstance(lm, MaskedLM):
            raise TypeError(f"lm must be a daca_kernels.MaskedLM, got {type(lm).__name__}")
        rule_options = sampler_keywords(sampler, block_causal=lm.attention != "full")
    return _generate(lm, prompt_ids, gen_length=gen_length, steps=steps, seed=seed, temperature=temperature,
                     prompt_mask=prompt_mask, branch_steps=branch_steps, branch_topk=branch_topk, chunk_size=chunk_size,
                     row_offset=row_offset, **rule_options)


def _generate(
    lm: MaskedLM,
    prompt_ids: Tensor,
    *,
    gen_length: int,
    steps: int | None = None,
    block_length: int | None = None,
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
    rule: str = "llada",
    alg: str | None = None,
    alg_temp: float | None = None,
    eps: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    threshold: float | None = None,
    kv_cache: bool | str | None = None,
    stop_at_eos: bool = False,
    tokens_per_step: int | None = None,
) -> Rollout:
    """[`generate`][daca_kernels.rollout.sampler.generate] with every rule option as a keyword (its checks and its dispatch)."""
    if not isinstance(lm, MaskedLM):
        raise TypeError(f"lm must be a daca_kernels.MaskedLM, got {type(lm).__name__}")
    _check_prompt_ids(lm, prompt_ids)
    check_int(gen_length, "gen_length", low=1)
    check_sequence_length(prompt_ids.shape[1] + gen_length, lm.max_length, "gen_length",
                          f"P + G with prompt_ids' P = {prompt_ids.shape[1]} and gen_length G = {gen_length}")
    if chunk_size is not None:
        check_int(chunk_size, "chunk_size", low=1)
    if lm.attention != "full":
        if tokens_per_step is not None:
            raise ValueError("tokens_per_step is an option of full-attention decoding; a block-causal lm takes steps "
                             f"per block, got tokens_per_step={tokens_per_step!r}")
        return _generate_block_causal(lm, prompt_ids, locals())
    if stop_at_eos is not False:
        raise ValueError(f"stop_at_eos is an option of block-wise decoding (a block-causal lm); leave it False for "
                         f"this full-attention lm, got {stop_at_eos!r}")
    rule = check_choice(rule, "rule", RULES)
    if block_length is None:
        block_length = gen_length
    check_int(block_length, "block_length", low=1)
    steps = _steps_from_tokens_per_step(steps, tokens_per_step, gen_length, block_length)
    check_int(steps, "steps", low=1)
    decoding = Decoding(_check_full_kv_cache(kv_cache), _check_threshold(threshold), tokens_per_step)
    if rule == "dream" and block_length != gen_length:
        raise ValueError(f"block_length must be None or gen_length ({gen_length}) with rule='dream' (Dream's "
                         f"sampler decodes the completion as one block), got {block_length}")
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
    chosen_branch_steps = check_branch_steps(branch_steps, steps)
    branch_topk = check_branch_topk(branch_topk, lm)
    mask_candidate = _check_mask_candidate(mask_candidate, rule)
    if rule == "dream":
        if remasking != "low_confidence":
            raise ValueError(f"remasking is an option of rule='llada'; with rule='dream' choose the commit order "
                             f"with alg, got remasking={remasking!r}")
        candidate_rule, commits = _dream_rule(
            lm, mask_candidate, steps, alg, alg_temp, eps, top_p, top_k,
            dict(cfg_scale=cfg_scale, logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf),
        )
    else:
        for name, value in dict(alg=alg, alg_temp=alg_temp, eps=eps, top_p=top_p, top_k=top_k).items():
            if value is not None:
                raise ValueError(f"{name} is an option of rule='dream' (Dream's sampler); leave it None with "
                                 f"rule='llada', got {value!r}")
        candidate_rule = _candidate_rule(lm, temperature, mask_candidate, cfg_scale, logits_eos_inf,
                                         confidence_eos_eot_inf, eos_id, eot_id)
        commits = BlockCommits(prompt_ids.shape[1], block_length, steps // num_blocks, remasking)

    if not decoding.exact:
        protocol = _check_fast_options(lm, decoding, rule, mask_candidate, cfg_scale, remasking)
        with torch.no_grad():
            return fast_decoding.decode(
                lm, protocol, decoding, prompt_ids.long(), gen_length, block_length, steps // num_blocks,
                temperature, seed, prompt_mask, chosen_branch_steps, branch_topk, chunk_size, row_offset,
                candidate_rule, remasking,
            )
    with torch.no_grad():
        rollout = _sample(
            lm, prompt_ids.long(), gen_length, steps, temperature, seed, prompt_mask, chosen_branch_steps,
            branch_topk, chunk_size, row_offset, candidate_rule, commits,
        )
    return dataclasses.replace(rollout, decoding=decoding)


def _steps_from_tokens_per_step(steps, tokens_per_step, gen_length: int, block_length: int) -> int:
    """``steps``, or ``gen_length / tokens_per_step`` when ``tokens_per_step`` is given (then ``steps`` must
    be None or that number, and ``tokens_per_step`` must divide ``block_length``)."""
    if tokens_per_step is None:
        if steps is None:
            raise ValueError("steps must be given (or tokens_per_step, for a full-attention lm)")
        return steps
    k = check_int(tokens_per_step, "tokens_per_step", low=1, high=block_length + 1)
    if block_length % k:
        raise ValueError(f"tokens_per_step ({k}) must divide block_length ({block_length}): each step commits "
                         f"exactly tokens_per_step positions of its block")
    derived = gen_length // k
    if steps is not None and steps != derived:
        raise ValueError(f"tokens_per_step={k} means steps = gen_length / tokens_per_step = {derived}; leave steps "
                         f"None or pass {derived}, got steps={steps!r}")
    return derived


def _check_full_kv_cache(kv_cache) -> str | None:
    if kv_cache is None:
        return None
    if not isinstance(kv_cache, str) or kv_cache not in CACHE_MODES:
        raise ValueError(f"kv_cache must be None, 'prefix' or 'dual' for a full-attention lm, got {kv_cache!r}")
    return kv_cache


def _check_threshold(threshold) -> float | None:
    if threshold is None:
        return None
    if not 0 <= check_nonnegative_float(threshold, "threshold") <= 1:
        raise ValueError(f"threshold must lie in [0, 1] (a probability), got {threshold}")
    return float(threshold)


def _check_fast_options(lm: MaskedLM, decoding: "Decoding", rule: str, mask_candidate: str, cfg_scale,
                        remasking: str):
    """The options that cached or threshold decoding leaves out (each a ValueError naming it), and the
    cache protocol (None without a cache)."""
    name = f"kv_cache={decoding.kv_cache!r}" if decoding.kv_cache is not None else f"threshold={decoding.threshold}"
    if rule != "llada":
        raise ValueError(f"rule: {name} decodes with LLaDA's block-wise rule; pass rule='llada' (with block_length, "
                         f"as Fast-dLLM decodes Dream), got rule={rule!r}")
    if mask_candidate != "exclude":
        raise ValueError(f"mask_candidate: {name} needs mask_candidate='exclude' (a committed mask id would leave "
                         f"a hole in the cached prefix), got {mask_candidate!r}")
    if cfg_scale:
        raise ValueError(f"cfg_scale: {name} has no guidance pass; leave cfg_scale 0, got {cfg_scale!r}")
    if decoding.threshold is not None and remasking != "low_confidence":
        raise ValueError(f"remasking: threshold commits by confidence; leave remasking='low_confidence', "
                         f"got {remasking!r}")
    return None if decoding.kv_cache is None else full_backbone(lm, decoding.kv_cache)


# generate's options that block-wise decoding does not read, with the only value it accepts.
_NOT_BLOCKWISE = dict(remasking="low_confidence", mask_candidate="exclude", cfg_scale=0.0, logits_eos_inf=False,
                      confidence_eos_eot_inf=False, eot_id=None, rule="llada", alg=None, alg_temp=None, eps=None)


def _generate_block_causal(lm: MaskedLM, prompt_ids: Tensor, options: dict) -> Rollout:
    """[`generate`][daca_kernels.rollout.sampler.generate] on a block-causal ``lm``:
    [`daca_kernels.rollout.blockwise.decode_blockwise`][daca_kernels.rollout.blockwise.decode_blockwise]."""
    for name, accepted in _NOT_BLOCKWISE.items():
        if options[name] != accepted:
            raise ValueError(f"{name}={options[name]!r} is not available for a block-causal lm "
                             f"(attention={lm.attention!r}), decoded block by block; leave it at {accepted!r}")
    size = lm.attention[1]
    if options["block_length"] not in (None, size):
        raise ValueError(f"block_length must be None or the model's block size {size} for a block-causal lm, "
                         f"got {options['block_length']!r}")
    prompt_mask = _check_prompt_mask(options["prompt_mask"], prompt_ids, lm.shift)
    keep = ("gen_length", "steps", "seed", "temperature", "top_k", "top_p", "threshold", "row_offset", "kv_cache",
            "chunk_size", "branch_steps", "branch_topk", "stop_at_eos", "eos_id")
    return decode_blockwise(lm, prompt_ids.long(), prompt_mask, **{name: options[name] for name in keep})


def _hidden_rows(lm: MaskedLM, x: Tensor, attention_mask: Tensor | None, b_idx: Tensor, pos: Tensor) -> Tensor:
    """``[N, H]``: the hidden rows that predict positions ``(b_idx, pos)`` of ``x`` (one backbone call)."""
    return lm.hidden(x, attention_mask)[b_idx, pos - 1 if lm.shift else pos]


def _sample(lm, prompt_ids, gen_length, steps, temperature, seed, prompt_mask, branch_steps, branch_topk,
            chunk_size, row_offset, rule, commits) -> Rollout:
    device, mask_id = lm.device, lm.mask_id
    batch, prompt_length = prompt_ids.shape
    length = prompt_length + gen_length
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
    commit_logprob = torch.zeros(batch, length, dtype=acc, device=device)
    step_gain = torch.zeros(batch, steps, dtype=acc, device=device)
    current = torch.zeros(batch, length, dtype=acc, device=device)
    previous = torch.zeros_like(current)
    branches = []
    input_changed, nfe = True, 0

    for step in range(steps):
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
            candidate, confidence, score = rule.propose(lm, sampled_rows, temperature, seed, step, row_ids, chunk_size)
            check_not_nan(confidence, f"lm produced NaN logits at step {step}")

        # DPS: c_step of every masked position; the positions masked now are U_{step - 1}.
        current[b_idx, pos] = confidence
        if step > 0:
            step_gain[:, step - 1] = confidence_delta_unchecked(current, previous, masked)
        current, previous = previous, current

        if step in branch_steps:
            token_ids, logprobs = topk_cache(lm, hidden_rows, branch_topk, chunk_size)
            branches.append(BranchState(step, x.clone(), masked.clone(), token_ids, logprobs))

        chosen = commits.select(step, seed, b_idx, pos, row_ids, score, (batch, length))
        cb, cp, tokens = b_idx[chosen], pos[chosen], candidate[chosen]
        # A committed mask id (a candidate under the released rules) leaves its position masked.
        written = tokens != mask_id
        x[cb, cp] = tokens
        masked[cb, cp] = ~written
        commit_step[cb, cp] = torch.where(written, step, -1)
        commit_confidence[cb, cp] = torch.where(written, confidence[chosen], 0.0)
        if cb.numel():
            logprob = linear_logprob_unchecked(hidden_rows[chosen], lm.head_weight, tokens, bias=lm.head_bias,
                                               chunk_size=chunk_size).to(acc)
            commit_logprob[cb, cp] = torch.where(written, logprob, 0.0)
        input_changed = bool(chosen.any())

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
        forward_tokens=nfe * batch * length,
        commit_logprob=commit_logprob,
    )


def rescore_commits(lm: MaskedLM, rollout: Rollout, *, chunk_size: int | None = None) -> Tensor:
    """The log-probability of each committed token under a full forward of the state it was committed
    from: ``[B, L]`` in the dtype of ``rollout.commit_logprob``, 0 where ``commit_step`` is -1.

    The state of step ``s`` is the prompt and every token committed before ``s`` (the mask id
    elsewhere), run through ``lm.hidden`` with ``rollout.attention_mask``: one full forward per step
    that committed a token, the forwards the exact sampler makes. For an exact rollout the result
    equals ``rollout.commit_logprob`` up to float rounding; for a cached or threshold rollout
    ``rescore_commits(...) - rollout.commit_logprob`` is the sampling/scoring gap, the log of the
    importance weight [`daca_kernels.losses.truncated_importance_weights`][daca_kernels.losses.importance.truncated_importance_weights]
    truncates.

    Args:
        lm: the model that sampled ``rollout`` (a full-attention [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM]).
        rollout: a [`Rollout`][daca_kernels.rollout.record.Rollout] of ``lm`` with ``commit_logprob``.
        chunk_size: rows per head chunk, or None.
    """
    if not isinstance(lm, MaskedLM):
        raise TypeError(f"lm must be a daca_kernels.MaskedLM, got {type(lm).__name__}")
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a Rollout, got {type(rollout).__name__}")
    if rollout.commit_logprob is None or lm.attention != "full":
        raise ValueError("rollout: rescore_commits needs a full-attention model's rollout (with commit_logprob)")
    if rollout.sequences.device != lm.device:
        raise ValueError(f"rollout is on {rollout.sequences.device} but lm is on {lm.device}")
    commit_step = rollout.commit_step
    out = torch.zeros_like(rollout.commit_logprob)
    prompt = commit_step < 0
    with torch.no_grad():
        for step in commit_step[commit_step >= 0].unique().tolist():
            state = torch.where(prompt & (rollout.sequences != rollout.mask_id) | (commit_step >= 0) & (commit_step < step),
                                rollout.sequences, torch.full_like(rollout.sequences, rollout.mask_id))
            b_idx, pos = (commit_step == step).nonzero(as_tuple=True)
            rows = lm.hidden(state, rollout.attention_mask)[b_idx, pos - 1 if lm.shift else pos]
            out[b_idx, pos] = linear_logprob_unchecked(rows, lm.head_weight, rollout.sequences[b_idx, pos],
                                                       bias=lm.head_bias, chunk_size=chunk_size).to(out.dtype)
    return out


def branch(
    rollout: Rollout, index: int, num_fillings: int, *, seed: int, temperature: float = 1.0, row_offset: int = 0
) -> Branch:
    """Resample every masked position of a cached state ``num_fillings`` times, with no model call.

    Filling z of masked position j (row b) is the Gumbel-max sample at ``temperature`` over the
    cached top-k log-probabilities ([`daca_kernels.sample_step`][daca_kernels.ops.sample_step] with step ``z`` and row id
    ``(row_offset + b) * L + j``), i.e. a draw from ``softmax(logprobs / temperature)`` restricted
    to the cached tokens (at temperature 1 the model's distribution given that the token is not the
    mask id, exactly when the cache kept every such token); ``temperature=0`` gives the most
    probable token in every filling. A filling never holds the mask id at a filled position.

    Args:
        rollout: a [`Rollout`][daca_kernels.rollout.record.Rollout] generated with ``branch_steps``.
        index: which of ``rollout.branches`` (0-based, in step order).
        num_fillings: ``Z`` >= 1.
        seed: int in ``[0, 2**64)``; use a different seed for every branching of the same rollout.
        temperature: float >= 0.
        row_offset: global index of row 0 of the rollout's batch, for sharded batches (pass the
            value given to [`generate`][daca_kernels.rollout.sampler.generate]); the noise depends on ``(seed, z, (row_offset + b) * L
            + position)``. An int >= 0 with ``(row_offset + B) * L <= 2**32``.

    Returns:
        A [`Branch`][daca_kernels.rollout.sampler.Branch] with ``sequences [Z, B, L]``; its ``fillings``, ``fillings_filled`` and
        ``fillings_old_logprob`` (``[B * Z, L]``, grouped by state) are what
        [`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob] and
        [`daca_kernels.dispo_step_loss`][daca_kernels.losses.dispo.dispo_step_loss] take.
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
        column, _ = sample_step_unchecked(state.logprobs, temperature=temperature, seed=seed, step=z, row_ids=row_ids)
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
