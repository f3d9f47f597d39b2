"""Adapters for transformers models: split a model into backbone (+ head transform) and LM head.

The backbone is ``model.base_model``; the head is ``model.get_output_embeddings()`` (tied or not,
with or without bias). Masked-LM heads that transform the hidden states before the output
projection (ModernBERT's ``head``, BERT's ``cls.predictions.transform``) are applied as part of
``hidden``. ``verify=True`` checks once, on a short random input, that ``hidden @ W.T + b``
reproduces ``model(...).logits``, so architectures that post-process logits (soft-capping,
scaling) are refused instead of silently mis-estimated.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from daca_kernels.masked_lm import MaskedLM

# Attribute paths of prediction-head transforms applied between the backbone and the projection.
_HEAD_TRANSFORMS = ("head", "cls.predictions.transform")


def _find_submodule(model: nn.Module, path: str) -> nn.Module | None:
    module = model
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def head_transform(model: nn.Module, projection: nn.Module) -> nn.Module | None:
    """The module between the backbone output and the output projection, if the model has one."""
    for path in _HEAD_TRANSFORMS:
        module = _find_submodule(model, path)
        if module is not None and module is not projection and module is not model.base_model:
            return module
    return None


def masked_lm_from_hf(model: nn.Module, *, mask_id: int, shift: bool = False, verify: bool = True) -> MaskedLM:
    """Build a :class:`MaskedLM` from a transformers ``*ForCausalLM`` / ``*ForMaskedLM`` model.

    For bidirectional use, build decoder-style models with ``is_causal=False`` in their config
    (e.g. ``LlamaConfig(..., is_causal=False)``).
    """
    backbone = getattr(model, "base_model", None)
    projection = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or backbone is model or projection is None:
        raise ValueError("model must be a transformers model with an LM head (get_output_embeddings() and base_model)")
    weight = getattr(projection, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"the output embeddings ({type(projection).__name__}) have no [V, H] weight")
    transform = head_transform(model, projection)

    def hidden_fn(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        states = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return states if transform is None else transform(states)

    lm = MaskedLM(hidden_fn, weight, getattr(projection, "bias", None), mask_id, shift=shift, module=model)
    if verify:
        _verify_logits(model, lm)
    return lm


def _verify_logits(model: nn.Module, lm: MaskedLM) -> None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            probe = torch.randint(0, lm.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
            probe = probe.to(lm.device)
            expected = model(input_ids=probe).logits.float()
            got = lm.logits(probe).float()
    finally:
        model.train(was_training)
    tol = 1e-3 if lm.head_weight.dtype == torch.float32 else 5e-2
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=tol * (1 + expected.abs().max().item()), rtol=0):
        raise ValueError(
            f"{type(model).__name__}: hidden @ head.T + bias does not reproduce model(...).logits; "
            "the architecture post-processes its logits and is not supported by MaskedLM.from_hf"
        )
