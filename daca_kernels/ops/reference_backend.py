"""The ``reference`` backend: each public op computed by the plain PyTorch references of
``daca_kernels.reference`` (float64-capable, full logits, autograd through plain PyTorch).

[`daca_kernels.ops.dispatch.run`][daca_kernels.ops.dispatch.run] calls the function of an op's name here, with the arguments
the op's wrapper has already checked, and it returns what the public op returns; nothing else
calls this module, and no other module of ``ops/`` imports the references. Index ranges are
checked here as the custom ops check them ([`checked_index`][daca_kernels.validation.checked_index],
which ``torch.compile`` treats as opaque).
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels import reference
from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import WORD_LIMIT, checked_index


def gather_logprob(logits: Tensor, targets: Tensor, rows: Tensor | None, temperature: float, return_entropy: bool,
                   inplace_backward: bool) -> tuple[Tensor, Tensor | None]:
    """``(logprob [N], entropy [N] or None)``; ``inplace_backward`` has nothing to save here."""
    targets = checked_index(targets, logits.shape[-1], "targets")
    if rows is not None:
        rows = checked_index(rows, logits.numel() // logits.shape[-1], "rows")
    result = reference.gather_logprob(logits, targets, rows, temperature, return_entropy)
    return result if return_entropy else (result, None)


def linear_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, temperature: float,
                   return_entropy: bool):
    targets = checked_index(targets, weight.shape[0], "targets")
    return reference.linear_logprob(hidden, weight, targets, bias, temperature, return_entropy)


def _checked_row_ids(row_ids: Tensor | None) -> Tensor | None:
    return None if row_ids is None else checked_index(row_ids, WORD_LIMIT, "row_ids")


def sample_step(logits: Tensor, temperature: float, seed: int, step: int, row_ids: Tensor | None,
                mask_id: int | None, return_entropy: bool):
    with torch.no_grad():
        return reference.sample_step(logits, temperature, seed, step, _checked_row_ids(row_ids), mask_id,
                                     return_entropy)


def sample_step_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, seed: int, step: int,
                       row_ids: Tensor | None, mask_id: int | None, return_entropy: bool):
    with torch.no_grad():
        return reference.sample_step_linear(hidden, weight, bias, temperature, seed, step, _checked_row_ids(row_ids),
                                            mask_id, return_entropy)


def linear_topk_logprob(hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, mask_id: int | None):
    with torch.no_grad():
        return reference.topk_logprob(reference.linear_logits(hidden, weight, bias), k, mask_id)


def confidence_delta(current: Tensor, previous: Tensor, still_masked: Tensor) -> Tensor:
    with torch.no_grad():
        return reference.confidence_delta(current, previous, still_masked).to(accumulation_dtype(current.dtype))


def stratified_mask(input_ids: Tensor, maskable: Tensor, prompt: Tensor | None, num_strata: int, seed: int,
                    mask_id: int, scheme: str, prompt_mask_prob: float, row_offset: int) -> tuple[Tensor, Tensor]:
    return reference.stratified_mask(input_ids, maskable, num_strata, seed, mask_id, scheme, prompt, prompt_mask_prob,
                                      row_offset)
