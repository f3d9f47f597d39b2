"""Readable references for one denoising step and for the whole LLaDA-style sampler.

[`sample_step`][daca_kernels.reference.sampling.sample_step] is the executable specification of
[`daca_kernels.sample_step`][daca_kernels.ops.sample_step];
[`reference_generate`][daca_kernels.reference.sampling.reference_generate] is the straightforward sampler that
[`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate]
must reproduce token for token. It runs the model on the whole sequence at every step, keeps full
logits and stores every step's confidences, which the real sampler must never do.

Noise: the Gumbel noise of ``(seed, step, row_id, token)`` is ``-log(-log(u))`` with
``u = uniform_from_hash(gumbel_hash(seed32(seed), step, row_id, token))``; the random
remasking score of ``(seed, step, row_id)`` is ``uniform_from_hash(hash4(seed32(seed),
STREAM_RANDOM_REMASK, step, row_id, 0))``. A sampler row id is ``(row_offset + b) * L + position``
for row ``b`` of a call whose row 0 is row ``row_offset`` of the global batch (0 unless the batch
is a shard of a larger one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from daca_kernels import hashing
from daca_kernels.reference.dps import step_gain_from_history
from daca_kernels.reference.hashing import murmur3_32_words, uniform


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gumbel_noise(seed: int, step: int, row_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[N, vocab]`` Gumbel(0, 1) noise of rows ``row_ids`` at ``step`` (a pure function)."""
    tokens = torch.arange(vocab, device=row_ids.device)
    words = hashing.gumbel_hash(hashing.seed32(seed), step, row_ids.long()[:, None], tokens[None, :])
    return -torch.log(-torch.log(hashing.uniform_from_hash(words)))


def remasking_uniforms(seed: int, step: int, row_ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[N]`` uniform scores of ``remasking="random"`` for rows ``row_ids`` at ``step``,
    one row at a time from the plain-Python hash."""
    words = [[hashing.STREAM_RANDOM_REMASK, step, row, 0] for row in row_ids.tolist()]
    scores = [uniform(murmur3_32_words(hashing.seed32(seed), w)) for w in words]
    return torch.tensor(scores, dtype=torch.float32, device=row_ids.device)


def sample_step(
    logits: torch.Tensor,
    temperature: float,
    seed: int,
    step: int,
    row_ids: torch.Tensor | None = None,
    mask_id: int | None = None,
    return_entropy: bool = False,
):
    """Candidate and confidence of each row of ``logits [N, V]``.

    ``candidate = argmax(logits / temperature + gumbel)`` (plain argmax when ``temperature == 0``;
    the lowest id wins a tie) and ``confidence = softmax(logits)[candidate]`` with no temperature
    and no noise. ``mask_id``, when given, counts as ``-inf`` in both. ``row_ids`` (default
    ``arange(N)``) says which noise each row gets. Computed in float64 for float64 logits, float32
    otherwise. Returns ``(candidate long [N], confidence [N])`` and the entropy of
    ``softmax(logits)`` when ``return_entropy``.
    """
    x = logits.to(_compute_dtype(logits.dtype))
    if mask_id is not None:
        x = x.clone()
        x[:, mask_id] = float("-inf")
    if row_ids is None:
        row_ids = torch.arange(x.shape[0], device=x.device)
    if temperature >= 1:
        score = x / temperature + gumbel_noise(seed, step, row_ids, x.shape[1]).to(x.dtype)
    elif temperature > 0:
        # The same argmax, scaled by T: 1 / T of a tiny temperature overflows.
        score = x + gumbel_noise(seed, step, row_ids, x.shape[1]).to(x.dtype) * temperature
    else:
        score = x
    candidate = score.argmax(dim=1)  # the first (lowest) index among equal maxima
    logp = torch.log_softmax(x, dim=1)
    confidence = logp.gather(1, candidate[:, None]).squeeze(1).exp()
    if not return_entropy:
        return candidate, confidence
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(1)
    return candidate, confidence, entropy


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Full ``[N, V]`` logits ``hidden [N, H] @ weight [V, H].T + bias [V]`` (float64 for float64 inputs, else float32)."""
    dtype = _compute_dtype(hidden.dtype)
    logits = hidden.to(dtype) @ weight.to(dtype).T
    return logits if bias is None else logits + bias.to(dtype)


def sample_step_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    seed: int,
    step: int,
    row_ids: torch.Tensor | None = None,
    mask_id: int | None = None,
    return_entropy: bool = False,
):
    """[`sample_step`][daca_kernels.reference.sampling.sample_step] of the full logits ``hidden [N, H] @ weight [V, H].T + bias [V]``."""
    return sample_step(linear_logits(hidden, weight, bias), temperature, seed, step, row_ids, mask_id, return_entropy)


def topk_logprob(logits: torch.Tensor, k: int, mask_id: int | None = None):
    """The ``k`` most probable tokens of each row of ``logits [N, V]`` and their log-probabilities.

    Log-probabilities are those of ``softmax(logits)`` with ``mask_id`` excluded (as for the
    confidence). Returns ``(ids long [N, k], logprobs [N, k])``, sorted by decreasing probability.
    """
    x = logits.to(_compute_dtype(logits.dtype))
    if mask_id is not None:
        x = x.clone()
        x[:, mask_id] = float("-inf")
    values, ids = torch.log_softmax(x, dim=1).topk(k, dim=1)
    return ids, values


def transfer_counts(num_masked: int, steps: int) -> list[int]:
    """How many positions each of ``steps`` steps commits (LLaDA's ``get_num_transfer_tokens``):
    every step gets ``num_masked // steps`` and the first ``num_masked % steps`` steps one more."""
    counts = [num_masked // steps] * steps
    for i in range(num_masked % steps):
        counts[i] += 1
    return counts


@dataclass
class ReferenceRollout:
    """What [`reference_generate`][daca_kernels.reference.sampling.reference_generate] returns (``L = P + G``, ``S`` steps).

    sequences long ``[B, L]``; commit_step long ``[B, L]`` (-1 on the prompt); commit_confidence
    ``[B, L]`` (0 on the prompt); step_gain ``[B, S]`` (float64); confidences float64 ``[B, S, L]``:
    ``c_s[j]`` for every position masked at the start of step s, NaN elsewhere; step_logits: the
    full ``[B, L, V]`` logits of every step; nfe: the number of model calls (``S``).
    """

    sequences: torch.Tensor
    commit_step: torch.Tensor
    commit_confidence: torch.Tensor
    step_gain: torch.Tensor
    confidences: torch.Tensor
    step_logits: list
    nfe: int


@torch.no_grad()
def reference_generate(
    lm,
    prompt_ids: torch.Tensor,
    *,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    seed: int = 0,
    prompt_mask: torch.Tensor | None = None,
    row_offset: int = 0,
) -> ReferenceRollout:
    """LLaDA's block-wise sampler, written plainly: full logits every step, all confidences kept.

    ``lm`` is a [`daca_kernels.MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] (only ``logits``, ``mask_id`` and ``shift`` are used);
    ``prompt_ids`` long ``[B, P]``, left padded where ``prompt_mask [B, P]`` is False. At step s the
    positions of the current block with the highest scores are committed (ties: lowest position
    first), their number from [`transfer_counts`][daca_kernels.reference.sampling.transfer_counts]. ``row_offset``: global index of row 0 of
    this call, for sharded batches; noise depends on ``(seed, step, (row_offset + b) * L + position)``.
    """
    mask_id = lm.mask_id
    batch, prompt_length = prompt_ids.shape
    length = prompt_length + gen_length
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    x = torch.full((batch, length), mask_id, dtype=torch.long, device=prompt_ids.device)
    x[:, :prompt_length] = prompt_ids
    attention_mask = None
    if prompt_mask is not None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=x.device)
        attention_mask[:, :prompt_length] = prompt_mask.long()
    commit_step = torch.full((batch, length), -1, dtype=torch.long, device=x.device)
    commit_confidence = torch.zeros(batch, length, dtype=torch.float64, device=x.device)
    confidences = torch.full((batch, steps, length), float("nan"), dtype=torch.float64, device=x.device)
    step_logits = []

    for block in range(num_blocks):
        start = prompt_length + block * block_length
        end = start + block_length
        schedules = [transfer_counts(int((x[b, start:end] == mask_id).sum()), steps_per_block) for b in range(batch)]
        for i in range(steps_per_block):
            step = block * steps_per_block + i
            logits = lm.logits(x, attention_mask)
            step_logits.append(logits)
            b_idx, pos = (x == mask_id).nonzero(as_tuple=True)
            predicting = logits[b_idx, pos - 1] if lm.shift else logits[b_idx, pos]
            row_ids = (row_offset + b_idx) * length + pos
            candidate, confidence = sample_step(predicting, temperature, seed, step, row_ids, mask_id)
            confidences[b_idx, step, pos] = confidence.double()
            if remasking == "random":
                scores = remasking_uniforms(seed, step, row_ids)
            else:
                scores = confidence
            for b in range(batch):
                in_block = [
                    (float(scores[n]), int(pos[n]), n)
                    for n in range(len(pos))
                    if int(b_idx[n]) == b and start <= int(pos[n]) < end
                ]
                in_block.sort(key=lambda item: (-item[0], item[1]))
                for _, p, n in in_block[: schedules[b][i]]:
                    x[b, p] = candidate[n]
                    commit_step[b, p] = step
                    commit_confidence[b, p] = confidence[n].double()

    return ReferenceRollout(
        sequences=x,
        commit_step=commit_step,
        commit_confidence=commit_confidence,
        step_gain=step_gain_from_history(confidences, commit_step),
        confidences=confidences,
        step_logits=step_logits,
        nfe=steps,
    )
