"""``MaskedLM``: how the estimators and the sampler see a masked diffusion language model.

A model is split into a backbone that maps token ids to the hidden states the LM head reads,
and the head itself (``weight [V, H]``, optional ``bias [V]``). Estimators gather only the hidden
rows they need and send those through :func:`daca_kernels.linear_logprob`, so full
``[B, L, V]`` logits are never formed.

:meth:`MaskedLM.from_hf` splits a transformers model: the backbone is ``model.base_model``; the
head is ``model.get_output_embeddings()`` (tied or not, with or without bias). Masked-LM heads that
transform the hidden states before the output projection (ModernBERT's ``head``, BERT's
``cls.predictions.transform``) are applied as part of ``hidden``. ``verify=True`` checks once, on a
short random input, that ``hidden @ W.T + b`` reproduces ``model(...).logits``, so architectures
that post-process logits (soft-capping, scaling) are refused instead of silently mis-estimated.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from daca_kernels.ops.validation import (
    FLOAT_DTYPES,
    check_bool,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)

HiddenFn = Callable[[Tensor, "Tensor | None"], Tensor]

# Attribute paths of prediction-head transforms applied between the backbone and the projection.
_HEAD_TRANSFORMS = ("head", "cls.predictions.transform")

# Where a backbone's output holds the states the head reads (see MaskedLM.from_hf).
HIDDEN_SOURCES = ("last_hidden_state", "hidden_states")


class MaskedLM:
    """A masked diffusion LM seen as ``hidden(input_ids, attention_mask) -> [B, L, H]`` plus a head.

    Args:
        hidden_fn: a callable mapping long ``[B, L]`` ids (and an optional ``[B, L]`` attention
            mask, 1 = attend) to the ``[B, L, H]`` hidden states the head reads.
        head_weight: floating ``[V, H]`` LM-head weight with ``V >= 1`` (may be tied to the input
            embeddings).
        head_bias: ``[V]`` in the dtype and on the device of ``head_weight``, or None.
        mask_id: the ``[MASK]`` token id, an int in ``[0, V)``.
        shift: a bool; True for the Dream / DiffuCoder convention: the hidden state at ``i - 1``
            predicts token ``i``.
        module: the ``nn.Module`` owning the parameters (for ``parameters()``, ``train()``, ...),
            or None.

    A wrong type or dtype is a TypeError, a wrong shape, value or device a ValueError, each naming
    the argument.
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
        if not callable(hidden_fn):
            raise TypeError(f"hidden_fn must be callable, got {type(hidden_fn).__name__}")
        check_tensor(head_weight, "head_weight", ndim=2, dtypes=FLOAT_DTYPES)
        vocab = head_weight.shape[0]
        if vocab == 0:
            raise ValueError(f"head_weight must have at least one row (V >= 1), got shape {tuple(head_weight.shape)}")
        if head_bias is not None:
            check_tensor(head_bias, "head_bias", dtypes=(head_weight.dtype,))
            check_shape(head_bias, "head_bias", (vocab,), "[V] (from head_weight)")
            check_same_device(head_weight, "head_weight", head_bias=head_bias)
        check_int(mask_id, "mask_id", low=0, high=vocab)
        check_bool(shift, "shift")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module or None, got {type(module).__name__}")
        self._hidden_fn = hidden_fn
        self.head_weight = head_weight
        self.head_bias = head_bias
        self.mask_id = mask_id
        self.shift = shift
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
    def from_hf(cls, model: nn.Module, *, mask_id: int, shift: bool = False, verify: bool = True,
                hidden_from: str = "last_hidden_state") -> "MaskedLM":
        """Wrap a transformers ``*ForCausalLM`` / ``*ForMaskedLM`` model (see the module docstring).

        For bidirectional use, build decoder-style models with ``is_causal=False`` in their config
        (e.g. ``LlamaConfig(..., is_causal=False)``). ``verify=False`` skips the logits check.
        ``hidden_from`` says where the backbone's output holds the states the head reads:
        ``"last_hidden_state"`` (transformers base models) or ``"hidden_states"`` (the last entry of
        its ``hidden_states``, asked for with ``output_hidden_states=True``: for backbones that
        apply the head themselves and return logits, as LLaDA's remote code does; those logits are
        then computed and dropped).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers model (an nn.Module), got {type(model).__name__}")
        check_bool(verify, "verify")
        if hidden_from not in HIDDEN_SOURCES:
            raise ValueError(f"hidden_from must be one of {', '.join(HIDDEN_SOURCES)}, got {hidden_from!r}")
        backbone = getattr(model, "base_model", None)
        projection = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if backbone is None or backbone is model or projection is None:
            raise ValueError("model must be a transformers model with an LM head (get_output_embeddings() and base_model)")
        weight = getattr(projection, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"the output embeddings ({type(projection).__name__}) have no [V, H] weight")
        transform = _head_transform(model, projection)

        def hidden_fn(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
            if hidden_from == "hidden_states":
                states = backbone(input_ids=input_ids, attention_mask=attention_mask,
                                  output_hidden_states=True).hidden_states[-1]
            else:
                states = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return states if transform is None else transform(states)

        lm = cls(hidden_fn, weight, getattr(projection, "bias", None), mask_id, shift=shift, module=model)
        if verify:
            _verify_logits(model, lm)
        return lm


def _find_submodule(model: nn.Module, path: str) -> nn.Module | None:
    module = model
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def _head_transform(model: nn.Module, projection: nn.Module) -> nn.Module | None:
    """The module between the backbone output and the output projection, if the model has one."""
    for path in _HEAD_TRANSFORMS:
        module = _find_submodule(model, path)
        if module is not None and module is not projection and module is not model.base_model:
            return module
    return None


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
