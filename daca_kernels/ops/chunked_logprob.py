"""Memory-bounded PyTorch path for log-probabilities of chosen targets (no Triton needed).

Same contract as the launchers of ``daca_kernels.kernels.logprob``: rows are processed a chunk at
a time so the float32 working set is at most ``CHUNK_ELEMENTS`` logits, only the selected rows are
read, and backward recomputes the softmax from the saved log-sum-exp.
"""
from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _select_rows(logits: torch.Tensor, rows: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    index = torch.unravel_index(rows.to(torch.int64), logits.shape[:-1])
    return logits[index].to(acc)


def logprob_forward(
    logits: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    return_entropy: bool,
):
    """See ``daca_kernels.kernels.logprob.logprob_forward``."""
    n, V = targets.shape[0], logits.shape[-1]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(n, dtype=acc, device=logits.device)
    lse = torch.empty(n, dtype=acc, device=logits.device)
    entropy = torch.empty(n if return_entropy else 0, dtype=acc, device=logits.device)
    step = _chunk_rows(V)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x = _select_rows(logits, rows[lo:hi], acc) * inv_temperature
        chunk_lse = torch.logsumexp(x, dim=-1)
        lse[lo:hi] = chunk_lse
        out[lo:hi] = x.gather(1, targets[lo:hi].long().unsqueeze(1)).squeeze(1) - chunk_lse
        if return_entropy:
            logp = x - chunk_lse.unsqueeze(1)
            p = logp.exp()
            entropy[lo:hi] = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return out, lse, entropy


def logprob_backward(
    logits: torch.Tensor,
    rows: torch.Tensor,
    rows_unique: bool,
    targets: torch.Tensor,
    grad_out: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    inv_temperature: float,
    dlogits: torch.Tensor,
) -> None:
    """See ``daca_kernels.kernels.logprob.logprob_backward``."""
    n, V = targets.shape[0], logits.shape[-1]
    acc = lse.dtype
    rows64 = rows.to(torch.int64)
    if not rows_unique:
        dlogits[torch.unique(rows64)] = 0
    step = _chunk_rows(V)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x = _select_rows(logits, rows64[lo:hi], acc) * inv_temperature
        logp = x - lse[lo:hi].unsqueeze(1)
        p = logp.exp()
        d = p * -grad_out[lo:hi].to(acc).unsqueeze(1)
        if grad_entropy is not None:
            weight = grad_entropy[lo:hi].to(acc).unsqueeze(1)
            d -= weight * p * torch.where(p > 0, logp + entropy[lo:hi].unsqueeze(1), 0.0)
        d.scatter_add_(1, targets[lo:hi].long().unsqueeze(1), grad_out[lo:hi].to(acc).unsqueeze(1))
        d = (d * inv_temperature).to(dlogits.dtype)
        if rows_unique:
            dlogits[rows64[lo:hi]] = d
        else:
            dlogits.index_add_(0, rows64[lo:hi], d)
