"""LLaDA's block-wise sampler for full-attention models with the options RL pipelines roll out with:
an approximate prefix or dual KV cache (Fast-dLLM's, [`daca_kernels.rollout.prefix_cache`][daca_kernels.rollout.prefix_cache]) and
confidence-threshold parallel decoding. [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] calls
[`decode`][daca_kernels.rollout.fast_decoding.decode] when
``kv_cache`` or ``threshold`` is given; without them it runs the exact sampler.

The loop is the exact sampler's (``rule="llada"``, candidates and noise as there, global step ``s``
counting the steps taken), with three changes:

* Model calls (``kv_cache``). ``None``: every call is a full forward, as in the exact sampler.
  ``"prefix"``: the first step of each block runs the whole sequence and keeps the keys and values
  before the block; the block's later steps run the block and everything after it against them.
  ``"dual"``: the keys and values after the block are kept too and later steps run the block alone.
  The first step of every block is the exact sampler's forward, so it commits exactly what the exact
  sampler commits from the same state; later steps read stale keys and values (computed while the
  block was still masked), the approximation whose effect
  [`daca_kernels.rollout.rescore_commits`][daca_kernels.rollout.sampler.rescore_commits]
  measures.
* Commits (``threshold``). Each step of a block commits, among the block's still-masked positions,
  every one whose confidence exceeds ``threshold`` when there are at least ``k`` of them, else the ``k``
  most confident ([`daca_kernels.rollout.remasking.threshold_or_top`][daca_kernels.rollout.remasking.threshold_or_top], the block
  families' rule), ``k`` from
  LLaDA's schedule of the block's ``steps / num_blocks`` steps. A block ends when its positions run out,
  which may be before its last scheduled step, and the next step starts the next block: fewer steps and
  forwards. Without a threshold the schedule is LLaDA's.
* Bookkeeping. ``step_gain`` has one column per step taken. With ``"dual"`` the positions after the block
  are not predicted at a block's later steps: their confidence is carried over from the block's first
  step (a full forward predicts every masked position), so their share of ``step_gain`` is 0 at those
  steps. A branch state
  (``branch_steps``) is always the exact model's distribution: a step whose forward read the cache runs
  one extra full forward for it, counted in ``nfe`` and ``forward_tokens``.

``commit_logprob`` records, for each committed token, its log-probability under the model's softmax
(mask id included, untempered) computed from the hidden row the sampler used: the sampling-time
log-probability, which differs from a full forward's when the row read the cache.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.ops.confidence_delta import confidence_delta_unchecked
from daca_kernels.ops.linear_logprob import linear_logprob_unchecked
from daca_kernels.precision import accumulation_dtype
from daca_kernels.rollout.branch_states import BranchState, topk_cache
from daca_kernels.rollout.prefix_cache import FullBackbone
from daca_kernels.rollout.record import Decoding, Rollout
from daca_kernels.rollout.remasking import remasking_uniforms, threshold_or_top, transfer_counts
from daca_kernels.validation import check_not_nan


def decode(lm: MaskedLM, protocol: FullBackbone | None, decoding: Decoding, prompt_ids: Tensor, gen_length: int,
           block_length: int, steps_per_block: int, temperature: float, seed: int, prompt_mask: Tensor | None,
           branch_steps: list[int], branch_topk: int, chunk_size: int | None, row_offset: int, rule,
           remasking: str) -> Rollout:
    """The loop of the module docstring; arguments checked by [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate]
    (``rule`` its LLaDA candidate rule, ``protocol`` given exactly when ``decoding.kv_cache`` is).
    Returns the [`daca_kernels.rollout.Rollout`][daca_kernels.rollout.record.Rollout], ``decoding`` recorded on it."""
    kv_cache, threshold = decoding.kv_cache, decoding.threshold
    device, mask_id, shift = lm.device, lm.mask_id, int(lm.shift)
    batch, prompt_length = prompt_ids.shape
    length = prompt_length + gen_length
    acc = accumulation_dtype(lm.head_weight.dtype)
    columns = torch.arange(length, device=device)

    x = torch.full((batch, length), mask_id, dtype=torch.long, device=device)
    x[:, :prompt_length] = prompt_ids
    masked = torch.zeros(batch, length, dtype=torch.bool, device=device)
    masked[:, prompt_length:] = True
    attention_mask = key_valid = None
    if prompt_mask is not None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
        attention_mask[:, :prompt_length] = prompt_mask.long()
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if padded:
        key_valid = attention_mask.bool()
    positions = None
    if protocol is not None:
        positions = protocol.positions(attention_mask if padded else None, batch, length).to(device)

    num_blocks = gen_length // block_length
    commit_step = torch.full((batch, length), -1, dtype=torch.long, device=device)
    commit_confidence = torch.zeros(batch, length, dtype=acc, device=device)
    commit_logprob = torch.zeros(batch, length, dtype=acc, device=device)
    step_gain = torch.zeros(batch, num_blocks * steps_per_block, dtype=acc, device=device)
    current = torch.zeros(batch, length, dtype=acc, device=device)
    previous = torch.zeros_like(current)
    counts = transfer_counts(block_length, steps_per_block)
    caches = {}  # the protocol's caches, one per group of rows it runs together
    branches = []
    nfe = tokens = 0
    kept_valid = None

    def full() -> Tensor:
        nonlocal nfe, tokens
        nfe, tokens = nfe + 1, tokens + batch * length
        return lm.hidden(x, attention_mask)

    def store_forward(q0: int, end: int) -> Tensor:
        """A full forward through the protocol that keeps the columns the block's later steps do not run."""
        nonlocal nfe, tokens, kept_valid
        nfe, tokens = nfe + 1, tokens + batch * length
        kept = columns[:q0] if kv_cache == "prefix" else torch.cat([columns[:q0], columns[end:]])
        if padded:
            kept_valid = key_valid[:, kept]
        return protocol(x, positions, key_valid, caches, kept)

    def cached_forward(q0: int, q1: int) -> Tensor:
        nonlocal nfe, tokens
        nfe, tokens = nfe + 1, tokens + batch * (q1 - q0)
        valid = torch.cat([kept_valid, key_valid[:, q0:q1]], dim=1) if padded else None
        return protocol(x[:, q0:q1], positions[:, q0:q1], valid, caches, None)

    step = 0
    for block in range(num_blocks):
        start = prompt_length + block * block_length
        end = start + block_length
        q0 = start - shift
        in_block = (columns >= start) & (columns < end)
        fresh, recompute = True, True
        for i in range(steps_per_block):
            if not bool(masked[:, start:end].any()):
                if threshold is not None:
                    break
                # LLaDA's schedule keeps a block's empty steps (more steps than positions): no forward.
                step += 1
                continue
            # A dual cache's later steps run the block alone; every other forward predicts every masked position.
            predicted = masked & in_block if kv_cache == "dual" and not fresh else masked
            if recompute:
                b_idx, pos = predicted.nonzero(as_tuple=True)
                row_ids = (row_offset + b_idx) * length + pos
                if kv_cache is None:
                    states, first = full(), 0
                elif fresh:
                    states, first = store_forward(q0, end), 0
                else:
                    states, first = cached_forward(q0, length if kv_cache == "prefix" else end), q0
                exact_states = kv_cache is None or fresh
                hidden_rows = states[b_idx, pos - shift - first]
            if recompute or temperature > 0:
                candidate, confidence, score = rule.propose(lm, hidden_rows, temperature, seed, step, row_ids,
                                                            chunk_size)
                check_not_nan(confidence, f"lm produced NaN logits at step {step}")
            fresh = False

            if kv_cache == "dual":
                current.copy_(previous)
            current[b_idx, pos] = confidence
            if step > 0:
                step_gain[:, step - 1] = confidence_delta_unchecked(current, previous, masked)
            current, previous = previous, current

            if step in branch_steps:
                wb, wp = masked.nonzero(as_tuple=True)
                rows = (states if exact_states else full())[wb, wp - shift]
                token_ids, logprobs = topk_cache(lm, rows, branch_topk, chunk_size)
                branches.append(BranchState(step, x.clone(), masked.clone(), token_ids, logprobs))

            if remasking == "random":
                score = remasking_uniforms(seed, step, row_ids).to(score.dtype)
            chosen = threshold_or_top(score, pos < end, counts[i], threshold, b_idx, pos, (batch, length))
            cb, cp, written = b_idx[chosen], pos[chosen], candidate[chosen]
            x[cb, cp] = written
            masked[cb, cp] = False
            commit_step[cb, cp] = step
            commit_confidence[cb, cp] = confidence[chosen]
            if cb.numel():
                commit_logprob[cb, cp] = linear_logprob_unchecked(hidden_rows[chosen], lm.head_weight, written,
                                                                  bias=lm.head_bias, chunk_size=chunk_size).to(acc)
            recompute = bool(chosen.any())
            step += 1
    if branch_steps and branch_steps[-1] >= step:
        raise ValueError(f"branch_steps: step {branch_steps[-1]} was not reached; this decode took {step} steps in "
                         f"all (with a threshold, blocks end early when their masked positions run out)")
    return Rollout(sequences=x, commit_step=commit_step, commit_confidence=commit_confidence,
                   step_gain=step_gain[:, :step].contiguous(), attention_mask=attention_mask,
                   prompt_length=prompt_ids.shape[1], nfe=nfe, branches=tuple(branches), mask_id=lm.mask_id,
                   forward_tokens=tokens, commit_logprob=commit_logprob, decoding=decoding)
