"""Block-by-block decoding of block-causal models (SDAR / TraDo, LLaDA2), with a KV cache of the
committed blocks, and the same online DPS bookkeeping as [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate].

A block-causal model (``lm.attention == ("block", size)``) sees, at a position, the keys of its own
block and of every earlier block; blocks are counted from the first prompt token. The released
decoders (SDAR's ``block_diffusion_generate``, LLaDA2's ``generate``) decode the blocks from the one
holding the first completion position on, one at a time: the block's still-masked positions are
predicted, some are committed, until none is left. The completion runs to the end of the block that
holds its last position (those extra positions are decoded too, and dropped from the result, as
LLaDA2 does).

With a cache (``kv_cache=True``, the default where [`daca_kernels.rollout.block_cache`][daca_kernels.rollout.block_cache] knows the family)
the whole prompt blocks run once (prefill, keys and values stored), each denoising step runs only the
current block's ``size`` tokens against the cache, and a completed block runs once more to store its
keys and values (SDAR's protocol; committed blocks are never recomputed). Without (``kv_cache=False``,
or a model without a protocol) each step runs the whole prefix up to the end of the current block
(LLaDA2's released ``generate``). Both give the same tokens up to float rounding of the attention.

Per step, with ``k`` from the even split of the block size over ``steps`` (the remainder to the first
steps, as both released decoders compute it) among the block's still-masked positions:
``threshold=None`` commits the ``k`` most confident (SDAR's ``low_confidence_static``); a threshold
commits every position whose confidence exceeds it when there are at least ``k`` of them, else the
``k`` most confident (SDAR's ``low_confidence_dynamic``, LLaDA2's rule).
[`daca_kernels.rollout.remasking.threshold_or_top`][daca_kernels.rollout.remasking.threshold_or_top] is the rule. The candidate: at
temperature 0 the
argmax, with confidence its softmax probability (LLaDA2's greedy branch); above, a draw from
``softmax(logits / temperature)`` filtered by top-k then top-p (the released order and filters),
with confidence the drawn token's probability there. Draws are Gumbel-max with counter-hash noise
([`daca_kernels.sample_step`][daca_kernels.ops.sample_step]), an exact sampler of the released ``torch.multinomial`` draw.

Left padding. Each row is decoded as if alone: its blocks are counted from its own first prompt
token, padding keys are hidden and positions are counted from that token (the block partition of
[`daca_kernels.models.masked_lm.block_index`][daca_kernels.models.masked_lm.block_index], which the estimators, the branch states and
the trainer
use too, so a completion is scored under the partition it was sampled under). Internally every row is
laid out so that its first decoding block is the same column block for all rows (each row padded on
the left by a multiple of the block size), so a batch shares one cache and one call per step; a row
whose completion ends a block earlier idles (its columns hidden) while the others finish. The noise
of position ``r`` of row ``b`` (``r`` counted from the row's first completion position) is row id
``(row_offset + b) * (G + size) + r`` at step ``i`` of its block: it depends neither on the padding nor
on the batch, so a row of a padded batch equals that row decoded alone with ``row_offset=b``.

DPS: the global step ``s`` counts the batch's steps over all blocks (a block takes as many steps as
its slowest row); ``commit_step`` and ``commit_confidence`` are as in [`generate`][daca_kernels.rollout.sampler.generate];
``step_gain[b, s]`` sums ``c_{s+1} - c_s`` over the positions of the current block still masked after
step ``s`` (later blocks are not predicted before their turn), so it is 0 at each block's last step.

DiSPO branch states (``branch_steps``): a branch step is a global step ``s`` as above. Its state is
the whole sequence at the step's input in the output columns (``[B, L]``: the committed earlier
blocks, the partially unmasked current block, the later blocks all mask), its masked positions those
holding the mask id. The cache ([`daca_kernels.rollout.branch_states.BranchState`][daca_kernels.rollout.branch_states.BranchState]) is
the model's
one-forward prediction at every masked position of that state under its block-causal attention over
the whole sequence, each row's blocks counted from its first prompt token
([`daca_kernels.MaskedLM.hidden`][daca_kernels.models.masked_lm.MaskedLM.hidden]): a later, fully masked block is predicted given the
noisy current block, the one-step filling DiSPO uses for bidirectional models, with the model's own
attention. [`daca_kernels.rollout.branch`][daca_kernels.rollout.sampler.branch] then samples all masked positions from the cache and
[`daca_kernels.likelihood.branch_logprob`][daca_kernels.likelihood.branch.branch_logprob] scores fillings with the same forward. That
forward is
one extra call per branch step over the whole sequence, without the KV cache (``nfe`` and
``forward_tokens`` count it); positions past ``G`` in the last block are not part of the state.

Stop at EOS (``stop_at_eos=True`` with ``eos_id``), the released decoders' stop: once a block is
done, a row holding ``eos_id`` at one of its completion positions of that block stops (SDAR's
``stopping_criteria_idx``, LLaDA2's check after each block); the batch stops when every row has, so
``nfe`` drops when rows end early. A stopped row's later positions are left holding the mask id, as
SDAR's ``block_diffusion_generate`` leaves its undecoded blocks (LLaDA2's ``generate`` cuts the
sequence after the first EOS instead), with ``commit_step`` -1 and ``commit_confidence`` 0; they lie
after the row's first EOS, so ``Rollout.answer_mask`` excludes them. Each row stops on its own (the
released decoders decode one prompt; SDAR's check over a batch would stop every row at the first
row's EOS), so a padded row still equals the row alone. The default (False) decodes every block, as
before: the tokens up to the first EOS are the same either way.

Where this differs from the released decoders (``tests/families/test_block_sampler.py`` holds it to
both, token for token, given the same draws):

* Draws: counter-hash Gumbel-max, not the global RNG's ``torch.multinomial``.
* The mask id is never proposed (the released code lets it compete; a committed mask id would leave
  the position masked).
* Temperature 0 is the argmax (LLaDA2's greedy branch; SDAR's script divides by the temperature
  whatever it is); LLaDA2 at temperature 0 *with* top-k or top-p draws from the filtered softmax at
  temperature 1, here it is the argmax.
* A step commits at most the block's masked count (LLaDA2's ``min(count, masked)``).
* The stop at an end-of-sequence token is optional (``stop_at_eos``, above; by default later blocks
  are decoded and ``Rollout.answer_mask`` cuts them). LLaDA2's ``eos_early_stop`` (a stop inside a
  block) and ``steps = min(steps, gen_length // minimal_topk)`` are not applied.
* Batches with left padding (the released code decodes one unpadded prompt); the last block is not
  run again to store it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from daca_kernels.hashing import seed32
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.confidence_delta import confidence_delta_unchecked
from daca_kernels.ops.sample_step import sample_step_unchecked
from daca_kernels.ops.shared import chunk_rows
from daca_kernels.precision import accumulation_dtype
from daca_kernels.rollout import block_cache
from daca_kernels.rollout.block_cache import block_backbone, visible_keys
from daca_kernels.rollout.branch_states import DEFAULT_BRANCH_TOPK, BranchState, check_branch_steps, check_branch_topk, topk_cache
from daca_kernels.rollout.logit_filters import top_k_filter, top_p_filter
from daca_kernels.rollout.record import Decoding, Rollout
from daca_kernels.rollout.remasking import threshold_or_top, transfer_counts
from daca_kernels.validation import (
    check_bool,
    check_int,
    check_nonnegative_float,
    check_not_nan,
    check_positive_float,
    check_row_offset,
)


def decode_blockwise(
    lm: MaskedLM,
    prompt_ids: Tensor,
    prompt_mask: Tensor | None,
    *,
    gen_length: int,
    steps: int,
    seed: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    threshold: float | None = None,
    row_offset: int = 0,
    kv_cache: bool | None = None,
    chunk_size: int | None = None,
    branch_steps: Iterable[int] | None = None,
    branch_topk: int | None = DEFAULT_BRANCH_TOPK,
    stop_at_eos: bool = False,
    eos_id: int | None = None,
) -> Rollout:
    """Decode ``G`` completion tokens block by block after a (left-padded) prompt (module docstring):
    a [`daca_kernels.rollout.Rollout`][daca_kernels.rollout.record.Rollout] (``commit_logprob`` None). Called by
    [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] for a block-causal ``lm``, which checks the prompt,
    ``gen_length`` and ``chunk_size``.

    Args:
        lm: a block-causal [`daca_kernels.MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] (``attention=("block", size)``,
            ``shift=False``); called under ``torch.no_grad()``, its train/eval mode left as is.
        prompt_ids: long ``[B, P]``, ids in ``[0, V)``, none equal to ``lm.mask_id``, rows left padded.
        prompt_mask: bool ``[B, P]``, False on left padding (only before a row's tokens), or None
            when no row is padded.
        gen_length: ``G`` >= 1.
        steps: denoising steps per block, in ``[1, size]`` (SDAR's ``denoising_steps``, LLaDA2's
            ``steps``); a block ends earlier when the threshold commits more.
        seed: int in ``[0, 2**64)``.
        temperature: float >= 0 (0: argmax).
        top_k: int >= 1 or None; top_p: float in ``(0, 1]`` or None (1 or None: no filter). Applied
            in this order, at a temperature > 0 only.
        threshold: float in ``[0, 1]`` or None (module docstring).
        row_offset: global index of row 0 (sharded batches); ``(row_offset + B) * (G + size) <= 2**32``.
        kv_cache: True: decode with the family's KV cache (a ValueError when
            [`daca_kernels.rollout.block_cache`][daca_kernels.rollout.block_cache] has no protocol for the model); False: recompute the
            prefix at every step; None: the cache when there is a protocol.
        chunk_size: rows per head chunk (the filters need a row's whole logits), or None.
        branch_steps: global steps (counted over all blocks in decoding order) whose state to keep
            (module docstring), or None. Each must be below the most steps the decode can take
            (``steps`` times the number of blocks of the longest row) and one the decode reaches: a
            block ends before ``steps`` when its masked positions run out (the threshold, prompt
            tokens in the first block, a stop at EOS), and a step not reached is a ValueError naming
            ``branch_steps`` once decoding is done.
        branch_topk: tokens kept per masked position of a branch state (capped at ``V - 1``; None
            keeps every token but the mask id).
        stop_at_eos: True: each row stops after its block holding an ``eos_id`` among its completion
            positions (module docstring); False (default): every block is decoded.
        eos_id: the end-of-sequence id in ``[0, V)``, not the mask id; given exactly when
            ``stop_at_eos``.
    """
    if lm.attention == "full":
        raise ValueError("lm: block-wise decoding is for block-causal models (attention=('block', size))")
    if lm.shift:
        raise ValueError("lm: block-wise decoding needs shift=False (a block's first position would be "
                         "predicted from the previous block's last state)")
    size = lm.attention[1]
    check_int(steps, "steps", low=1, high=size + 1)
    seed32(seed)
    temperature = check_nonnegative_float(temperature, "temperature")
    if top_k is not None:
        top_k = check_int(top_k, "top_k", low=1)
    if top_p is not None and check_positive_float(top_p, "top_p") > 1:
        raise ValueError(f"top_p must be <= 1 (1: no filter), got {top_p}")
    if threshold is not None and not 0 <= check_nonnegative_float(threshold, "threshold") <= 1:
        raise ValueError(f"threshold must lie in [0, 1] (a probability), got {threshold}")
    row_offset = check_row_offset(row_offset, prompt_ids.shape[0], positions=gen_length + size)
    protocol = block_backbone(lm)
    decoding = Decoding(kv_cache, threshold)
    if kv_cache is None:
        kv_cache = protocol is not None
    elif check_bool(kv_cache, "kv_cache") and protocol is None:
        raise ValueError("kv_cache: this model has no KV-cache protocol in daca_kernels.rollout.block_cache (only the "
                         "SDAR / TraDo and LLaDA2 released code built with MaskedLM.from_hf); pass kv_cache=False")
    branch_topk = check_branch_topk(branch_topk, lm)
    if check_bool(stop_at_eos, "stop_at_eos"):
        if eos_id is None:
            raise ValueError("eos_id must be given with stop_at_eos=True (the model's end-of-sequence id)")
        check_int(eos_id, "eos_id", low=0, high=lm.vocab_size)
        if eos_id == lm.mask_id:
            raise ValueError(f"eos_id must not be the mask id {lm.mask_id}")
    elif eos_id is not None:
        raise ValueError(f"eos_id is read only with stop_at_eos=True; leave it None, got {eos_id!r}")
    with torch.no_grad():
        return _decode(lm, protocol, kv_cache, prompt_ids, prompt_mask, gen_length, steps, seed,
                       temperature, top_k if temperature > 0 else None,
                       top_p if temperature > 0 and top_p is not None and top_p < 1 else None,
                       threshold, row_offset, chunk_size, branch_steps, branch_topk, eos_id, decoding)


class _Layout:
    """The internal columns (module docstring): row ``b``'s position ``r`` (from its first prompt
    token) is column ``offset[b] + r``; ``T`` columns, a multiple of the block size."""

    def __init__(self, prompt_lengths: Tensor, gen_length: int, size: int):
        whole = prompt_lengths // size
        self.first_block = int(whole.max())
        self.offset = (self.first_block - whole) * size
        ends = (prompt_lengths + gen_length + size - 1) // size * size
        self.total = int((self.offset + ends).max())
        column = torch.arange(self.total, device=prompt_lengths.device)
        r = column[None, :] - self.offset[:, None]
        self.key_valid = (r >= 0) & (r < ends[:, None])
        self.decoded = (r >= prompt_lengths[:, None]) & (r < ends[:, None])
        self.prompt = (r >= 0) & (r < prompt_lengths[:, None])
        self.positions = r.clamp(min=0)
        self.completion_position = r - prompt_lengths[:, None]


def _propose(lm: MaskedLM, rows: Tensor, temperature: float, top_k, top_p, seed: int, step: int, row_ids: Tensor,
             chunk_size) -> tuple[Tensor, Tensor]:
    """``(candidate long [N], confidence [N])`` of the hidden rows ``[N, H]`` (module docstring)."""
    n = rows.shape[0]
    acc = accumulation_dtype(lm.head_weight.dtype)
    candidate = torch.empty(n, dtype=torch.long, device=rows.device)
    confidence = torch.empty(n, dtype=acc, device=rows.device)
    per_chunk = chunk_rows(chunk_size, n)
    for lo in range(0, n, per_chunk):
        hi = min(n, lo + per_chunk)
        logits = torch.nn.functional.linear(rows[lo:hi], lm.head_weight, lm.head_bias).to(acc)
        logits[:, lm.mask_id] = float("-inf")
        if temperature > 0:
            logits = top_p_filter(top_k_filter(logits / temperature, top_k), top_p)
        chosen, _ = sample_step_unchecked(logits, temperature=1.0 if temperature > 0 else 0.0, seed=seed, step=step,
                                          row_ids=row_ids[lo:hi])
        candidate[lo:hi] = chosen
        confidence[lo:hi] = torch.softmax(logits, dim=1).gather(1, chosen[:, None]).squeeze(1)
    return candidate, confidence


def _decode(lm, protocol, kv_cache, prompt_ids, prompt_mask, gen_length, steps, seed, temperature, top_k, top_p,
            threshold, row_offset, chunk_size, branch_steps, branch_topk, eos_id, decoding) -> Rollout:
    device, mask_id, size = lm.device, lm.mask_id, lm.attention[1]
    batch, prompt_length = prompt_ids.shape
    length = prompt_length + gen_length
    acc = accumulation_dtype(lm.head_weight.dtype)
    lengths = (prompt_mask.sum(1) if prompt_mask is not None
               else torch.full((batch,), prompt_length, device=device)).long()
    lay = _Layout(lengths, gen_length, size)
    # Output column e of row b is internal column offset[b] + e - (P - p_b); the row's padding maps
    # below its offset.
    shift = lay.offset - (prompt_length - lengths)
    source = shift[:, None] + torch.arange(length, device=device)[None, :]
    outside = source < lay.offset[:, None]
    source = source.clamp(min=0)
    x = torch.full((batch, lay.total), mask_id, dtype=torch.long, device=device)
    if prompt_length:
        external = (torch.arange(lay.total, device=device)[None, :] - shift[:, None]).clamp(0, prompt_length - 1)
        x = torch.where(lay.prompt, prompt_ids.gather(1, external), x)
    masked = lay.decoded.clone()
    row_ids = (row_offset + torch.arange(batch, device=device))[:, None] * (gen_length + size) + lay.completion_position

    commit_step = torch.full((batch, lay.total), -1, dtype=torch.long, device=device)
    commit_confidence = torch.zeros(batch, lay.total, dtype=acc, device=device)
    num_blocks = lay.total // size - lay.first_block
    step_gain = torch.zeros(batch, num_blocks * steps, dtype=acc, device=device)
    current = torch.zeros(batch, lay.total, dtype=acc, device=device)
    previous = torch.zeros_like(current)
    branch_steps = check_branch_steps(branch_steps, num_blocks * steps)
    branches = []
    counts = transfer_counts(size, steps)
    cache = block_cache.BlockKVCache() if kv_cache else None
    padded = not bool(lay.key_valid.all())
    nfe = tokens = 0

    def out(internal: Tensor, padding) -> Tensor:
        """``internal`` ``[B, T]`` in the output columns ``[B, L]`` (``padding`` on the left padding)."""
        return torch.where(outside, padding, internal.gather(1, source))

    prompt_part = torch.cat([prompt_ids, prompt_ids.new_full((batch, gen_length), mask_id)], dim=1)
    attention_mask = None
    if prompt_mask is not None:
        attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, gen_length)], dim=1).long()

    def keep_state(step: int) -> None:
        """The branch state of ``step``: the output sequences and one extra full forward of them."""
        nonlocal nfe, tokens
        state = out(x, prompt_part)
        waiting = state == mask_id
        # Without hidden_with_keep, hidden runs each row moved right by (-pad) mod size columns.
        extra = 0 if lm.has_hidden_with_keep else int(((lengths - prompt_length) % size).max())
        nfe, tokens = nfe + 1, tokens + batch * (length + extra)
        rows = lm.hidden(state, attention_mask)[waiting]
        branches.append(BranchState(step, state, waiting, *topk_cache(lm, rows, branch_topk, chunk_size)))

    def run(start: int, end: int, store: bool) -> Tensor:
        """Hidden states of columns ``[start, end)`` (the prefix before them cached or recomputed)."""
        nonlocal nfe, tokens
        begin = start if kv_cache else 0
        nfe, tokens = nfe + 1, tokens + batch * (end - begin)
        if protocol is None:
            states = lm.hidden(x[:, :end], lay.key_valid[:, :end].long() if padded else None)
        else:
            keep = visible_keys(lay.key_valid[:, :end], begin, size)
            states = protocol(x[:, begin:end], keep, lay.positions[:, begin:end], cache, store)
        return states[:, start - begin:]

    if kv_cache and lay.first_block > 0:
        run(0, lay.first_block * size, store=True)
    step = 0
    for block in range(lay.first_block, lay.total // size):
        start, end = block * size, (block + 1) * size
        in_block = torch.zeros(lay.total, dtype=torch.bool, device=device)
        in_block[start:end] = True
        for i in range(steps):
            b_idx, local = masked[:, start:end].nonzero(as_tuple=True)
            if b_idx.numel() == 0:
                break
            pos = local + start
            if step in branch_steps:
                keep_state(step)
            rows = run(start, end, store=False)[b_idx, local]
            candidate, confidence = _propose(lm, rows, temperature, top_k, top_p, seed, i, row_ids[b_idx, pos],
                                             chunk_size)
            check_not_nan(confidence, f"lm produced NaN logits at step {step}")
            current[b_idx, pos] = confidence
            if i > 0:
                step_gain[:, step - 1] = confidence_delta_unchecked(current, previous, masked & in_block)
            current, previous = previous, current
            eligible = torch.ones_like(b_idx, dtype=torch.bool)
            chosen = threshold_or_top(confidence, eligible, counts[i], threshold, b_idx, local, (batch, size))
            cb, cp = b_idx[chosen], pos[chosen]
            x[cb, cp] = candidate[chosen]
            masked[cb, cp] = False
            commit_step[cb, cp] = step
            commit_confidence[cb, cp] = confidence[chosen]
            step += 1
        if eos_id is not None:
            ended = ((x[:, start:end] == eos_id) & lay.decoded[:, start:end]).any(1)
            masked[ended, end:] = False
        if not bool(masked.any()):
            break
        if kv_cache:
            run(start, end, store=True)
    if branch_steps and branch_steps[-1] >= step:
        raise ValueError(f"branch_steps: step {branch_steps[-1]} was not reached; this decode took {step} steps in "
                         f"all (blocks end early when their masked positions run out)")

    sequences = out(x, prompt_part)
    attention_mask = None
    if prompt_mask is not None:
        attention_mask = torch.ones_like(sequences)
        attention_mask[:, :prompt_ids.shape[1]] = prompt_mask.long()
    return Rollout(
        sequences=sequences,
        commit_step=out(commit_step, -1),
        commit_confidence=out(commit_confidence, 0.0),
        step_gain=step_gain[:, :step].contiguous(),
        attention_mask=attention_mask,
        prompt_length=prompt_ids.shape[1],
        nfe=nfe,
        branches=tuple(branches),
        mask_id=lm.mask_id,
        forward_tokens=tokens,
        decoding=decoding,
    )
