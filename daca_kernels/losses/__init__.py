"""Objectives for RL post-training over per-token / per-sample log-probabilities (pure PyTorch).

GRPO family (GRPO, BNPO, Dr. GRPO, DAPO normalisations; GSPO) and group-relative advantages.
"""
from daca_kernels.losses.advantages import group_advantages
from daca_kernels.losses.grpo import grpo_loss, k3_kl

__all__ = [
    "group_advantages",
    "grpo_loss",
    "k3_kl",
]
