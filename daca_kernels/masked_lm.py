"""``MaskedLM``: how the estimators and the sampler see a masked diffusion language model.

A model is split into a backbone that maps token ids to the hidden states the LM head reads,
and the head itself (``weight [V, H]``, optional ``bias [V]``). Estimators gather only the hidden
rows they need and send those through :func:`daca_kernels.linear_logprob`, so full
``[B, L, V]`` logits are never formed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

HiddenFn = Callable[[Tensor, "Tensor | None"], Tensor]


class MaskedLM:
    """A masked diffusion LM seen as ``hidden(input_ids, attention_mask) -> [B, L, H]`` plus a head.

    Args:
        hidden_fn: maps long ``[B, L]`` ids (and an optional ``[B, L]`` attention mask, 1 = attend)
            to the ``[B, L, H]`` hidden states the head reads.
        head_weight: ``[V, H]`` LM-head weight (may be tied to the input embeddings).
        head_bias: ``[V]`` or None.
        mask_id: the ``[MASK]`` token id.
        shift: Dream / DiffuCoder convention: the hidden state at ``i - 1`` predicts token ``i``.
        module: the ``nn.Module`` owning the parameters (for ``parameters()``, ``train()``, ...).
    """

    def __init__(
        self,
        hidden_fn: HiddenFn,
        head_weight: Tensor,
        head_bias: Tensor | None,
        mask_id: int,
        *,
        shift: bool = False,
        module: nn.Module | None = None,
    ):
        if head_weight.dim() != 2:
            raise ValueError(f"head_weight must be [V, H], got shape {tuple(head_weight.shape)}")
        if head_bias is not None and tuple(head_bias.shape) != (head_weight.shape[0],):
            raise ValueError(f"head_bias must have shape [V] = ({head_weight.shape[0]},), got {tuple(head_bias.shape)}")
        if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < head_weight.shape[0]:
            raise ValueError(f"mask_id must be an int in [0, {head_weight.shape[0]}), got {mask_id!r}")
        self._hidden_fn = hidden_fn
        self.head_weight = head_weight
        self.head_bias = head_bias
        self.mask_id = mask_id
        self.shift = bool(shift)
        self.module = module

    @property
    def vocab_size(self) -> int:
        return self.head_weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    def hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Hidden states ``[B, L, H]`` the head reads (no logits are computed)."""
        return self._hidden_fn(input_ids, attention_mask)

    def logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Full ``[B, L, V]`` logits, for references and tests (the estimators never call this)."""
        out = self.hidden(input_ids, attention_mask) @ self.head_weight.T
        return out if self.head_bias is None else out + self.head_bias

    def parameters(self):
        if self.module is None:
            raise ValueError("this MaskedLM was built without a module")
        return self.module.parameters()

    @classmethod
    def from_hf(cls, model: nn.Module, *, mask_id: int, shift: bool = False, verify: bool = True) -> "MaskedLM":
        """Wrap a transformers model with an LM head (see :func:`daca_kernels.hf.masked_lm_from_hf`)."""
        from daca_kernels.hf import masked_lm_from_hf

        return masked_lm_from_hf(model, mask_id=mask_id, shift=shift, verify=verify)
