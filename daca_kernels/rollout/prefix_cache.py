"""How a full-attention family's backbone is called with an approximate prefix (or dual) KV cache.

Fast-dLLM's block-wise approximate cache, as the RL pipelines that train LLaDA and Dream at scale roll
out with it ([`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] with ``kv_cache="prefix"`` or ``"dual"``): at the
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

A family's record says how its backbone takes the cache
([`Family.prefix_cache`][daca_kernels.models.families.PrefixCacheCall]: the driver, the mask given without
padding, how positions count, whether padding is stripped); the drivers, and what each can serve,
are here:

============  ===========================================================================================
family        cache interface
============  ===========================================================================================
dream         driver ``past_key_values``:
              ``model.model(input_ids, attention_mask, position_ids, past_key_values=cache, use_cache=True)``:
              each attention layer applies the rotary embedding of the given ``position_ids`` and calls
              ``cache.update(keys, values, layer)``, attending to what it returns. Prefix and dual.
              The mask is ``"full"`` without padding (both released copies take it), else a 4-D bool
              ``[B, 1, n, K]`` key mask, the cached columns first. DiffuCoder ships the same code.
generic       driver ``past_key_values``: transformers' own decoders built bidirectional
              (``LlamaConfig(..., is_causal=False)``, the reference loop's model): ``model.model(input_ids,
              attention_mask=None or 4-D bool, position_ids, past_key_values=cache, use_cache=True)``, the
              same protocol. Prefix and dual.
llada         driver ``llada_blocks``: ``LLaDABlock.forward(x, attention_bias, layer_past=(keys, values),
              use_cache=True)``, the released blocks' own cache interface (``LLaDAModel.forward`` asserts ``past_key_values is
              None and not use_cache``, so the blocks are driven in its order: ``transformer.wte``, the
              ``input_emb_norm`` scaling, ``transformer.emb_drop``, each block, ``transformer.ln_f``).
              A block returns its keys and values before the rotary embedding, which rotates the
              concatenated keys at positions ``0 .. K - 1`` and the queries at the last ones: prefix
              only (dual's queries, the block alone, would be placed at the end). Padding: dllm's copy
              honours the additive ``attention_bias`` (mask form ``"2d"``: LLaDAModel.forward's own
              ``[B, 1, K, K]`` bias); with mask form ``"none"`` (hub LLaDA-8B, whose code ignores
              every mask) rows run without their padding, as the exact path runs them. Configs with
              ALiBi, without RoPE or with block groups are refused (the driver does not reproduce them).
llada_moe     driver ``llada_moe_layers``: each ``LLaDAMoEDecoderLayer`` with ``past_key_value=cache``,
              ``position_ids`` and the model's ``rotary_emb`` embeddings (``LLaDAMoEModel.forward`` asserts no cache and forces
              ``use_cache`` False), then ``model.norm``. Its attention rotates keys at the given
              positions before ``cache.update``: prefix and dual. It ignores every mask: padded rows run
              without their padding (mask form ``"none"``), as the exact path runs them.
============  ===========================================================================================

Rows run without their padding are batched by their number of padding columns, each such group with
its own cache (the padding lies in the prompt, before every block, so a group's kept columns are the
same for all its rows). The library never edits, patches or wraps a model's code: a family or mode its
code cannot serve is a ValueError naming ``kv_cache`` that says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from daca_kernels._optional import defined_on_first_use
from daca_kernels.models import families
from daca_kernels.models.masked_lm import MaskedLM

CACHE_MODES = ("prefix", "dual")
# The drivers a family's PrefixCacheCall may name (the table above).
DRIVERS = ("past_key_values", "llada_blocks", "llada_moe_layers")


def _prefix_kv_cache_class() -> type:
    from transformers.cache_utils import DynamicCache

    class PrefixKVCache(DynamicCache):
        """Per layer, the keys and values of the kept columns of a full forward.

        ``keep`` (set by [`FullBackbone`][daca_kernels.rollout.prefix_cache.FullBackbone] before each call) decides what ``update``
        does: a long
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
            keys, values = self.stored(layer_idx)
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

        def stored(self, layer_idx: int) -> tuple[Tensor, Tensor]:
            """The kept keys and values of layer ``layer_idx``, for a model whose layers take them as
            their past (LLaDA's ``layer_past``)."""
            if layer_idx >= len(self._keys):
                raise ValueError(f"PrefixKVCache: layer {layer_idx} read before a full forward stored it")
            return self._keys[layer_idx], self._values[layer_idx]

        def get_seq_length(self, layer_idx: int = 0, *args, **kwargs) -> int:
            return self._keys[layer_idx].shape[-2] if layer_idx < len(self._keys) else 0

    return PrefixKVCache


# PrefixKVCache subclasses transformers' DynamicCache: defined on first use, so that the sampler imports without
# transformers (only a transformers model, whose package is then installed, uses it).
__getattr__ = defined_on_first_use(globals(), {"PrefixKVCache": _prefix_kv_cache_class})


def _cache_class() -> type:
    return globals().get("PrefixKVCache") or __getattr__("PrefixKVCache")


@dataclass(frozen=True)
class FullBackbone:
    """A recognised full-attention family's backbone called with ``PrefixKVCache`` objects.

    Attributes:
        call: the family's cache call ([`daca_kernels.models.families.Family`][daca_kernels.models.families.Family]'s
            ``prefix_cache``).
        backbone: the model's backbone (``model.base_model``).
        strip: padded rows run without their padding (a family that strips it, under mask form
            ``"none"``).
    """

    call: families.PrefixCacheCall
    backbone: nn.Module
    strip: bool = False

    def positions(self, attention_mask: Tensor | None, batch: int, length: int) -> Tensor:
        """long ``[B, L]``: the position ids the family's own call gives each column (Dream's, as
        [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] calls it, and a row run without its padding count a padded
        row's
        attended tokens; a transformers decoder's count every column; LLaDA's blocks place their
        queries themselves and ignore them)."""
        if attention_mask is not None and (self.call.attended_positions or self.strip):
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        device = self.backbone.device if hasattr(self.backbone, "device") else None
        return torch.arange(length, device=device if attention_mask is None else attention_mask.device).expand(
            batch, length)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, valid: Tensor | None, caches: dict,
                 store: Tensor | None) -> Tensor:
        """Hidden states ``[B, n, H]`` of ``input_ids`` (long ``[B, n]``).

        Args:
            position_ids: long ``[B, n]``, the queries' positions.
            valid: bool ``[B, K]``, the keys the queries may attend (the stored columns first, then the
                call's), or None when none is hidden. A call that reads the caches runs attended columns
                only (the padding lies in the prompt).
            caches: the decode's caches, filled by its calls: one ``PrefixKVCache`` per group of rows
                run together (key None for the whole batch, else a group's number of padding columns).
            store: long indices of the call's columns to keep (a full forward, ``K = n``), or None (a
                call that reads the caches).
        """
        if not self.strip or valid is None:
            return self._run(input_ids, position_ids, valid, caches, None, store)
        pads = valid.shape[1] - valid.sum(-1)
        out = None
        for pad in pads.unique().tolist():
            rows = (pads == pad).nonzero().squeeze(1)
            if store is None:
                where = (rows,)
                states = self._run(input_ids[rows], position_ids[rows], None, caches, pad, None)
            else:
                cols = valid[rows].nonzero()[:, 1].view(len(rows), -1)
                where = (rows[:, None], cols)
                # The stored columns' indices in the rows without padding (the same for every row of the group).
                attended = valid[rows[0]]
                kept = (attended.long().cumsum(0) - 1)[store][attended[store]]
                states = self._run(input_ids[where], position_ids[where], None, caches, pad, kept)
            if out is None:
                out = states.new_zeros(*input_ids.shape, states.shape[-1])
            out[where] = states
        return out

    def _run(self, input_ids: Tensor, position_ids: Tensor, valid: Tensor | None, caches: dict, group,
             store: Tensor | None) -> Tensor:
        if group not in caches:
            caches[group] = _cache_class()()
        cache = caches[group]
        cache.keep = store
        try:
            if self.call.driver == "llada_blocks":
                return llada_states(self.backbone, input_ids, valid, cache, store is not None)
            if self.call.driver == "llada_moe_layers":
                return llada_moe_states(self.backbone, input_ids, position_ids, cache)
            keep = None
            if valid is not None:
                batch, n = input_ids.shape
                keep = valid[:, None, None, :].expand(batch, 1, n, valid.shape[1])
                if store is not None:  # a padding query sees itself (a query row without a key is NaN)
                    keep = keep | torch.eye(n, dtype=torch.bool, device=keep.device)
            return self.backbone(input_ids=input_ids, attention_mask=self.call.unmasked if keep is None else keep,
                                 position_ids=position_ids, past_key_values=cache, use_cache=True).last_hidden_state
        finally:
            cache.keep = None


def llada_states(backbone: nn.Module, input_ids: Tensor, valid: Tensor | None = None, cache=None,
                 store: bool = False) -> Tensor:
    """LLaDA's hidden states ``[B, n, H]`` (the output of ``transformer.ln_f``) of ``input_ids`` (long
    ``[B, n]``), the released ``LLaDAModel.forward``'s computation driven block by block.

    Args:
        backbone: the released ``LLaDAModel`` (``model.model``), without ALiBi or block groups.
        valid: bool ``[B, K]``, the attended keys (the stored columns first), passed to the blocks as
            the additive ``[B, 1, K, K]`` bias that LLaDAModel.forward builds from a 2-D mask (dllm's
            copy honours it, the hub's ignores it); None: no bias.
        cache: None (a plain forward), or a ``PrefixKVCache``.
        store: with a cache, True keeps the cache's ``keep`` columns of each block's keys and values
            (``use_cache=True``); False passes its stored ones to each block as ``layer_past`` (the
            queries then sit at the last positions).
    """
    config = backbone.config
    x = backbone.transformer.wte(input_ids)
    if config.input_emb_norm:
        x = x * (config.d_model ** 0.5)
    x = backbone.transformer.emb_drop(x)
    bias = None
    if valid is not None:
        keys = valid.shape[1]
        key_bias = (1.0 - valid.float()) * torch.finfo(torch.float).min
        bias = torch.zeros(1, 1, keys, keys, device=x.device) + key_bias[:, None, None, :]
    for layer, block in enumerate(backbone.transformer.blocks):
        past = cache.stored(layer) if cache is not None and not store else None
        x, present = block(x, attention_bias=bias, layer_past=past, use_cache=store)
        if store:
            cache.update(*present, layer)
    return backbone.transformer.ln_f(x)


def llada_moe_states(backbone: nn.Module, input_ids: Tensor, position_ids: Tensor, cache=None) -> Tensor:
    """LLaDA-MoE's hidden states ``[B, n, H]`` (``last_hidden_state``) of ``input_ids`` (long ``[B, n]``)
    at ``position_ids`` (long ``[B, n]``), the released ``LLaDAMoEModel.forward``'s computation driven
    layer by layer: ``embed_tokens``, ``rotary_emb``, each decoder layer with ``past_key_value=cache``
    (None, or a ``PrefixKVCache``), ``norm``."""
    x = backbone.embed_tokens(input_ids)
    embeddings = backbone.rotary_emb(x, position_ids)
    for layer in backbone.layers:
        x = layer(x, position_ids=position_ids, past_key_value=cache, position_embeddings=embeddings)[0]
    return backbone.norm(x)


def full_backbone(lm: MaskedLM, mode: str) -> FullBackbone:
    """The cache protocol of a full-attention ``lm`` for ``mode`` (``"prefix"`` or ``"dual"``), the
    one its family's record names ([`daca_kernels.models.families.PrefixCacheCall`][daca_kernels.models.families.PrefixCacheCall]);
    a ValueError naming ``kv_cache`` that says why when the model's code cannot serve it."""
    model = lm.module
    family = families.recognise(model) if model is not None else None
    call = family.prefix_cache if family is not None else None
    if call is None or (call.applies is not None and not call.applies(model)):
        what = "a MaskedLM built without a module" if model is None else f"{type(model).__name__}"
        raise ValueError(f"kv_cache={mode!r}: {what} has no KV-cache protocol in daca_kernels.rollout.prefix_cache (only "
                         "the released code of LLaDA, LLaDA-MoE and Dream / DiffuCoder and transformers' decoders "
                         "built bidirectional, is_causal=False, wrapped with MaskedLM.from_hf have one); pass "
                         "kv_cache=None (exact), or decode in parallel with threshold or tokens_per_step, which "
                         "need no cache")
    backbone = model.base_model
    if call.driver == "llada_blocks":
        _check_llada_blocks(backbone.config, mode)
    return FullBackbone(call, backbone, call.strips_padding and lm.mask_form == "none")


def _check_llada_blocks(config, mode: str) -> None:
    """What the LLaDA block driver serves: prefix only, RoPE, no ALiBi, no block groups."""
    if mode == "dual":
        raise ValueError("kv_cache='dual': LLaDA's released attention rotates the keys it is given (the kept "
                         "ones, then the call's) at positions 0 .. K - 1 and the queries at the last of them, so "
                         "the block alone cannot be placed before kept keys that follow it; use "
                         "kv_cache='prefix'")
    driven = dict(alibi=not config.alibi, rope=bool(config.rope), block_group_size=config.block_group_size == 1)
    refused = [name for name, ok in driven.items() if not ok]
    if refused:
        raise ValueError(f"kv_cache={mode!r}: the LLaDA blocks are driven as LLaDAModel.forward runs them with "
                         f"RoPE, without ALiBi and without block groups; this config sets "
                         f"{', '.join(refused)} otherwise")
