"""BGPO: a lower bound of the ELBO-based objective that is linear in the Monte-Carlo samples.

The ELBO-based objective of a sequence with advantage A replaces the intractable likelihood ratio by
the ratio of MC ELBO estimates over n samples (the same masks under both policies)::

    J = A * exp(mean_j d_j),    d_j = l_j - l_old_j,

with ``l_j`` the sequence score of sample j (e.g. [`elbo_sample_scores`][daca_kernels.losses.elbo.elbo_sample_scores]). Its gradient needs
all n samples' graphs at once. BGPO maximises instead, per sample j::

    g_j = (1 + d_j) * A / n    if A >= 0   (exp(x) >= 1 + x)
    g_j = exp(d_j)  * A / n    if A <  0   (Jensen: exp(mean_j d_j) <= mean_j exp(d_j))

so ``sum_j g_j <= J`` always, with equal value (A) and equal gradient (``A * mean_j grad l_j``)
on-policy (``d = 0``). Each term depends on one sample, so gradients can be accumulated sample by
sample ([`bgpo_backward`][daca_kernels.losses.bgpo.bgpo_backward]): memory constant in n.

Per-token weights (DPS) enter through the scores: weight each token's log-probability before it is
summed into ``l_j`` (``elbo_sample_scores(..., token_weights=w)``), identically for the current and
the old policy.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from daca_kernels.losses.checks import compute_dtype
from daca_kernels.validation import FLOAT_DTYPES, check_bool, check_float_tensor, check_int, check_tensor


def _bound_terms(sample_logp: Tensor, old_sample_logp: Tensor, advantages: Tensor, num_samples: int) -> Tensor:
    """``g_j`` for every sample and sequence; any leading sample dims broadcast against ``[B]``."""
    dtype = compute_dtype(sample_logp, old_sample_logp, advantages)
    log_ratio = sample_logp.to(dtype) - old_sample_logp.to(dtype)
    adv = advantages.to(dtype)
    negative = adv < 0
    # exp only where it is used: an overflowing exp in the unused branch would make its zero
    # gradient 0 * inf = NaN.
    factor = torch.where(negative, torch.exp(torch.where(negative, log_ratio, torch.zeros_like(log_ratio))), 1.0 + log_ratio)
    return factor * adv / num_samples


def _metrics(log_ratio_sum: Tensor, count: int) -> dict[str, Tensor]:
    return {"sample_log_ratio_mean": log_ratio_sum.detach() / count}


def bgpo_loss(sample_logp: Tensor, old_sample_logp: Tensor, advantages: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """BGPO's loss ``-(1/B) * sum_b sum_j g_j[b]`` (module docstring), all samples at once.

    Args:
        sample_logp: floating ``[n, B]``, the score ``l_j`` of each sequence in each MC sample under
            the current policy (differentiable).
        old_sample_logp: ``[n, B]``, the same scores (same masks) under the sampling policy.
        advantages: ``[B]``.

    Returns ``(loss, metrics)``: the 0-d loss (mean over the B sequences; float32, float64 if any
    input is float64) and ``{"sample_log_ratio_mean": mean of d_j over samples and sequences}``
    (detached).
    """
    check_tensor(sample_logp, "sample_logp", ndim=2, dtypes=FLOAT_DTYPES)
    num_samples, batch = sample_logp.shape
    if num_samples == 0 or batch == 0:
        raise ValueError(f"sample_logp must be non-empty, got shape {tuple(sample_logp.shape)}")
    same = (sample_logp, "sample_logp")
    check_float_tensor(old_sample_logp, "old_sample_logp", (num_samples, batch), "[n, B]", same)
    check_float_tensor(advantages, "advantages", (batch,), "[B]", same)
    terms = _bound_terms(sample_logp, old_sample_logp, advantages, num_samples)
    loss = -terms.sum(dim=0).mean()
    return loss, _metrics((sample_logp - old_sample_logp).sum(), num_samples * batch)


def bgpo_backward(
    sample_fn: Callable[[int], Tensor],
    num_samples: int,
    old_sample_logp: Tensor | None,
    advantages: Tensor,
    *,
    backward: Callable[[Tensor], object] = Tensor.backward,
    keep_last: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Back-propagate [`bgpo_loss`][daca_kernels.losses.bgpo.bgpo_loss] one MC sample at a time (peak memory of one sample).

    For j = 0 .. n-1: ``l_j = sample_fn(j)`` (``[B]``, with its graph, computed by the caller from
    the model, e.g. one masked forward and [`elbo_sample_scores`][daca_kernels.losses.elbo.elbo_sample_scores]), then ``backward`` of that
    sample's share ``-(1/B) sum_b g_j[b]``; the graph of sample j is freed before sample j+1 is
    built. Gradients accumulate into the ``.grad`` of the leaves, exactly as ``bgpo_loss(...)
    .backward()`` on the stacked scores would leave them. The loss is linear in the advantages: for
    gradient accumulation over micro-batches, scale ``advantages``.

    Args:
        sample_fn: ``j -> l_j``, a floating ``[B]`` tensor that requires grad.
        num_samples: n >= 1.
        old_sample_logp: ``[n, B]``, the sampling policy's scores for the same samples, or None for
            each sample's own scores detached (on-policy: ratio 1).
        advantages: ``[B]``.
        backward: called with each sample's 0-d share to back-propagate it (default
            ``Tensor.backward``; a trainer passes e.g. ``accelerator.backward``).
        keep_last: leave the last sample's share un-propagated and return it with its graph (plus
            the other shares' detached values), for a caller whose training step runs the final
            backward itself.

    Returns ``(loss, metrics)`` as [`bgpo_loss`][daca_kernels.losses.bgpo.bgpo_loss], detached (the loss keeps the last share's
    graph with ``keep_last``).
    """
    if not callable(sample_fn):
        raise TypeError(f"sample_fn must be callable, got {type(sample_fn).__name__}")
    if not callable(backward):
        raise TypeError(f"backward must be callable, got {type(backward).__name__}")
    num_samples = check_int(num_samples, "num_samples", low=1)
    keep_last = check_bool(keep_last, "keep_last")
    if old_sample_logp is None:
        check_tensor(advantages, "advantages", ndim=1, dtypes=FLOAT_DTYPES)
        batch, like = advantages.shape[0], (advantages, "advantages")
    else:
        check_tensor(old_sample_logp, "old_sample_logp", ndim=2, dtypes=FLOAT_DTYPES)
        if old_sample_logp.shape[0] != num_samples:
            raise ValueError(f"old_sample_logp must have num_samples = {num_samples} rows, "
                             f"got shape {tuple(old_sample_logp.shape)}")
        batch, like = old_sample_logp.shape[1], (old_sample_logp, "old_sample_logp")
        check_float_tensor(advantages, "advantages", (batch,), "[B]", like)
    if batch == 0:
        raise ValueError(f"{like[1]} must have at least one sequence (B >= 1)")

    shares, log_ratio_sums = [], []
    for j in range(num_samples):
        scores = sample_fn(j)
        name = f"sample_fn({j})"
        check_float_tensor(scores, name, (batch,), "[B]", like)
        if not scores.requires_grad:
            raise ValueError(f"{name} must return scores that require grad (computed from the model)")
        old = scores.detach() if old_sample_logp is None else old_sample_logp[j]
        share = -_bound_terms(scores, old, advantages, num_samples).mean()
        log_ratio_sums.append((scores.detach() - old).sum())
        if keep_last and j == num_samples - 1:
            done = torch.stack(shares).sum() if shares else torch.zeros_like(share.detach())
            return share + done, _metrics(torch.stack(log_ratio_sums).sum(), num_samples * batch)
        backward(share)
        shares.append(share.detach())
    return torch.stack(shares).sum(), _metrics(torch.stack(log_ratio_sums).sum(), num_samples * batch)
