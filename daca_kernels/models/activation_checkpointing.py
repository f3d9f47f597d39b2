"""Activation checkpointing of the decoder layers for backbones that do not implement it.

Released modeling code for some masked diffusion LMs (LLaDA-8B) leaves
``supports_gradient_checkpointing`` at ``PreTrainedModel``'s ``False``, so transformers'
``activation_checkpointing_enable`` (what ``Trainer.train`` calls when ``gradient_checkpointing``
is on, TRL's default) raises. [`checkpoint_layers`][daca_kernels.models.activation_checkpointing.checkpoint_layers] does the same job
from outside the model:
it finds the decoder layers ([`decoder_layers`][daca_kernels.models.activation_checkpointing.decoder_layers]) and makes each one's
forward run under
non-reentrant ``torch.utils.checkpoint``, so a layer keeps only its inputs and recomputes its
activations in the backward.

The layers are not wrapped in new modules: each layer's instance ``forward`` is replaced, so
parameter names, ``state_dict`` keys and checkpoints stay those of the released class, and the
layer's own hooks (FSDP2's gathers) run once around the checkpointed call.
"""
from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ORIGINAL = "_daca_checkpointed_forward"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers of ``model``: among the lists whose entries share one
    class, the one holding the most parameters (the layers hold all but the embeddings, head and
    final norm, and contain any nested list such as MoE experts). E.g. LLaDA-8B's
    ``model.transformer.blocks``, Llama-style ``model.layers``. ValueError if there is none."""
    layers = _largest_layer_list(model)
    if layers is None:
        raise ValueError(f"model: {type(model).__name__} has no nn.ModuleList of decoder layers to checkpoint")
    return layers


def _largest_layer_list(model: nn.Module) -> nn.ModuleList | None:
    best, best_size = None, 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(layer) for layer in module}) != 1:
            continue
        # A DeepSpeed ZeRO-3 partition holds no elements locally; ds_numel is the parameter's full size.
        size = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def supports_native_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' ``activation_checkpointing_enable`` (transformers 4's
    ``gradient_checkpointing_enable``) works on ``model`` (the class declares
    ``supports_gradient_checkpointing``)."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and \
        (hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable"))


def checkpoint_layers(model: nn.Module, activation_checkpointing_kwargs: dict | None = None,
                      every_n_layers: int = 1, offload: bool = False) -> list[int]:
    """Checkpoint every ``every_n_layers``-th decoder layer of ``model`` (from layer 0); returns
    their indices. The arguments are those of transformers' ``activation_checkpointing_enable``:
    ``activation_checkpointing_kwargs`` go to ``torch.utils.checkpoint.checkpoint`` (default
    ``use_reentrant=False``), ``offload`` keeps the saved layer inputs in pinned host memory.

    A checkpointed layer recomputes only when it is training and gradients are on; in evaluation
    or under ``no_grad`` (rollouts, reference passes) it runs as before. Idempotent: calling it
    again re-applies the new settings."""
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be an int >= 1, got {every_n_layers!r}")
    kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
    uncheckpoint_layers(model)
    chosen = []
    for index, layer in enumerate(decoder_layers(model)):
        if index % every_n_layers:
            continue
        original = layer.forward
        setattr(layer, _ORIGINAL, original)
        layer.forward = types.MethodType(functools.partial(_checkpointed, original=original, kwargs=kwargs,
                                                           offload=offload), layer)
        chosen.append(index)
    return chosen


def checkpointed_layers(model: nn.Module) -> list[int]:
    """The indices of the decoder layers [`checkpoint_layers`][daca_kernels.models.activation_checkpointing.checkpoint_layers]
    checkpointed (empty if none)."""
    return [i for i, layer in enumerate(decoder_layers(model)) if _ORIGINAL in layer.__dict__]


def uncheckpoint_layers(model: nn.Module) -> None:
    """Undo [`checkpoint_layers`][daca_kernels.models.activation_checkpointing.checkpoint_layers] (a no-op on layers it did not change)."""
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            if getattr(original, "__self__", None) is module and original.__func__ is type(module).forward:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original


def _checkpointed(layer: nn.Module, *args, original, kwargs: dict, offload: bool, **call_kwargs):
    if not (layer.training and torch.is_grad_enabled()):
        return original(*args, **call_kwargs)
    if offload:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return checkpoint(original, *args, **call_kwargs, **kwargs)
    return checkpoint(original, *args, **call_kwargs, **kwargs)


def enable_checkpointing_fallback(model: nn.Module) -> bool:
    """Give ``model`` a working ``activation_checkpointing_enable`` (and its deprecated alias
    ``gradient_checkpointing_enable``, and the matching disables) built on
    [`checkpoint_layers`][daca_kernels.models.activation_checkpointing.checkpoint_layers]
    when its class has none and it has decoder layers; returns whether it did. Nothing is
    checkpointed yet: ``Trainer.train`` calls the method when ``gradient_checkpointing``
    (``activation_checkpointing``) is on. A model left alone keeps its own methods (and their
    errors)."""
    if supports_native_checkpointing(model) or _largest_layer_list(model) is None:
        return False

    def enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False,
               gradient_checkpointing_kwargs=None):
        checkpoint_layers(self, activation_checkpointing_kwargs or gradient_checkpointing_kwargs,
                          every_n_layers=every_n_layers, offload=offload)

    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        setattr(model, name, types.MethodType(enable, model))
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        setattr(model, name, types.MethodType(uncheckpoint_layers, model))
    return True
