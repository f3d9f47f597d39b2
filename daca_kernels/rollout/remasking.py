"""Which masked positions a denoising step commits: the commit rules of LLaDA's and Dream's samplers.

[`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] asks its commit rule once per step which of the still-masked
positions to commit ([`BlockCommits.select`][daca_kernels.rollout.remasking.BlockCommits.select],
[`DreamCommits.select`][daca_kernels.rollout.remasking.DreamCommits.select]); everything else in
the loop (model calls, candidates, DPS bookkeeping, branching) is shared.

LLaDA ([`BlockCommits`][daca_kernels.rollout.remasking.BlockCommits]): a block of ``block_length`` masked positions is decoded over
``steps`` steps; step ``i`` commits ``transfer_counts(block_length, steps)[i]`` positions, those up
to the end of the current block with the highest score. With ``remasking="low_confidence"`` the
score is the candidate's confidence; with ``"random"`` it is [`remasking_uniforms`][daca_kernels.rollout.remasking.remasking_uniforms],
a uniform
number from the counter hash of ``(seed, step, row id)``.

Dream ([`DreamCommits`][daca_kernels.rollout.remasking.DreamCommits], the rule of ``diffusion_generate`` in Dream's released
``generation_utils.py``): the whole completion is one block and time runs over
``linspace(1, eps, steps + 1)``; step ``i`` goes from ``t`` to ``s``, the next value. ``alg="origin"``
reveals each masked position independently with probability ``1 - s / t`` (1 at the last step), the
reveal draw being [`remasking_uniforms`][daca_kernels.rollout.remasking.remasking_uniforms]. Every other ``alg`` commits the same number of
positions in every row, [`DreamCommits.reveal_count`][daca_kernels.rollout.remasking.DreamCommits.reveal_count], those with the highest
score (the
``alg``'s confidence), or with ``alg_temp > 0`` a draw without replacement from
``softmax(score / alg_temp)`` over the row's masked positions, taken as the top ``k`` of
``score / alg_temp + g`` with Gumbel noise ``g = -log(-log(u))`` of the same uniforms (the
Gumbel-top-k trick: the same distribution as drawing one position at a time).

Ties in a score go to the lowest position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from daca_kernels.hashing import STREAM_RANDOM_REMASK, hash4, seed32, uniform_from_hash

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def transfer_counts(num_masked: int, steps: int) -> list[int]:
    """How many of ``num_masked`` positions each of ``steps`` steps commits: an even split, the
    remainder going one each to the first steps (LLaDA's schedule)."""
    base, remainder = divmod(num_masked, steps)
    return [base + (i < remainder) for i in range(steps)]


def remasking_uniforms(seed: int, step: int, row_ids: Tensor) -> Tensor:
    """float32 ``[N]``: the ``remasking="random"`` score of the rows ``row_ids`` (integer ``[N]``)
    at ``step``, ``uniform_from_hash(hash4(seed32(seed), STREAM_RANDOM_REMASK, step, row_id, 0))``;
    also Dream's reveal draw (``alg="origin"``) and the uniforms of its position noise (``alg_temp``)."""
    return uniform_from_hash(hash4(seed32(seed), STREAM_RANDOM_REMASK, step, row_ids.long(), 0))


def top_per_row(score: Tensor, eligible: Tensor, k: int, b_idx: Tensor, pos: Tensor, shape: tuple[int, int]) -> Tensor:
    """bool ``[N]``: in each row, the ``k`` eligible entries with the highest score (all of them
    when the row has fewer); among equal scores the lowest position first.

    Args:
        score: floating ``[N]``, finite, one per entry ``(b_idx[n], pos[n])``.
        eligible: bool ``[N]``, the entries that may be chosen.
        k: int >= 0.
        b_idx: long ``[N]``, the row of each entry.
        pos: long ``[N]``, the position of each entry; the ``(b_idx, pos)`` pairs are distinct and
            inside ``shape = (B, L)``.
    """
    table = torch.full(shape, float("-inf"), dtype=score.dtype, device=score.device)
    table[b_idx[eligible], pos[eligible]] = score[eligible]
    # Stable descending sort: among equal scores the lowest position comes first.
    order = torch.sort(table, dim=1, descending=True, stable=True).indices[:, :k]
    picked = torch.zeros(shape, dtype=torch.bool, device=score.device).scatter_(1, order, True)
    return picked[b_idx, pos] & eligible


@dataclass(frozen=True)
class BlockCommits:
    """LLaDA's commit rule: blocks decoded left to right, [`transfer_counts`][daca_kernels.rollout.remasking.transfer_counts] positions
    a step.

    Attributes:
        prompt_length: ``P``.
        block_length: positions per block.
        steps_per_block: steps per block.
        remasking: ``"low_confidence"`` (score: the candidate's confidence) or ``"random"``.
    """

    prompt_length: int
    block_length: int
    steps_per_block: int
    remasking: str

    def select(self, step: int, seed: int, b_idx: Tensor, pos: Tensor, row_ids: Tensor, score: Tensor,
               shape: tuple[int, int]) -> Tensor:
        """bool ``[N]``: which of the masked positions ``(b_idx, pos)`` (long ``[N]``, hashed as
        ``row_ids``) step ``step`` commits, given the candidates' ``score`` (``[N]``)."""
        count = transfer_counts(self.block_length, self.steps_per_block)[step % self.steps_per_block]
        # Every masked position up to the block's end competes: under the default candidate rule these
        # are the block's own; with the mask id a candidate also the holes it left in earlier blocks.
        eligible = pos < self.prompt_length + (step // self.steps_per_block + 1) * self.block_length
        if self.remasking == "random":
            score = remasking_uniforms(seed, step, row_ids).to(score.dtype)
        return top_per_row(score, eligible, count, b_idx, pos, shape)


@dataclass(frozen=True)
class DreamCommits:
    """Dream's commit rule (see the module docstring).

    Attributes:
        steps: ``S``.
        eps: the schedule's last time, in ``[0, 1)``.
        alg: one of [`DREAM_ALGS`][daca_kernels.rollout.remasking.DREAM_ALGS].
        alg_temp: float >= 0; 0 commits the top scores, > 0 draws positions from
            ``softmax(score / alg_temp)`` (not read by ``"origin"``).
    """

    steps: int
    eps: float
    alg: str
    alg_temp: float

    def reveal_fraction(self, step: int) -> Tensor | int:
        """``1 - s / t`` at ``step`` (a float32 0-d CPU tensor, computed as the released code does
        in the default dtype), 1 at the last step."""
        if step == self.steps - 1:
            return 1
        timesteps = torch.linspace(1, self.eps, self.steps + 1)
        return 1 - timesteps[step + 1] / timesteps[step]

    def reveal_count(self, step: int, num_masked: int, batch: int) -> int:
        """Positions per row committed at ``step`` when ``num_masked`` positions of ``batch`` rows are
        masked: ``int(num_masked / batch * (1 - s / t))`` in float32 (all of the mean at the last step)."""
        return int(torch.tensor(num_masked) / batch * self.reveal_fraction(step))

    def select(self, step: int, seed: int, b_idx: Tensor, pos: Tensor, row_ids: Tensor, score: Tensor,
               shape: tuple[int, int]) -> Tensor:
        """As [`BlockCommits.select`][daca_kernels.rollout.remasking.BlockCommits.select]; ``score`` is the ``alg``'s confidence of
        each candidate."""
        if self.alg == "origin":
            return remasking_uniforms(seed, step, row_ids) < self.reveal_fraction(step)
        count = self.reveal_count(step, b_idx.numel(), shape[0])
        if self.alg_temp > 0 and count > 0:
            gumbel = -torch.log(-torch.log(remasking_uniforms(seed, step, row_ids)))
            score = score / self.alg_temp + gumbel.to(score.dtype)
        return top_per_row(score, torch.ones_like(b_idx, dtype=torch.bool), count, b_idx, pos, shape)


def threshold_or_top(score: Tensor, eligible: Tensor, k: int, threshold: float | None, b_idx: Tensor, pos: Tensor,
                     shape: tuple[int, int]) -> Tensor:
    """bool ``[N]``: the commits of SDAR's ``low_confidence_dynamic`` and LLaDA2's threshold rule. In
    each row, every eligible entry whose score exceeds ``threshold`` when there are at least ``k`` of
    them, else the ``k`` eligible entries with the highest score ([`top_per_row`][daca_kernels.rollout.remasking.top_per_row]; all of
    them when
    the row has fewer). ``threshold=None`` is [`top_per_row`][daca_kernels.rollout.remasking.top_per_row] alone. Arguments as there."""
    top = top_per_row(score, eligible, k, b_idx, pos, shape)
    if threshold is None:
        return top
    high = eligible & (score > threshold)
    count = torch.zeros(shape[0], dtype=torch.long, device=score.device).index_add_(0, b_idx, high.long())
    return torch.where(count[b_idx] >= k, high, top)
