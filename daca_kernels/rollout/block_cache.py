"""How a block-causal family's backbone is called block by block, with or without a KV cache.

Block-wise decoding ([`daca_kernels.rollout.blockwise`][daca_kernels.rollout.blockwise]) runs the backbone on the query columns
``[start, end)`` of a sequence whose columns ``[0, start)`` are either in a KV cache (keys and values
of earlier calls) or passed again with the queries (no cache: ``start`` is then 0 for the inputs and
only the last columns are read). The protocol is the one of the family [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf]
recognised: ``lm.family.block_cache_kwargs`` ([`daca_kernels.models.families`][daca_kernels.models.families]) gives the mask
form and store flag of the family's released modeling code, and the calls are:

============  ===========================================================================================
family        call
============  ===========================================================================================
sdar          ``model.model(input_ids, attention_mask=bool [B, 1, n, K], position_ids, past_key_values=cache,
              use_cache=True, store_kv=store)``: with ``store_kv`` the attention appends this call's keys
              and values to the cache (``cache.update``); without, it reads ``cache[layer]`` and prepends
              it without storing. TraDo ships the same code.
llada2        ``model.model(input_ids, attention_mask=additive [B, 1, n, K] in the model's dtype,
              position_ids, past_key_values=cache, use_cache=True)``: its attention always calls
              ``cache.update`` and asks ``cache.get_usable_length``; ``BlockKVCache`` stores on
              ``update`` only in store mode, else returns the cached keys and values with this call's
              appended (a read). The released ``generate`` passes no cache and recomputes the prefix.
============  ===========================================================================================

(``K`` = cached columns + ``n``.) Without a cache the same call is made with ``use_cache=False`` and
the ``[B, 1, n, n]`` block-causal mask. A model of another family (or a [`MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] built by
hand, whose ``family`` is None) has no protocol: it is decoded without a cache through ``lm.hidden``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from daca_kernels._optional import defined_on_first_use
from daca_kernels.models.families import Family, param_dtype
from daca_kernels.models.masked_lm import MaskedLM


def _block_kv_cache_class() -> type:
    from transformers.cache_utils import DynamicCache

    class BlockKVCache(DynamicCache):
        """Keys and values of the committed columns, per layer, stored only in store mode.

        ``storing`` (set by [`BlockBackbone`][daca_kernels.rollout.block_cache.BlockBackbone] before each call) decides what ``update``
        does: True
        appends the call's keys and values and returns all of them, False returns the stored ones with
        the call's appended without keeping them. ``cache[layer]`` answers ``(keys, values)``, as the
        released SDAR attention reads it (transformers 5's ``DynamicCache`` is not subscriptable).
        """

        def __init__(self):
            super().__init__()
            self.storing = False
            self._keys: list[Tensor] = []
            self._values: list[Tensor] = []

        def __len__(self) -> int:
            return len(self._keys)

        def __getitem__(self, layer_idx: int) -> tuple[Tensor, Tensor]:
            return self._keys[layer_idx], self._values[layer_idx]

        def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs=None, *args, **kwargs):
            if layer_idx < len(self._keys):
                keys = torch.cat([self._keys[layer_idx], key_states], dim=-2)
                values = torch.cat([self._values[layer_idx], value_states], dim=-2)
            else:
                keys, values = key_states, value_states
            if self.storing:
                if layer_idx < len(self._keys):
                    self._keys[layer_idx], self._values[layer_idx] = keys, values
                elif layer_idx == len(self._keys):
                    self._keys.append(keys)
                    self._values.append(values)
                else:
                    raise ValueError(f"BlockKVCache: layer {layer_idx} stored before layer {len(self._keys)}")
            return keys, values

        def get_seq_length(self, layer_idx: int = 0, *args, **kwargs) -> int:
            return self._keys[layer_idx].shape[-2] if layer_idx < len(self._keys) else 0

        def get_usable_length(self, new_seq_length: int = 0, layer_idx: int = 0) -> int:
            """The cached length (the released LLaDA2 attention's transformers 4 API)."""
            return self.get_seq_length(layer_idx)

    return BlockKVCache


# BlockKVCache subclasses transformers' DynamicCache: defined on first use, so that the sampler imports without
# transformers (only a transformers model, whose package is then installed, uses it).
__getattr__ = defined_on_first_use(globals(), {"BlockKVCache": _block_kv_cache_class})


def visible_keys(key_valid: Tensor, start: int, block_size: int) -> Tensor:
    """bool ``[B, 1, K - start, K]``: query column ``q`` in ``[start, K)`` sees key ``k`` iff the key
    is valid (``key_valid [B, K]``, False on padding) and ``k // block_size <= q // block_size``, and
    always sees itself (a padding query with no key would be a NaN row that reaches real rows)."""
    batch, total = key_valid.shape
    column = torch.arange(total, device=key_valid.device)
    block = column // block_size
    rule = block[None, :] <= block[start:, None]
    keep = key_valid[:, None, None, :] & rule
    return keep | (column[None, :] == column[start:, None])


@dataclass(frozen=True)
class BlockBackbone:
    """A recognised block-causal family's backbone, called on query columns with explicit positions,
    key visibility and an optional ``BlockKVCache`` (module docstring)."""

    family: Family
    backbone: nn.Module
    dtype: torch.dtype

    def __call__(self, input_ids: Tensor, keep: Tensor, position_ids: Tensor, cache,
                 store: bool) -> Tensor:
        """Hidden states ``[B, n, H]`` of ``input_ids`` (long ``[B, n]``).

        Args:
            keep: bool ``[B, 1, n, K]``, which keys each query sees (the cached columns first).
            position_ids: long ``[B, n]``, the queries' positions.
            cache: the cache holding columns ``[0, K - n)``, or None (then ``K == n``).
            store: append this call's keys and values to ``cache``.
        """
        kwargs = self.family.block_cache_kwargs(keep, store, self.dtype)
        if cache is not None:
            cache.storing = store
            kwargs.update(past_key_values=cache, use_cache=True)
        else:
            kwargs["use_cache"] = False
        return self.backbone(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state


def block_backbone(lm: MaskedLM) -> BlockBackbone | None:
    """The cache protocol of ``lm`` when [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] wrapped a model of a
    family that
    has one (``lm.family.block_cache_kwargs``: SDAR / TraDo, LLaDA2), else None."""
    model, family = lm.module, lm.family
    if model is None or lm.attention == "full" or family is None or family.block_cache_kwargs is None:
        return None
    backbone = model.base_model
    return BlockBackbone(family, backbone, param_dtype(backbone))
