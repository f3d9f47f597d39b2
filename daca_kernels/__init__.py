"""daca-kernels: fused kernels and estimators for RL post-training of masked diffusion LMs."""
from daca_kernels.ops import gather_logprob, linear_logprob, stratified_gather_logprob

__version__ = "0.1.0"

__all__ = ["gather_logprob", "linear_logprob", "stratified_gather_logprob"]
from daca_kernels.ops import StratifiedMask, stratified_mask
from daca_kernels.likelihood import (
    ElboSamples,
    coupled_logprob,
    elbo_sample,
    elbo_samples,
    one_step_logprob,
    stratified_logprob,
)

__all__ += [
    "StratifiedMask",
    "stratified_mask",
    "ElboSamples",
    "coupled_logprob",
    "elbo_sample",
    "elbo_samples",
    "one_step_logprob",
    "stratified_logprob",
]
