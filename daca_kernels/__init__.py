"""daca-kernels: fused kernels and estimators for RL post-training of masked diffusion LMs."""
from daca_kernels.likelihood import (
    ElboSamples,
    branch_logprob,
    coupled_logprob,
    elbo_sample,
    elbo_samples,
    masked_logprob,
    one_step_logprob,
    stratified_logprob,
)
from daca_kernels.losses import (
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
from daca_kernels.masked_lm import MaskedLM
from daca_kernels.ops import (
    StratifiedMask,
    confidence_delta,
    gather_logprob,
    linear_logprob,
    linear_topk_logprob,
    sample_step,
    sample_step_linear,
    stratified_gather_logprob,
    stratified_mask,
)

__version__ = "0.2.0"

__all__ = [
    "ElboSamples",
    "MaskedLM",
    "StratifiedMask",
    "bgpo_backward",
    "bgpo_loss",
    "branch_logprob",
    "confidence_delta",
    "coupled_logprob",
    "dispo_step_loss",
    "elbo_sample",
    "elbo_sample_scores",
    "elbo_samples",
    "eubo_scores",
    "gather_logprob",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "linear_logprob",
    "linear_topk_logprob",
    "masked_logprob",
    "mixed_objective",
    "one_step_logprob",
    "sample_step",
    "sample_step_linear",
    "spg_loss",
    "stratified_gather_logprob",
    "stratified_logprob",
    "stratified_mask",
]
