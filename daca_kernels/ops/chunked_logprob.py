"""Memory-bounded PyTorch path for log-probabilities of chosen targets (no Triton needed).

Same contract as the launchers of ``daca_kernels.kernels.logprob``: rows are processed a chunk at
a time so the working set is a few chunks of at most ``CHUNK_ELEMENTS`` logits, only the selected
rows are read, and backward recomputes the softmax of each chunk instead of keeping it.
"""
from __future__ import annotations

import torch

from daca_kernels.precision import accumulation_dtype

CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk(logits: torch.Tensor, rows: torch.Tensor | None, lo: int, hi: int, acc: torch.dtype) -> torch.Tensor:
    """Float ``[hi - lo, V]`` logits of targets ``lo:hi`` (a view when no copy is needed)."""
    if rows is None and logits.dim() == 2:
        return logits[lo:hi].to(acc)
    flat_rows = torch.arange(lo, hi, device=logits.device) if rows is None else rows[lo:hi].to(torch.int64)
    return logits[torch.unravel_index(flat_rows, logits.shape[:-1])].to(acc)


def _scaled(x: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    return x if inv_temperature == 1.0 else x * inv_temperature


def logprob_forward(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: float,
    return_entropy: bool,
):
    """See ``daca_kernels.kernels.logprob.logprob_forward``."""
    n, V = targets.shape[0], logits.shape[-1]
    acc = accumulation_dtype(logits.dtype)
    out = torch.empty(n, dtype=acc, device=logits.device)
    stats = torch.empty(n, 2, dtype=acc, device=logits.device)
    entropy = torch.empty(n if return_entropy else 0, dtype=acc, device=logits.device)
    step = _chunk_rows(V)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x = _scaled(_chunk(logits, rows, lo, hi, acc), inv_temperature)
        index = targets[lo:hi].long().unsqueeze(1)
        logp = torch.log_softmax(x, dim=-1)
        out[lo:hi] = logp.gather(1, index).squeeze(1)
        row_max = x.max(dim=-1).values
        stats[lo:hi, 0] = row_max
        stats[lo:hi, 1] = torch.logsumexp(x - row_max[:, None], dim=-1)
        if return_entropy:
            p = logp.exp()
            entropy[lo:hi] = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return out, stats, entropy


def logprob_backward(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    rows_unique: bool,
    targets: torch.Tensor,
    grad_out: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    inv_temperature: float,
    dlogits: torch.Tensor,
) -> None:
    """See ``daca_kernels.kernels.logprob.logprob_backward``: the softmax comes from ``stats``, so
    ``logits`` may be a slice of the vocabulary, and a target outside ``[0, V)`` adds no one-hot term."""
    n, V = targets.shape[0], logits.shape[-1]
    acc = stats.dtype
    # Repeated rows are summed in the accumulation dtype and rounded once: partial sums rounded to
    # half precision lose what later contributions cancel (many units in the last place of the sum).
    summed = None
    if rows is not None and not rows_unique:
        summed = dlogits if dlogits.dtype == acc else torch.zeros(dlogits.shape, dtype=acc, device=dlogits.device)
        summed.index_fill_(0, rows.to(torch.int64), 0)
    step = _chunk_rows(V)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        g = grad_out[lo:hi].to(acc).unsqueeze(1)
        x = _scaled(_chunk(logits, rows, lo, hi, acc), inv_temperature)
        logp = (x - stats[lo:hi, :1]) - stats[lo:hi, 1:]
        d = logp.exp()
        if grad_entropy is not None:
            # d H / d x_j = -p_j (log p_j + H)
            logp.add_(entropy[lo:hi].unsqueeze(1)).mul_(grad_entropy[lo:hi].to(acc).unsqueeze(1))
            d.mul_(torch.where(d > 0, logp, 0.0).add_(g).neg_())
        else:
            d.mul_(-g)
        t = targets[lo:hi].long().unsqueeze(1)
        d.scatter_add_(1, t.clamp(0, V - 1), torch.where((t >= 0) & (t < V), g, 0.0))
        d = _scaled(d, inv_temperature)
        if rows is None:
            dlogits[lo:hi] = d
        elif rows_unique:
            dlogits[rows[lo:hi].to(torch.int64)] = d.to(dlogits.dtype)
        else:
            summed.index_add_(0, rows[lo:hi].to(torch.int64), d)
    if summed is not None and summed is not dlogits:
        touched = rows.to(torch.int64)
        dlogits[touched] = summed[touched].to(dlogits.dtype)
