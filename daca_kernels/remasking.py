"""Which masked positions a denoising step commits: LLaDA's schedule and the random remasking score.

A block of ``block_length`` masked positions is decoded over ``steps`` steps; step ``i`` commits
``transfer_counts(block_length, steps)[i]`` positions, those of the block with the highest score.
With ``remasking="low_confidence"`` the score is the candidate's confidence (from
:func:`daca_kernels.sample_step_linear`); with ``"random"`` it is :func:`remasking_uniforms`, a
uniform number from the counter hash of ``(seed, step, row id)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.hashing import STREAM_RANDOM_REMASK, hash4, seed32, uniform_from_hash


def transfer_counts(num_masked: int, steps: int) -> list[int]:
    """How many of ``num_masked`` positions each of ``steps`` steps commits: an even split, the
    remainder going one each to the first steps (LLaDA's schedule)."""
    base, remainder = divmod(num_masked, steps)
    return [base + (i < remainder) for i in range(steps)]


def remasking_uniforms(seed: int, step: int, row_ids: Tensor) -> Tensor:
    """float32 ``[N]``: the ``remasking="random"`` score of the rows ``row_ids`` (integer ``[N]``)
    at ``step``, ``uniform_from_hash(hash4(seed32(seed), STREAM_RANDOM_REMASK, step, row_id, 0))``."""
    return uniform_from_hash(hash4(seed32(seed), STREAM_RANDOM_REMASK, step, row_ids.long(), 0))
