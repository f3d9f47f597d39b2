"""Pure-PyTorch references: the executable specification of every op (float64-capable)."""
from daca_kernels.reference import losses
from daca_kernels.reference.dps import confidence_delta, dps_weights, step_gain_from_history
from daca_kernels.reference.likelihood import masked_copies_logprob
from daca_kernels.reference.logprob import gather_logprob, linear_logprob, stratified_gather_logprob
from daca_kernels.reference.masking import stratified_mask
from daca_kernels.reference.sampling import (
    linear_logits,
    reference_generate,
    sample_step,
    sample_step_linear,
    topk_logprob,
)

__all__ = [
    "confidence_delta",
    "dps_weights",
    "gather_logprob",
    "linear_logits",
    "linear_logprob",
    "losses",
    "masked_copies_logprob",
    "reference_generate",
    "sample_step",
    "sample_step_linear",
    "step_gain_from_history",
    "stratified_gather_logprob",
    "stratified_mask",
    "topk_logprob",
]
