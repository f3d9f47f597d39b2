"""Readable reference for log-probabilities of chosen targets: plain ``log_softmax`` + gather.

These functions are the executable specification of [`daca_kernels.gather_logprob`][daca_kernels.ops.gather_logprob],
[`daca_kernels.stratified_gather_logprob`][daca_kernels.ops.gather_logprob.stratified_gather_logprob] and
[`daca_kernels.linear_logprob`][daca_kernels.ops.linear_logprob]. They
materialise full logits and differentiate through ordinary autograd. Half and bfloat16 inputs are
computed in float32; float64 inputs stay float64 (the tests use them as the ground truth).
"""
from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """``log_softmax(logits[rows[n]] / temperature)[targets[n]]`` for every n.

    logits: ``[..., V]`` (leading dims flattened to rows); targets: integer ``[N]``;
    rows: integer ``[N]`` or None (row n for target n). Returns float32 ``[N]`` (float64 for
    float64 logits), and the entropy of each selected row's distribution when ``return_entropy``.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    if rows is not None:
        flat = flat[rows.long()]
    x = flat.to(_compute_dtype(logits.dtype)) / temperature
    logp = torch.log_softmax(x, dim=-1)
    out = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return out
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return out, entropy


def stratified_gather_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    strata: torch.Tensor,
    shift: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-stratum gather: ``out[b, i]`` is read from masked copy ``strata[b, i]`` of ``logits``.

    logits ``[K, B, L, V]``; targets and strata ``[B, L]``. With ``shift`` the logit at position
    ``i - 1`` predicts token ``i`` (Dream / DiffuCoder). ``out`` is 0 where ``strata < 0``.
    """
    num_strata = logits.shape[0]
    x = logits.to(_compute_dtype(logits.dtype)) / temperature
    if shift:
        x = torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], dim=2)
    logp = torch.log_softmax(x, dim=-1)
    per_copy = logp.gather(-1, targets.long().expand(num_strata, -1, -1).unsqueeze(-1)).squeeze(-1)
    out = torch.zeros_like(per_copy[0])
    for k in range(num_strata):
        out = torch.where(strata == k, per_copy[k], out)
    return out


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """``gather_logprob(hidden @ weight.T + bias, targets)`` with the full ``[N, V]`` logits.

    hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, targets ``[N]``.
    """
    dtype = _compute_dtype(hidden.dtype)
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    return gather_logprob(logits, targets, temperature=temperature, return_entropy=return_entropy)
