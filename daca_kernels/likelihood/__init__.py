"""Estimators of ``log pi(completion | prompt)`` over a [`daca_kernels.models.masked_lm.MaskedLM`][daca_kernels.models.masked_lm.MaskedLM].

Each takes two bool ``[B, L]`` masks: ``completion_mask``, the generated region (every position the
sampler wrote, the padding after an end-of-sequence token included), which the estimator masks;
and ``loss_mask`` (default: ``completion_mask``), the subset it scores, e.g. the answer up to and
including the first EOS, as d1, DiffuCoder and SPG score it. All return per-token float32
``[B, L]`` (or ``[n, B, L]``) values, 0 outside ``loss_mask``, and differentiate through the model;
the LM head only ever sees the rows it scores (through [`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob]), never
full ``[B, L, V]`` logits. [`masked_logprob`][daca_kernels.likelihood.masked_passes.masked_logprob] is the primitive they are made of:
one masked
forward pass, the log-probabilities of chosen positions. [`estimate_logprob`][daca_kernels.likelihood.estimator.estimate_logprob] picks an
estimator by name and [`estimator_masks`][daca_kernels.likelihood.estimator.estimator_masks] returns the masked inputs of its every
forward pass (to
audit an estimate or rebuild it with plain model calls); [`branch_logprob`][daca_kernels.likelihood.branch.branch_logprob] is DiSPO's
one-step
likelihood at a branch state.

On a block-causal model (``lm.attention == ("block", S)``) every estimator scores block by block:
each scored token from its own noisy block and the clean blocks before it, all blocks of a masked
copy in one forward pass of the noisy/clean layout
([`daca_kernels.MaskedLM.block_hidden`][daca_kernels.models.masked_lm.MaskedLM.block_hidden]),
with the SML strata and the coupled splits drawn within each block
([`daca_kernels.likelihood.block_masks`][daca_kernels.likelihood.block_masks]). A row's blocks are counted from its first attended
position ([`daca_kernels.models.masked_lm.block_index`][daca_kernels.models.masked_lm.block_index]), as the sampler decodes it, so a
left-padded
row is scored under the partition it was sampled under.
"""
from daca_kernels.likelihood.branch import branch_logprob
from daca_kernels.likelihood.coupled import coupled_logprob
from daca_kernels.likelihood.elbo import ElboMask, ElboSamples, elbo_sample, elbo_sample_mask, elbo_samples
from daca_kernels.likelihood.estimator import (
    ESTIMATORS,
    EstimatorMasks,
    EstimatorPass,
    EstimatorSpec,
    MaskSample,
    estimate_logprob,
    estimator_masks,
    monte_carlo_masks,
    prompt_positions,
)
from daca_kernels.likelihood.masked_passes import masked_logprob
from daca_kernels.likelihood.stratified import one_step_logprob, stratified_logprob

__all__ = [
    "ESTIMATORS",
    "ElboMask",
    "ElboSamples",
    "EstimatorMasks",
    "EstimatorPass",
    "EstimatorSpec",
    "MaskSample",
    "branch_logprob",
    "coupled_logprob",
    "elbo_sample",
    "elbo_sample_mask",
    "elbo_samples",
    "estimate_logprob",
    "estimator_masks",
    "masked_logprob",
    "monte_carlo_masks",
    "one_step_logprob",
    "prompt_positions",
    "stratified_logprob",
]
