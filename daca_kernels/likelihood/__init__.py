"""Estimators of ``log pi(completion | prompt)`` over a :class:`daca_kernels.masked_lm.MaskedLM`.

All return per-token float32 ``[B, L]`` (or ``[n, B, L]``) values, 0 outside the completion, and
differentiate through the model; the LM head only ever sees the rows it predicts (through
:func:`daca_kernels.linear_logprob`), never full ``[B, L, V]`` logits. :func:`masked_logprob` is
the primitive they are made of: one masked forward pass, the log-probabilities of chosen positions.
"""
from daca_kernels.likelihood.coupled import coupled_logprob
from daca_kernels.likelihood.elbo import ElboSamples, elbo_sample, elbo_samples
from daca_kernels.likelihood.masked_passes import masked_logprob
from daca_kernels.likelihood.stratified import one_step_logprob, stratified_logprob

__all__ = [
    "ElboSamples",
    "coupled_logprob",
    "elbo_sample",
    "elbo_samples",
    "masked_logprob",
    "one_step_logprob",
    "stratified_logprob",
]
