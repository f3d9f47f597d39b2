"""daca-kernels: fused kernels and estimators for RL post-training of masked diffusion LMs."""
from daca_kernels.ops import gather_logprob, linear_logprob, stratified_gather_logprob

__version__ = "0.1.0"

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]

from daca_kernels.losses import (  # noqa: E402
    bgpo_backward,
    bgpo_loss,
    dispo_step_loss,
    elbo_sample_scores,
    eubo_scores,
    group_advantages,
    grpo_loss,
    k3_kl,
    mixed_objective,
    spg_loss,
)

__all__ += [
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
]
