"""The model families [`daca_kernels.MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] recognises, and how each
backbone is called.

Users train the released modeling code of these families (``trust_remote_code``). Each family's code
differs in what its backbone returns, which attention-mask forms it honours and which call arguments
it needs under transformers 5; [`recognise`][daca_kernels.models.families.recognise] finds the family of a model (from its config's
``model_type``, its config class, its ``architectures``, its class name and its module structure) and
[`backbone_fn`][daca_kernels.models.families.backbone_fn] builds the ``hidden(input_ids, attention_mask) -> [B, L, H]`` callable that passes
a 2-D key-padding mask (``[B, L]``, 1 = attend) to the backbone in one of the forms of
[`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS]. For a full-attention model
[`daca_kernels.MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] finds the form by
behaviour (the one under which a left-padded row's states are those of the row alone), since releases
of one family differ (hub LLaDA-8B ignores every mask, dllm's patched LLaDA honours the 2-D one); a
family's ``mask_form`` below is the form tried first, and the one used without that check
(``verify=False``). For the block-causal families, [`keep_backbone_fn`][daca_kernels.models.families.keep_backbone_fn] builds
``hidden(input_ids, position_ids, keep) -> [B, N, H]``: the backbone with caller-given position ids and
a caller-given bool attention matrix (``keep[b, q, k]``: query ``q`` sees key ``k``), in the form that
family honours (SDAR: 4-D bool; LLaDA2: 4-D additive in the model's dtype). The block estimators use it
for their noisy/clean layout of length ``2L``.

============  ==========  ===========================================================================
family        attention   how the backbone is called
============  ==========  ===========================================================================
llada         full        the output of ``model.model.transformer.ln_f`` (LLaDA-8B's backbone returns
                          logits and ``hidden_states``, no ``last_hidden_state``; the call stops at the
                          final norm, before the head), ``use_cache=False``; recorded form ``"none"``:
                          the hub's code passes ``attn_mask=None`` to both attention calls, so padded
                          rows run with their padding stripped, while dllm's patched code (same
                          ``model_type``) honours the 2-D mask, which the check finds.
llada_moe     full        ``model.model(...).last_hidden_state``; recorded form ``"none"``: its code
                          ignores every mask (``model_type`` ``"lladamoe"``; older configs say
                          ``"llada"`` and are told apart by ``num_experts``).
dream         full        ``model.model(...).last_hidden_state``; recorded form ``"4d-bool"``
                          (``[B, 1, L, L]`` key mask) with ``position_ids`` counted over the attended
                          tokens, ``attention_mask="full"`` without padding (its code passes the mask
                          straight to SDPA: a 2-D integer mask is an error there; dllm's variant
                          refuses ``None``). Shifted logits (``shift=True``); DiffuCoder ships the
                          same code.
sdar          block       ``model.model(..., use_cache=False)`` with a 4-D bool block-causal mask
                          (``config.block_size``): its code uses a caller's 4-D mask as is (no mask is
                          full attention, a 2-D mask key padding). TraDo ships the same code.
llada2        block       ``model.model(..., use_cache=False)`` with a 4-D additive block-causal mask in
                          the model's dtype (``config.block_size``, else the released ``generate``'s 32);
                          its code turns a 2-D mask with any 0 into a *causal* mask for the whole batch.
generic       full        ``model.base_model(...).last_hidden_state`` (or ``hidden_states[-1]``);
                          recorded form ``"2d"``: transformers' own models (Llama or Qwen with
                          ``is_causal=False``, ModernBERT, BERT).
============  ==========  ===========================================================================

A family's record also says how its backbone takes a KV cache, if its code has a way: the block
sampler's call for the block-causal families (``block_cache_kwargs``), the approximate prefix/dual
cache's for the full-attention ones (``prefix_cache``, a
[`PrefixCacheCall`][daca_kernels.models.families.PrefixCacheCall] naming a driver of
[`daca_kernels.rollout.prefix_cache`][daca_kernels.rollout.prefix_cache]).

Block-causal attention: position ``q`` sees key ``k`` iff ``k // block_size <= q // block_size``, blocks
counted from position 0 of the input as given (the released decoders count them from position 0 of
the prompt-plus-completion sequence).

Refused: transformers' DiffusionGemma (uniform-noise diffusion with an encoder-decoder split: there is
no mask token to score against).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

# The mask id of the released LLaDA-MoE and LLaDA2 tokenizers (and LLaDA2's ``generate`` default); their
# configs have no ``mask_token_id``.
INCLUSION_MASK_ID = 156895
# The released LLaDA2 ``generate``'s ``block_length`` default; its config has no ``block_size``.
LLADA2_BLOCK_SIZE = 32

# Where a backbone's output holds the states the head reads (see MaskedLM.from_hf).
HIDDEN_SOURCES = ("last_hidden_state", "hidden_states")

# The forms in which a full-attention backbone may be given a left-padded batch's key-padding mask, in
# the order MaskedLM.from_hf tries them after the family's own; "none" (rows run without their
# padding, batched by length) serves any model and is tried last.
MASK_FORMS = {
    "2d": "the 2-D [B, L] key-padding mask",
    "4d-bool": "a 4-D bool [B, 1, L, L] key mask",
    "4d-additive": "a 4-D additive [B, 1, L, L] key mask in the model's dtype",
    "none": "no mask: each row's padding stripped, rows of equal length batched",
}


@dataclass(frozen=True)
class PrefixCacheCall:
    """How a full-attention family's backbone is given an approximate prefix (or dual) KV cache
    ([`daca_kernels.rollout.prefix_cache`][daca_kernels.rollout.prefix_cache], which holds the drivers
    and what each can serve).

    Attributes:
        driver: ``"past_key_values"`` (the backbone's own call with ``past_key_values=cache,
            use_cache=True``: transformers' protocol), ``"llada_blocks"`` (LLaDA's blocks driven with
            ``layer_past``, its forward asserting no cache) or ``"llada_moe_layers"`` (LLaDA-MoE's
            decoder layers driven with ``past_key_value``, likewise).
        unmasked: the ``attention_mask`` given without padding (Dream's released copies take
            ``"full"``; dllm's refuses None), or None.
        attended_positions: a padded row's position ids count its attended tokens (Dream's own call),
            rather than every column.
        strips_padding: a model of the family whose code ignores masks (mask form ``"none"``) runs
            padded rows without their padding, as its exact path does.
        applies: ``(model) -> bool``, whether a model of the family has the protocol at all (a
            transformers decoder: only one built bidirectional), or None: every model does.
    """

    driver: str
    unmasked: str | None = None
    attended_positions: bool = False
    strips_padding: bool = False
    applies: Callable[[nn.Module], bool] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Family:
    """What [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] and the block sampler need to know about a family of
    released models.

    Attributes:
        name: ``"llada"``, ``"llada_moe"``, ``"dream"``, ``"sdar"``, ``"llada2"`` or ``"generic"``.
        title: the name used in messages (e.g. ``"Dream / DiffuCoder"``).
        shift: True when position ``i - 1`` predicts token ``i``, False when position ``i`` does, None
            when the family does not say (the caller's ``shift``, default False).
        block: True for block-causal families (the block size from ``config.block_size``).
        default_block_size: the block size when the config has none, or None.
        default_mask_id: the released mask id when the config has no ``mask_token_id``, or None.
        hidden_from: where the backbone's output holds the states the head reads (``HIDDEN_SOURCES``).
        mask_form: for a full-attention family, the key of [`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS] its released code is
            known to honour: tried first by the construction check and used without it. For a block
            family, the form of its block-causal mask (fixed, not searched).
        call_kwargs: ``(input_ids, attention_mask or None, block_size or None, dtype, form=None) ->
            dict`` of the keyword arguments (the attention mask in ``form``, a key of
            [`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS], None for ``mask_form``; position ids; cache flags) for the backbone
            and for the whole model (both take them and pass them on). With ``form="none"`` the
            mask is not passed (the caller strips the padding).
        states_module: for a backbone that computes logits after its last hidden state (LLaDA-8B),
            the path from the backbone to the module whose output is that state: the call stops
            there, so the ``[B, L, V]`` logits are never computed. None otherwise.
        keep_kwargs: ``(keep bool [B, N, N], position_ids long [B, N], dtype) -> dict``: the keyword
            arguments that make the backbone use exactly that attention matrix and those positions,
            or None for a family whose code honours no such mask (then the estimators fall back to
            one forward per block).
        block_cache_kwargs: the family's KV-cache protocol for block-by-block decoding
            ([`daca_kernels.rollout.block_cache`][daca_kernels.rollout.block_cache]): ``(keep bool [B, 1, n, K], store bool, dtype) ->
            dict``,
            the keyword arguments that give the backbone the key visibility ``keep`` (cached columns
            first) in the form its code takes, and, where its code has one, the flag that stores the
            call's keys and values (``store``). None for a family without such a protocol (decoded
            without a cache).
        prefix_cache: a full-attention family's approximate prefix/dual KV-cache call
            ([`PrefixCacheCall`][daca_kernels.models.families.PrefixCacheCall]), or None (no such cache).
    """

    name: str
    title: str
    shift: bool | None
    block: bool
    default_block_size: int | None
    default_mask_id: int | None
    hidden_from: str
    mask_form: str
    call_kwargs: Callable[..., dict] = field(repr=False)
    states_module: str | None = None
    keep_kwargs: Callable[[Tensor, Tensor, torch.dtype], dict] | None = field(default=None, repr=False)
    block_cache_kwargs: Callable[[Tensor, bool, torch.dtype], dict] | None = field(default=None, repr=False)
    prefix_cache: PrefixCacheCall | None = None


def block_causal_keep(length: int, block_size: int, device: torch.device) -> Tensor:
    """bool ``[L, L]``: query ``q`` sees key ``k`` iff ``k // block_size <= q // block_size``."""
    block = torch.arange(length, device=device) // block_size
    return block[None, :] <= block[:, None]


def _keep_4d(input_ids: Tensor, attention_mask: Tensor | None, block_size: int | None) -> Tensor | None:
    """bool ``[B, 1, L, L]`` (True = attend) from the key-padding mask and the block rule, or None for full
    attention without padding. Every query also sees itself, so a padding query whose whole block is
    padding still has a key: a row of SDPA with no key is NaN, and NaN values reach the real rows
    through the next layer's ``0 * NaN``."""
    batch, length = input_ids.shape
    device = input_ids.device
    keep = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        keep = attention_mask.bool()[:, None, None, :].expand(batch, 1, length, length)
    if block_size is not None:
        rule = block_causal_keep(length, block_size, device)
        keep = rule.expand(batch, 1, length, length) if keep is None else keep & rule
    if keep is None:
        return None
    return keep | torch.eye(length, dtype=torch.bool, device=device)


def _padded(attention_mask: Tensor | None) -> bool:
    """Whether ``attention_mask`` (``[B, L]`` or None) hides any position."""
    return attention_mask is not None and not bool(attention_mask.bool().all())


def padding_kwargs(form: str, input_ids: Tensor, attention_mask: Tensor | None, dtype: torch.dtype) -> dict:
    """``{"attention_mask": ...}`` holding the key-padding mask ``attention_mask`` (``[B, L]``, 1 =
    attend) in ``form`` (a key of [`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS]), or ``{}`` without padding or for ``"none"``.
    The 4-D forms let every query see itself as well (see `_keep_4d`)."""
    if form == "none" or not _padded(attention_mask):
        return {}
    if form == "2d":
        return {"attention_mask": attention_mask}
    keep = _keep_4d(input_ids, attention_mask, None)
    return {"attention_mask": keep if form == "4d-bool" else _additive(keep, dtype)}


def _full(recorded: str, *, unpadded: str | None = None, positions: bool = False, **fixed):
    """``call_kwargs`` of a full-attention family: [`padding_kwargs`][daca_kernels.models.families.padding_kwargs] in the form asked
    for (else
    ``recorded``), ``fixed`` keyword arguments, ``attention_mask=unpadded`` when no mask is passed
    (dllm's Dream refuses None and takes ``"full"``), and with ``positions`` the position ids counted
    over the attended tokens of a padded row (each row then has the positions it has alone)."""
    def call_kwargs(input_ids, attention_mask, block_size, dtype, form=None) -> dict:
        kwargs = {**fixed, **padding_kwargs(form or recorded, input_ids, attention_mask, dtype)}
        if "attention_mask" not in kwargs and unpadded is not None:
            kwargs["attention_mask"] = unpadded
        elif positions and "attention_mask" in kwargs:
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return kwargs

    return call_kwargs


def _sdar(input_ids, attention_mask, block_size, dtype, form=None) -> dict:
    return {"attention_mask": _keep_4d(input_ids, attention_mask, block_size), "use_cache": False}


def _additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``keep``, the dtype's minimum elsewhere, in ``dtype`` (LLaDA2's SDPA refuses a float mask of
    another dtype than the model's)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _llada2(input_ids, attention_mask, block_size, dtype, form=None) -> dict:
    return {"attention_mask": _additive(_keep_4d(input_ids, attention_mask, block_size), dtype), "use_cache": False}


def _sdar_keep(keep, position_ids, dtype) -> dict:
    return {"attention_mask": keep[:, None], "position_ids": position_ids, "use_cache": False}


def _llada2_keep(keep, position_ids, dtype) -> dict:
    return {"attention_mask": _additive(keep[:, None], dtype), "position_ids": position_ids, "use_cache": False}


def _sdar_block_cache(keep, store, dtype) -> dict:
    # SDAR's attention appends to the cache only when told to (``store_kv``); otherwise it reads it.
    return {"attention_mask": keep, "store_kv": store}


def _llada2_block_cache(keep, store, dtype) -> dict:
    # LLaDA2's attention always calls ``cache.update``: the cache itself decides whether to store.
    return {"attention_mask": _additive(keep, dtype)}


def bidirectional_decoder(model: nn.Module) -> bool:
    """A transformers decoder (Llama, Qwen, ...) built with ``is_causal=False``: its attention takes
    ``past_key_values``, ``position_ids`` and a 4-D bool mask."""
    config = getattr(model, "config", None)
    backbone = getattr(model, "base_model", None)
    if config is None or backbone is None or getattr(config, "is_causal", True) is not False:
        return False
    parameters = inspect.signature(backbone.forward).parameters
    return all(name in parameters for name in ("past_key_values", "position_ids", "use_cache"))


# transformers 5 drops ``use_cache`` from LLaDA's released config, and its model reads it when not given.
LLADA = Family("llada", "LLaDA", False, False, None, None, "hidden_states", "none",
               _full("none", use_cache=False), states_module="transformer.ln_f",
               prefix_cache=PrefixCacheCall("llada_blocks", strips_padding=True))
LLADA_MOE = Family("llada_moe", "LLaDA-MoE", False, False, None, INCLUSION_MASK_ID, "last_hidden_state", "none",
                   _full("none"), prefix_cache=PrefixCacheCall("llada_moe_layers", strips_padding=True))
DREAM = Family("dream", "Dream / DiffuCoder", True, False, None, None, "last_hidden_state", "4d-bool",
               _full("4d-bool", unpadded="full", positions=True),
               prefix_cache=PrefixCacheCall("past_key_values", unmasked="full", attended_positions=True))
SDAR = Family("sdar", "SDAR / TraDo", False, True, None, None, "last_hidden_state",
              "a 4-D bool [B, 1, L, L] block-causal mask", _sdar,
              keep_kwargs=_sdar_keep, block_cache_kwargs=_sdar_block_cache)
LLADA2 = Family("llada2", "LLaDA2", False, True, LLADA2_BLOCK_SIZE, INCLUSION_MASK_ID, "last_hidden_state",
                "a 4-D additive [B, 1, L, L] block-causal mask in the model's dtype", _llada2,
                keep_kwargs=_llada2_keep, block_cache_kwargs=_llada2_block_cache)
GENERIC = Family("generic", "", None, False, None, None, "last_hidden_state", "2d", _full("2d"),
                 prefix_cache=PrefixCacheCall("past_key_values", applies=bidirectional_decoder))

# Models the estimators cannot serve, by config ``model_type``, with the reason.
UNSUPPORTED = {
    "diffusion_gemma": "DiffusionGemma is a uniform-noise diffusion model with an encoder-decoder split: "
                       "it has no mask token, so the masked-diffusion estimators do not apply to it",
}
UNSUPPORTED["diffusion_gemma_text"] = UNSUPPORTED["diffusion_gemma"]


# The names by which a family's releases identify themselves: config ``model_type``s (compared in lower
# case), config class names and model class names (the class's own and the config's ``architectures``).
SIGNS = {
    "llada_moe": ({"lladamoe", "llada_moe"}, {"LLaDAMoEConfig"}, {"LLaDAMoEModelLM", "LLaDAMoEModel"}),
    "llada": ({"llada"}, {"LLaDAConfig"}, {"LLaDAModelLM"}),
    "dream": ({"dream"}, {"DreamConfig"}, {"DreamModel"}),
    "sdar": ({"sdar"}, {"SDARConfig"}, {"SDARForCausalLM", "SDARModel"}),
    "llada2": ({"llada2_moe", "llada2"}, {"LLaDA2MoeConfig"}, {"LLaDA2MoeModelLM", "LLaDA2MoeModel"}),
}


def _signs(model: nn.Module) -> tuple[str, str, set[str]]:
    """``(model_type in lower case, config class name, model class names)`` of ``model``."""
    config = getattr(model, "config", None)
    kind = str(getattr(config, "model_type", "") or "").lower()
    names = {type(model).__name__, *(getattr(config, "architectures", None) or ())}
    return kind, type(config).__name__ if config is not None else "", names


def _llada_structure(model: nn.Module) -> bool:
    """LLaDA's module structure: a backbone holding its layers in a ``transformer`` ModuleDict."""
    return isinstance(getattr(getattr(model, "model", None), "transformer", None), nn.ModuleDict)


def recognise(model: nn.Module) -> Family:
    """The family of ``model`` (``GENERIC`` for transformers' own models and anything unknown).

    Any of the config's ``model_type``, the config class name, the model class name, the config's
    ``architectures`` ([`SIGNS`][daca_kernels.models.families.SIGNS]) or LLaDA's module structure names a family; a LLaDA-like model
    whose config has ``num_experts`` is LLaDA-MoE (its early configs say ``model_type="llada"``). A
    model the estimators cannot serve (``UNSUPPORTED``) is a ValueError naming ``model``.
    """
    kind, config_class, names = _signs(model)
    if kind in UNSUPPORTED or any(name.startswith("DiffusionGemma") for name in names):
        raise ValueError(f"model: {type(model).__name__} is not supported: {UNSUPPORTED['diffusion_gemma']}")
    found = [family for family, (kinds, configs, classes) in SIGNS.items()
             if kind in kinds or config_class in configs or names & classes]
    if "llada" in found or (not found and _llada_structure(model)):
        moe = "llada_moe" in found or getattr(getattr(model, "config", None), "num_experts", None) is not None
        return LLADA_MOE if moe else LLADA
    return by_name(found[0]) if found else GENERIC


def by_name(name: str) -> Family:
    """The family record named ``name`` (``Family.name``), read from this module when called."""
    return {family.name: family for family in (LLADA, LLADA_MOE, DREAM, SDAR, LLADA2, GENERIC)}[name]


def param_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating parameter (float32 if none): an additive mask's dtype."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def backbone_fn(family: Family, backbone: nn.Module, hidden_from: str, block_size: int | None,
                transform: nn.Module | None = None, form: str | None = None
                ) -> Callable[[Tensor, "Tensor | None"], Tensor]:
    """``hidden(input_ids [B, L] long, attention_mask [B, L] or None) -> [B, L, H]`` for ``backbone``.

    ``hidden_from`` (``HIDDEN_SOURCES``) says where the output holds the states; ``transform`` is a
    prediction-head transform applied to them (ModernBERT's, BERT's), or None; ``form`` (a key of
    [`MASK_FORMS`][daca_kernels.models.families.MASK_FORMS], None for the family's ``mask_form``) is how a full-attention backbone gets the
    padding mask (``"none"``: [`run_without_padding`][daca_kernels.models.families.run_without_padding]). The dtype of any additive mask is
    [`param_dtype`][daca_kernels.models.families.param_dtype] of the backbone.
    """
    dtype = param_dtype(backbone)
    final = _final_module(family, backbone, hidden_from)
    form = form or family.mask_form
    if form not in MASK_FORMS and not family.block:
        raise ValueError(f"mask_form must be one of {', '.join(MASK_FORMS)}, got {form!r}")

    def run(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        return _states(backbone, hidden_from, final, transform, input_ids,
                       family.call_kwargs(input_ids, attention_mask, block_size, dtype, form))

    if family.block or form != "none":
        return run

    def stripped(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if attention_mask is None or bool(attention_mask.bool().all()):
            return run(input_ids, None)
        return run_without_padding(lambda ids: run(ids, None), input_ids, attention_mask.bool())

    return stripped


def find_submodule(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule of ``module`` at the dotted ``path``, or None."""
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module


class _Stop(Exception):
    def __init__(self, output):
        self.output = output


def output_of(module: nn.Module, call: Callable[[], object]) -> Tensor:
    """The output of ``module``'s first forward during ``call()``, which is stopped there (what
    ``call`` would compute afterwards, e.g. a head's logits, is never computed). Differentiable;
    a ValueError if ``call`` never runs ``module``."""
    def stop(_module, _inputs, output):
        raise _Stop(output)

    handle = module.register_forward_hook(stop)
    try:
        call()
    except _Stop as stopped:
        return stopped.output
    finally:
        handle.remove()
    raise ValueError(f"{type(module).__name__} did not run during the backbone call")


def keep_backbone_fn(family: Family, backbone: nn.Module, hidden_from: str,
                     transform: nn.Module | None = None) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    """``hidden(input_ids [B, N] long, position_ids [B, N] long, keep [B, N, N] bool) -> [B, N, H]`` for
    ``backbone``, or None when the family has no ``keep_kwargs``. ``keep[b, q, k]``: query ``q`` of row ``b``
    attends to key ``k``; every query row must keep at least one key (an SDPA row without a key is NaN)."""
    if family.keep_kwargs is None:
        return None
    dtype = param_dtype(backbone)
    final = _final_module(family, backbone, hidden_from)

    def run(input_ids: Tensor, position_ids: Tensor, keep: Tensor) -> Tensor:
        return _states(backbone, hidden_from, final, transform, input_ids,
                       family.keep_kwargs(keep, position_ids, dtype))

    return run


def _final_module(family: Family, backbone: nn.Module, hidden_from: str) -> nn.Module | None:
    """The module whose output is the last hidden state, where the call stops (``states_module``)."""
    if hidden_from != "hidden_states" or family.states_module is None:
        return None
    return find_submodule(backbone, family.states_module)


def _states(backbone: nn.Module, hidden_from: str, final: nn.Module | None, transform: nn.Module | None,
            input_ids: Tensor, kwargs: dict) -> Tensor:
    if final is not None:
        states = output_of(final, lambda: backbone(input_ids=input_ids, **kwargs))
    elif hidden_from == "hidden_states":
        states = backbone(input_ids=input_ids, output_hidden_states=True, **kwargs).hidden_states[-1]
    else:
        states = backbone(input_ids=input_ids, **kwargs).last_hidden_state
    return states if transform is None else transform(states)


def run_without_padding(run: Callable[[Tensor], Tensor], input_ids: Tensor, keep: Tensor) -> Tensor:
    """``run`` on each row's attended tokens alone, scattered back to ``[B, L, H]`` (0 at the others).

    Rows with the same number of attended tokens run as one batch, each with its tokens gathered in
    order, so a row's states are those of the row alone whatever its padding (left, right or holes).
    Differentiable through ``run``.
    """
    batch, length = input_ids.shape
    counts = keep.sum(-1)
    out = None
    for count in counts.unique().tolist():
        if count == 0:
            continue
        rows = (counts == count).nonzero().squeeze(1)
        cols = keep[rows].nonzero()[:, 1].view(len(rows), count)
        states = run(input_ids[rows[:, None], cols])
        if out is None:
            out = states.new_zeros(batch, length, states.shape[-1])
        out = out.index_put((rows[:, None].expand_as(cols), cols), states)
    if out is None:
        raise ValueError("attention_mask has no attended token in any row")
    return out
