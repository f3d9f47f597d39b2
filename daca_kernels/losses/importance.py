"""Truncated importance weights for rollouts whose sampling distribution is not the one being scored.

A rollout decoded with an approximate KV cache or a confidence threshold
([`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] with ``kv_cache`` or ``threshold``) draws each token from the
model's prediction with stale keys and values (or in parallel with tokens it has not seen), while the
trainer scores the tokens with full forwards. RL for autoregressive models meets the same gap between
an inference engine and the trainer and corrects it with truncated importance sampling (TIS): the
per-token policy-gradient term is multiplied by ``min(pi_score / pi_sample, cap)``, detached. Here

    w = min(exp(target_logp - sampling_logp), cap)

per token (``level="token"``), or one weight per sequence, ``min(exp(sum_i (target - sampling)), cap)``
over its masked tokens (``level="sequence"``), where ``sampling_logp`` is
``Rollout.commit_logprob`` and ``target_logp`` the same tokens scored by full forwards of the same
states ([`daca_kernels.rollout.rescore_commits`][daca_kernels.rollout.sampler.rescore_commits]). Multiply the result into the losses'
``token_weights`` (with DPS weights, their product). Tokens outside ``mask`` get 0.

When to use it: only for rollouts with ``Rollout.decoding.exact`` False, and when the logged gap
(``target - sampling``, e.g. its mean absolute value) is large enough to matter; the rescoring costs
the forwards the cache saved, without the sampling, so it pays where rollouts are sampled once and
scored many times, or on a fraction of the batch to monitor the gap. Exact rollouts have weight 1 up to
float rounding; the cap bounds the variance the weights add (TRL's default cap for its engine
correction is 3).
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.validation import FLOAT_DTYPES, check_choice, check_shape, check_tensor

LEVELS = ("token", "sequence")


def truncated_importance_weights(target_logp: Tensor, sampling_logp: Tensor, mask: Tensor, *, cap: float = 3.0,
                                 level: str = "token") -> Tensor:
    """Detached weights ``[B, L]`` (module docstring), float32 (float64 for float64 inputs).

    Args:
        target_logp: floating ``[B, L]``, the tokens' log-probabilities under the distribution being
            scored (full forwards: [`daca_kernels.rollout.rescore_commits`][daca_kernels.rollout.sampler.rescore_commits]).
        sampling_logp: floating ``[B, L]``, under the distribution they were drawn from
            (``Rollout.commit_logprob``).
        mask: bool ``[B, L]``, the tokens that count; other values are ignored (may be anything).
        cap: float > 0, the truncation.
        level: ``"token"`` or ``"sequence"``.
    """
    check_tensor(target_logp, "target_logp", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(sampling_logp, "sampling_logp", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(mask, "mask", ndim=2, dtypes=(torch.bool,))
    check_shape(sampling_logp, "sampling_logp", target_logp.shape, "[B, L] (from target_logp)")
    check_shape(mask, "mask", target_logp.shape, "[B, L] (from target_logp)")
    if sampling_logp.device != target_logp.device or mask.device != target_logp.device:
        raise ValueError("target_logp, sampling_logp and mask must be on one device")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or cap != cap:
        raise ValueError(f"cap must be a number > 0, got {cap!r}")
    check_choice(level, "level", LEVELS)
    dtype = torch.float64 if torch.float64 in (target_logp.dtype, sampling_logp.dtype) else torch.float32
    with torch.no_grad():
        diff = torch.where(mask, target_logp.to(dtype) - sampling_logp.to(dtype), 0.0)
        if level == "sequence":
            diff = diff.sum(dim=1, keepdim=True).expand_as(diff)
        weights = torch.exp(diff.clamp(max=float(torch.log(torch.tensor(float(cap), dtype=torch.float64)))))
        return torch.where(mask, weights.clamp(max=cap), 0.0)
