"""The denoising sampler: [`generate`][daca_kernels.rollout.sampler.generate] and its [`Rollout`][daca_kernels.rollout.record.Rollout],
for every model family.

One package, one module per concept:

- ``sampler``: [`generate`][daca_kernels.rollout.sampler.generate] (LLaDA's block-wise remasking and Dream's sampler on full-attention
  models; block-causal models go to ``blockwise``), DiSPO's [`branch`][daca_kernels.rollout.sampler.branch],
  [`rescore_commits`][daca_kernels.rollout.sampler.rescore_commits];
- ``rules``: the options object of each rule ([`LLaDASampler`][daca_kernels.rollout.rules.LLaDASampler],
  [`DreamSampler`][daca_kernels.rollout.rules.DreamSampler],
  [`BlockSampler`][daca_kernels.rollout.rules.BlockSampler]), [`generate`][daca_kernels.rollout.sampler.generate]'s ``sampler``;
- ``record``: the [`Rollout`][daca_kernels.rollout.record.Rollout] every decoder returns, its
  [`Decoding`][daca_kernels.rollout.record.Decoding] options, [`answer_mask`][daca_kernels.rollout.record.answer_mask];
- ``remasking``: the commit schedules (LLaDA's blocks, Dream's ``alg``, the confidence threshold);
- ``logit_filters``: top-k and top-p;
- ``branch_states``: the states DiSPO branches from and their top-k cache;
- ``blockwise`` and ``block_cache``: block-wise decoding of block-causal models (SDAR / TraDo, LLaDA2)
  and each family's KV-cache call;
- ``fast_decoding`` and ``prefix_cache``: the approximate prefix / dual KV cache and parallel
  decoding of full-attention models, and each family's cache interface.
"""
from daca_kernels.rollout.record import Decoding, Rollout, answer_mask
from daca_kernels.rollout.rules import BlockSampler, DreamSampler, LLaDASampler
from daca_kernels.rollout.sampler import MASK_CANDIDATES, REMASKING, RULES, Branch, branch, generate, rescore_commits

__all__ = ["MASK_CANDIDATES", "REMASKING", "RULES", "BlockSampler", "Branch", "Decoding", "DreamSampler", "LLaDASampler",
           "Rollout", "answer_mask", "branch", "generate", "rescore_commits"]
