"""``linear_topk_logprob``: the k most probable tokens of rows through an LM head, chunked.

This is how the sampler caches a denoising state for branching (DiSPO): full logits of every
masked position would take ``N * V`` floats (V = 126,464 for LLaDA), the top k take ``N * k`` ids
and log-probabilities. Rows go through the head a chunk at a time ([`LMHead`][daca_kernels.ops.shared.LMHead]),
so ``[N, V]`` logits are never held for all rows. There is no Triton kernel: it runs at a few
branch steps only, and the chunk's matmul dominates ``torch.topk``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.ops import dispatch
from daca_kernels.ops.shared import LMHead, check_chunk_rows, check_linear_head
from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import check_int


@torch.library.custom_op("daca::linear_topk_logprob", mutates_args=())
def _linear_topk_logprob_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, mask_id: int, chunk_size: int
) -> tuple[Tensor, Tensor]:
    n = hidden.shape[0]
    ids = hidden.new_empty(n, k, dtype=torch.int64)
    logprobs = hidden.new_empty(n, k, dtype=accumulation_dtype(hidden.dtype))
    head = LMHead(weight, bias)
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        logits = head.logits(hidden[lo:hi])
        if mask_id >= 0:
            logits[:, mask_id] = float("-inf")
        values, chosen = torch.log_softmax(logits, dim=1).topk(k, dim=1)
        ids[lo:hi], logprobs[lo:hi] = chosen, values
    return ids, logprobs


@_linear_topk_logprob_op.register_fake
def _(hidden, weight, bias, k, mask_id, chunk_size):
    n = hidden.shape[0]
    return hidden.new_empty(n, k, dtype=torch.int64), hidden.new_empty(n, k, dtype=accumulation_dtype(hidden.dtype))


def linear_topk_logprob(
    hidden: Tensor,
    weight: Tensor,
    *,
    k: int,
    bias: Tensor | None = None,
    mask_id: int | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most probable tokens of ``softmax(hidden @ weight.T + bias)`` per row.

    Args:
        hidden: float ``[N, H]``; weight ``[V, H]``; bias ``[V]`` or None (same dtype and device).
        k: int in ``[1, V]`` (``[1, V - 1]`` with a ``mask_id``: the tokens that can be sampled).
        mask_id: an id left out of the softmax (its logit counts as ``-inf``, as in
            [`daca_kernels.sample_step`][daca_kernels.ops.sample_step]), or None.
        chunk_size: rows per chunk (int > 0), or None for the default (as ``linear_logprob``).
        backend: ``"triton"`` and ``"torch"`` both run the chunked PyTorch path (there is no
            kernel), ``"reference"`` the plain reference; None: ``DACA_BACKEND``, then the device.

    Returns:
        ``(ids int64 [N, k], logprobs float32 [N, k])`` (float64 for float64 inputs), sorted by
        decreasing probability. No gradient flows.
    """
    n, vocab = check_linear_head(hidden, weight, bias)
    if mask_id is not None:
        check_int(mask_id, "mask_id", low=0, high=vocab)
    check_int(k, "k", low=1, high=vocab - (mask_id is not None) + 1)
    chunk_size = check_chunk_rows(chunk_size, n)
    return dispatch.run("linear_topk_logprob", backend, hidden.device, _fused, hidden, weight, bias, k, mask_id,
                        chunk_size=chunk_size)


def _fused(backend: str, hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, mask_id: int | None, *,
           chunk_size: int) -> tuple[Tensor, Tensor]:
    """Both fused backends run the same custom op: it has no kernel to choose."""
    return torch.ops.daca.linear_topk_logprob(
        hidden.detach(), weight.detach(), None if bias is None else bias.detach(), k,
        -1 if mask_id is None else mask_id, chunk_size,
    )
