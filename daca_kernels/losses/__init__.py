"""Objectives for RL post-training over per-token / per-sample log-probabilities (pure PyTorch).

GRPO family (GRPO, BNPO, Dr. GRPO, DAPO normalisations; GSPO; TRL's CISPO, SAPO, LUSPO and VESPO),
BGPO's sample-linear bound, SPG's sandwiched bounds, DiSPO's step loss, group-relative advantages, and
truncated importance weights for cached or parallel rollouts.
"""
from daca_kernels.losses.advantages import group_advantages
from daca_kernels.losses.bgpo import bgpo_backward, bgpo_loss
from daca_kernels.losses.dispo import dispo_step_loss, mixed_objective
from daca_kernels.losses.elbo import elbo_sample_scores
from daca_kernels.losses.grpo import grpo_loss, k3_kl
from daca_kernels.losses.importance import truncated_importance_weights
from daca_kernels.losses.spg import eubo_scores, spg_loss

__all__ = [
    "bgpo_backward",
    "bgpo_loss",
    "dispo_step_loss",
    "elbo_sample_scores",
    "eubo_scores",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "mixed_objective",
    "spg_loss",
    "truncated_importance_weights",
]
