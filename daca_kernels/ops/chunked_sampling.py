"""Memory-bounded PyTorch path for one denoising step (no Triton needed).

Same contract as ``daca_kernels.kernels.sampling.sample_step_forward``: rows are processed a chunk
at a time so the working set is a few chunks of at most ``CHUNK_ELEMENTS`` logits, and the Gumbel
noise is regenerated from the counter hash of ``daca_kernels.hashing`` (the same words
and formula as the kernel's exact noise), never stored for all rows.
"""
from __future__ import annotations

import torch

from daca_kernels import hashing
from daca_kernels.precision import accumulation_dtype

CHUNK_ELEMENTS = 1 << 20


def sample_step_forward(
    logits: torch.Tensor,
    row_ids: torch.Tensor,
    logit_scale: float,
    noise_scale: float,
    seed: int,
    step: int,
    stream: int,
    mask_id: int,
    return_entropy: bool,
):
    """See ``daca_kernels.kernels.sampling.sample_step_forward``."""
    n, V = logits.shape
    acc = accumulation_dtype(logits.dtype)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    confidence = torch.empty(n, dtype=acc, device=logits.device)
    entropy = torch.empty(n if return_entropy else 0, dtype=acc, device=logits.device)
    vocab_ids = torch.arange(V, device=logits.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(V, 1))
    for lo in range(0, n, rows_per_chunk):
        hi = min(n, lo + rows_per_chunk)
        x = logits[lo:hi].to(acc)
        if mask_id >= 0:
            x = x.index_fill(1, vocab_ids[mask_id : mask_id + 1], float("-inf"))
        if noise_scale > 0:
            words = hashing.gumbel_hash(seed, step, row_ids[lo:hi, None], vocab_ids[None, :], stream)
            gumbel = -torch.log(-torch.log(hashing.uniform_from_hash(words)))
            score = x * logit_scale + gumbel.to(acc) * noise_scale
        else:
            score = x
        chosen = score.argmax(dim=1)  # the first (lowest) index among equal maxima
        logp = torch.log_softmax(x, dim=1)
        tokens[lo:hi] = chosen
        confidence[lo:hi] = logp.gather(1, chosen[:, None]).squeeze(1).exp()
        if return_entropy:
            p = logp.exp()
            entropy[lo:hi] = -(p * torch.where(p > 0, logp, 0.0)).sum(1)
    return tokens, confidence, entropy
