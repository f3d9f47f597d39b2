"""How a full-attention family's backbone is called with an approximate prefix (or dual) KV cache.

Fast-dLLM's block-wise approximate cache, as the RL pipelines that train LLaDA and Dream at scale roll
out with it (:func:`daca_kernels.rollout.generate` with ``kv_cache="prefix"`` or ``"dual"``): at the
first step of each block the whole sequence runs once (a full forward, exactly the exact sampler's
call) and the keys and values of the columns that the block's later steps do not run are kept; each
later step of the block runs only its query columns against them. The kept keys and values were
computed when the block was still fully masked, so they are stale once the block's tokens are
committed: that is the approximation (the first step of every block is exact).

============  ===========================  ==========================================================
mode          kept (cached) columns        query columns of a later step
============  ===========================  ==========================================================
``prefix``    ``[0, q0)``                  ``[q0, L)``: the block and everything after it
``dual``      ``[0, q0)`` and ``[end, L)``  ``[q0, end)``: the block alone
============  ===========================  ==========================================================

``q0`` is the block's first column, one column earlier for a shifted model (Dream: the state at
``i - 1`` predicts token ``i``, so the column before the block is run with it). Keys are attended in
any order under full attention; the queries' own positions come from the caller.

Everything that depends on the family's released code is here:

============  ===========================================================================================
family        cache interface
============  ===========================================================================================
dream         ``model.model(input_ids, attention_mask, position_ids, past_key_values=cache, use_cache=True)``:
              each attention layer applies the rotary embedding of the given ``position_ids`` and calls
              ``cache.update(keys, values, layer)``, attending to what it returns. Prefix and dual.
              The mask is ``"full"`` without padding (both released copies take it), else a 4-D bool
              ``[B, 1, n, K]`` key mask, the cached columns first. DiffuCoder ships the same code.
generic       transformers' own decoders built bidirectional (``LlamaConfig(..., is_causal=False)``, the
              reference loop's model): ``model.model(input_ids, attention_mask=None or 4-D bool,
              position_ids, past_key_values=cache, use_cache=True)``, the same protocol. Prefix and dual.
llada         none: the released ``LLaDAModel.forward`` (hub LLaDA-8B and dllm's copy) asserts
              ``past_key_values is None and not use_cache`` ("The kvcache is not supported for MDM").
llada_moe     none: the released ``LLaDAMoEModel.forward`` asserts ``not use_cache and past_key_values is
              None and cache_position is None`` ("The cache mechanism is not supported for LLaDA MoE").
============  ===========================================================================================

The library never edits, patches or wraps a model's code to get around such a refusal: for those
families :func:`full_backbone` raises a ValueError that says why and what to use instead (the exact
sampler, and parallel decoding, ``threshold`` or ``tokens_per_step``, which need no cache).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from daca_kernels.models import families
from daca_kernels.models.masked_lm import MaskedLM

CACHE_MODES = ("prefix", "dual")

_REFUSED = {
    families.LLADA: (
        "LLaDA's released code refuses a KV cache: LLaDAModel.forward asserts `past_key_values is None and not "
        "use_cache` (\"The kvcache is not supported for MDM\"), and its rotary embedding places queries at the last "
        "positions of the keys, so no middle segment could be placed either"),
    families.LLADA_MOE: (
        "LLaDA-MoE's released code refuses a KV cache: LLaDAMoEModel.forward asserts `not use_cache and "
        "past_key_values is None and cache_position is None` (\"The cache mechanism is not supported for LLaDA "
        "MoE\")"),
}


def __getattr__(name: str):
    # PrefixKVCache subclasses transformers' DynamicCache: it is defined on first use, so that the sampler
    # imports without transformers (only a transformers model, whose package is then installed, uses it).
    if name == "PrefixKVCache":
        cls = _prefix_kv_cache_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _prefix_kv_cache_class() -> type:
    from transformers.cache_utils import DynamicCache

    class PrefixKVCache(DynamicCache):
        """Per layer, the keys and values of the kept columns of a full forward.

        ``keep`` (set by :class:`FullBackbone` before each call) decides what ``update`` does: a long
        index tensor stores those columns of the call's keys and values and returns the call's own (the
        full forward is exactly the uncached one); None returns the stored ones with the call's appended,
        storing nothing.
        """

        def __init__(self):
            super().__init__()
            self.keep: Tensor | None = None
            self._keys: list[Tensor] = []
            self._values: list[Tensor] = []

        def __len__(self) -> int:
            return len(self._keys)

        def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs=None, *args, **kwargs):
            if self.keep is not None:
                keys, values = key_states.index_select(-2, self.keep), value_states.index_select(-2, self.keep)
                if layer_idx < len(self._keys):
                    self._keys[layer_idx], self._values[layer_idx] = keys, values
                elif layer_idx == len(self._keys):
                    self._keys.append(keys)
                    self._values.append(values)
                else:
                    raise ValueError(f"PrefixKVCache: layer {layer_idx} stored before layer {len(self._keys)}")
                return key_states, value_states
            if layer_idx >= len(self._keys):
                raise ValueError(f"PrefixKVCache: layer {layer_idx} read before a full forward stored it")
            return (torch.cat([self._keys[layer_idx], key_states], dim=-2),
                    torch.cat([self._values[layer_idx], value_states], dim=-2))

        def get_seq_length(self, layer_idx: int = 0, *args, **kwargs) -> int:
            return self._keys[layer_idx].shape[-2] if layer_idx < len(self._keys) else 0

    PrefixKVCache.__module__, PrefixKVCache.__qualname__ = __name__, "PrefixKVCache"
    return PrefixKVCache


@dataclass(frozen=True)
class FullBackbone:
    """A recognised full-attention family's backbone called with a :class:`PrefixKVCache`."""

    family: families.Family
    backbone: nn.Module

    def positions(self, attention_mask: Tensor | None, batch: int, length: int) -> Tensor:
        """long ``[B, L]``: the position ids the family's own call gives each column (Dream's, as
        :meth:`MaskedLM.from_hf` calls it, count a padded row's attended tokens; a transformers decoder's
        count every column)."""
        if attention_mask is not None and self.family is families.DREAM:
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        device = self.backbone.device if hasattr(self.backbone, "device") else None
        return torch.arange(length, device=device if attention_mask is None else attention_mask.device).expand(
            batch, length)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, keep: Tensor | None, cache,
                 store: Tensor | None) -> Tensor:
        """Hidden states ``[B, n, H]`` of ``input_ids`` (long ``[B, n]``).

        Args:
            position_ids: long ``[B, n]``, the queries' positions.
            keep: bool ``[B, 1, n, K]`` (the stored columns first, then the call's), or None when no
                key is hidden.
            cache: the cache; read when ``store`` is None.
            store: long indices of the call's columns to keep (a full forward), or None.
        """
        cache.keep = store
        try:
            # Dream's two released copies take "full" for no mask (dllm's refuses None).
            unmasked = "full" if self.family is families.DREAM else None
            return self.backbone(input_ids=input_ids, attention_mask=unmasked if keep is None else keep,
                                 position_ids=position_ids, past_key_values=cache, use_cache=True).last_hidden_state
        finally:
            cache.keep = None


def full_backbone(lm: MaskedLM, mode: str) -> FullBackbone:
    """The cache protocol of a full-attention ``lm`` for ``mode`` (``"prefix"`` or ``"dual"``); a
    ValueError naming ``kv_cache`` that says why when the model's code cannot serve it."""
    model = lm.module
    family = families.recognise(model) if model is not None else None
    if family is None or (family is families.GENERIC and not _bidirectional_decoder(model)):
        what = "a MaskedLM built without a module" if model is None else f"{type(model).__name__}"
        raise ValueError(f"kv_cache={mode!r}: {what} has no KV-cache protocol in daca_kernels.prefix_cache (only "
                         "Dream / DiffuCoder's released code and transformers' decoders built bidirectional, "
                         "is_causal=False, wrapped with MaskedLM.from_hf have one); pass kv_cache=None (exact), or "
                         "decode in parallel with threshold or tokens_per_step, which need no cache")
    if family in _REFUSED:
        raise ValueError(f"kv_cache={mode!r}: {_REFUSED[family]}. The library does not edit or wrap a model's "
                         "code; pass kv_cache=None (exact) and, for fewer forwards, decode in parallel with "
                         "threshold or tokens_per_step, which need no cache")
    return FullBackbone(family, model.base_model)


def _bidirectional_decoder(model: nn.Module) -> bool:
    """A transformers decoder (Llama, Qwen, ...) built with ``is_causal=False``: its attention takes
    ``past_key_values``, ``position_ids`` and a 4-D bool mask."""
    config = getattr(model, "config", None)
    backbone = getattr(model, "base_model", None)
    if config is None or backbone is None or getattr(config, "is_causal", True) is not False:
        return False
    parameters = inspect.signature(backbone.forward).parameters
    return all(name in parameters for name in ("past_key_values", "position_ids", "use_cache"))
