"""Loading the families' released modeling code (written for transformers 4) under transformers 5.

[`from_pretrained`][daca_kernels.models.model_loading.from_pretrained] loads a checkpoint and
[`prepare_model`][daca_kernels.models.model_loading.prepare_model] makes a model object work with
TRL and transformers 5; what each fixes:

- LLaDA-8B's ``LLaDAModelLM.__init__`` never calls ``post_init()``, which transformers 5's
  ``from_pretrained`` relies on (``AttributeError: ... 'all_tied_weights_keys'``):
  [`complete_construction`][daca_kernels.models.model_loading.complete_construction] calls it for such classes while a load runs.
- A class that is not a ``GenerationMixin`` has no ``generation_config`` under transformers 5
  (LLaDA-MoE), and TRL reads one: [`default_generation_config`][daca_kernels.models.model_loading.default_generation_config].
- ``_tied_weights_keys`` declared as a list (transformers 4's form; LLaDA-MoE, Dream, SDAR, LLaDA2)
  makes ``save_pretrained`` fail: [`tied_weights_as_mapping`][daca_kernels.models.model_loading.tied_weights_as_mapping].
- LLaDA-8B's ``LLaDAConfig(use_cache=False)`` loses ``use_cache`` under transformers 5, and
  ``LLaDAModelLM.forward`` reads ``config.use_cache`` when the caller passes none (LLaDA's own
  ``generate.py`` calls ``model(x, attention_mask=...)``): [`restore_use_cache`][daca_kernels.models.model_loading.restore_use_cache].
- dllm's LLaDA supports activation checkpointing through a transformers 4 hook,
  ``_set_gradient_checkpointing(enable, gradient_checkpointing_func)``, which transformers 5 also
  passes ``every_n_layers`` (``TypeError`` in ``Trainer.train``):
  [`tolerant_checkpointing_hook`][daca_kernels.models.model_loading.tolerant_checkpointing_hook].
- Non-persistent buffers (below): [`repair_buffers`][daca_kernels.models.model_loading.repair_buffers].

``from_pretrained`` builds a model on the meta device and then materialises what the checkpoint does
not hold: non-persistent buffers become ``torch.empty_like`` memory and are filled only by the
model's ``_init_weights``. The released code of several families (Dream, LLaDA-MoE, SDAR, LLaDA2)
computes its rotary ``inv_freq`` in ``__init__`` and has an ``_init_weights`` that never touches it,
so the loaded model runs on uninitialised frequencies. [`repair_buffers`][daca_kernels.models.model_loading.repair_buffers] recomputes them.
"""
from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from daca_kernels._optional import require
from daca_kernels.models.activation_checkpointing import enable_checkpointing_fallback
from daca_kernels.models.released_code import released_code_support

if TYPE_CHECKING:
    from transformers import GenerationConfig

# The attribute transformers 5's ``post_init()`` sets and its ``from_pretrained`` reads.
_POST_INIT_ATTRIBUTE = "all_tied_weights_keys"


@contextlib.contextmanager
def complete_construction():
    """While active, ``from_pretrained`` of any transformers model class (called directly or through
    an Auto class) completes a model whose ``__init__`` skipped ``post_init()`` by calling it at the
    end of construction, as transformers' own classes do; a ``tie_weights(self)`` that takes no
    arguments (transformers 4's signature, which transformers 5 calls with ``missing_keys`` and
    ``recompute_mapping``) is called without them during the load. Classes that call ``post_init()``
    are unaffected."""
    PreTrainedModel = require("transformers", "hf", "complete_construction").PreTrainedModel  # here: it costs seconds

    original = PreTrainedModel.__dict__["from_pretrained"]

    def from_pretrained(cls, *args, **kwargs):
        own_init = cls.__dict__.get("__init__")
        init = cls.__init__
        completed_models = []

        def completed(self, *init_args, **init_kwargs):
            init(self, *init_args, **init_kwargs)
            if type(self) is cls and not hasattr(self, _POST_INIT_ATTRIBUTE):
                if _tolerate_tie_weights_arguments(self):
                    completed_models.append(self)
                self.post_init()

        cls.__init__ = completed
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            for model in completed_models:
                del model.tie_weights
            if own_init is None:
                del cls.__init__
            else:
                cls.__init__ = own_init

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


def _tolerate_tie_weights_arguments(model: nn.Module) -> bool:
    """Give ``model`` an instance ``tie_weights`` that accepts transformers 5's arguments when its own
    takes none (transformers 4's signature); True when it did (``del model.tie_weights`` undoes it)."""
    if _takes_arguments(model.tie_weights):
        return False
    released = model.tie_weights
    model.tie_weights = lambda missing_keys=None, recompute_mapping=True: released()
    return True


def finish_construction(model: nn.Module) -> nn.Module:
    """Call ``post_init()`` on a model built directly (not by ``from_pretrained``) whose ``__init__``
    skipped it, as [`complete_construction`][daca_kernels.models.model_loading.complete_construction] does during a load (a no-argument
    ``tie_weights`` is
    called without transformers 5's arguments). Models that ran ``post_init()`` are left as they are.
    In place; returns ``model``."""
    if getattr(model, _POST_INIT_ATTRIBUTE, None) is not None or not hasattr(model, "post_init"):
        return model
    wrapped = _tolerate_tie_weights_arguments(model)
    try:
        model.post_init()
    finally:
        if wrapped:
            del model.tie_weights
    return model


def _takes_arguments(method) -> bool:
    try:
        return bool(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return True


def from_pretrained(model_class, model_id, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(model_id, **kwargs)`` under
    [`complete_construction`][daca_kernels.models.model_loading.complete_construction] and
    [`daca_kernels.models.released_code.released_code_support`][daca_kernels.models.released_code.released_code_support] (what the
    released files import that the
    installed transformers lacks), then [`prepare_model`][daca_kernels.models.model_loading.prepare_model]: a family's released model
    loaded so that
    it trains, saves and reloads.

    Args:
        model_class: a model class (e.g. the released ``LLaDAModelLM``) or a transformers Auto class
            (``AutoModel``, ``AutoModelForCausalLM``; remote code needs ``trust_remote_code=True``).
        model_id: a checkpoint directory or a hub id.
        kwargs: passed to ``from_pretrained`` (``dtype``, ``trust_remote_code``, ...).
    """
    if not hasattr(model_class, "from_pretrained"):
        raise TypeError(f"model_class must be a transformers model or Auto class, got {model_class!r}")
    with released_code_support(), complete_construction():
        model = model_class.from_pretrained(model_id, **kwargs)
    return prepare_model(model)


def default_generation_config(model: nn.Module) -> GenerationConfig | None:
    """Give ``model`` a ``generation_config`` built from its config (bos, eos, pad and, where the
    config has one, mask ids) when it has none, as transformers 5 leaves a class that is not a
    ``GenerationMixin`` (LLaDA-MoE); TRL's constructor reads it. Returns the config it set, or None."""
    if getattr(model, "generation_config", None) is not None:
        return None
    GenerationConfig = require("transformers", "hf", "default_generation_config").GenerationConfig  # here: it costs seconds

    config = GenerationConfig.from_model_config(model.config)
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is not None:
        config.mask_token_id = mask_id
    model.generation_config = config
    return config


def tied_weights_as_mapping(model: nn.Module) -> list[str]:
    """Declare a list ``_tied_weights_keys`` (transformers 4's form, kept by released remote code;
    transformers 5's ``save_pretrained`` calls ``.keys()`` on it) as the mapping transformers 5
    expects, ``{tied key: input embedding's weight key}``, on each module instance that has one.
    Only the declaration changes: whether weights are tied is still ``config.tie_word_embeddings``'s
    (transformers 5 ignores the mapping when it is False). Returns the names of the modules changed."""
    changed = []
    for name, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None)
        if not isinstance(keys, (list, tuple)):
            continue
        embedding = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
        source = next((f"{n}.weight" for n, m in module.named_modules() if embedding is not None and m is embedding),
                      None)
        if source is None:
            raise ValueError(f"model: {name or type(model).__name__} declares tied weights {list(keys)} but has no "
                             f"input embeddings to tie them to")
        module._tied_weights_keys = {key: source for key in keys}
        changed.append(name)
    return changed


def restore_use_cache(model: nn.Module) -> bool:
    """Give ``model.config`` the ``use_cache`` its configuration class takes as an argument (its
    default there) when the config has none, as transformers 5 leaves LLaDA-8B's; a config that has
    one, or whose class takes no ``use_cache``, is left alone. Returns whether it was set."""
    config = getattr(model, "config", None)
    if config is None or hasattr(config, "use_cache"):
        return False
    try:
        parameter = inspect.signature(type(config).__init__).parameters.get("use_cache")
    except (TypeError, ValueError):
        return False
    if parameter is None or parameter.default is parameter.empty:
        return False
    config.use_cache = parameter.default
    return True


def tolerant_checkpointing_hook(model: nn.Module) -> bool:
    """Give ``model`` a ``_set_gradient_checkpointing`` that takes transformers 5's ``every_n_layers``
    when its class's hook takes neither that nor ``**kwargs`` (transformers 4's signature, kept by
    dllm's LLaDA): the hook is called without it, and ``every_n_layers`` other than 1 is a ValueError
    (such a hook checkpoints every layer). An instance attribute: the class is left as released.
    Returns whether the hook was replaced."""
    hook = getattr(model, "_set_gradient_checkpointing", None)
    if hook is None or "_set_gradient_checkpointing" in model.__dict__:
        return False
    try:
        parameters = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return False
    if "value" in parameters or "every_n_layers" in parameters or \
            any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return False  # transformers' own old-format call (value=...), or a hook that takes it already

    model._set_gradient_checkpointing = types.MethodType(_without_every_n_layers, model)
    return True


def _without_every_n_layers(self, *args, every_n_layers: int = 1, **kwargs):
    if every_n_layers != 1:
        raise ValueError(f"every_n_layers: {type(self).__name__}'s own activation checkpointing checkpoints every "
                         f"layer; got every_n_layers={every_n_layers!r}")
    return type(self)._set_gradient_checkpointing(self, *args, **kwargs)


def prepare_model(model: nn.Module) -> nn.Module:
    """Make a released diffusion LM's model object work with TRL and transformers 5:
    [`restore_use_cache`][daca_kernels.models.model_loading.restore_use_cache],
    [`tolerant_checkpointing_hook`][daca_kernels.models.model_loading.tolerant_checkpointing_hook],
    [`default_generation_config`][daca_kernels.models.model_loading.default_generation_config],
    [`tied_weights_as_mapping`][daca_kernels.models.model_loading.tied_weights_as_mapping],
    [`repair_buffers`][daca_kernels.models.model_loading.repair_buffers] and,
    where the class lacks it, layer-wise activation checkpointing
    ([`enable_checkpointing_fallback`][daca_kernels.models.activation_checkpointing.enable_checkpointing_fallback]).
    In place; returns
    ``model``."""
    restore_use_cache(model)
    tolerant_checkpointing_hook(model)
    default_generation_config(model)
    tied_weights_as_mapping(model)
    repair_buffers(model)
    enable_checkpointing_fallback(model)
    return model




def repair_buffers(model: nn.Module) -> list[str]:
    """Recompute the non-persistent buffers of ``model`` that are not finite or differ from a fresh
    computation, in place, with a ``warnings.warn`` naming them.

    The fresh values come from a new instance of the module that owns the buffer, built by calling its
    class with the constructor arguments the module still carries as attributes (``config`` for
    transformers' and the released rotary embeddings; ``dim``, ``base``, ... for older ones). Only
    modules without parameters are rebuilt (rotary embeddings and the like), so nothing large is
    allocated. A rotary module's ``original_inv_freq`` follows its repaired ``inv_freq``. Buffers of a
    module that cannot be rebuilt are left as they are.

    Returns:
        The qualified names (``"model.rotary_emb.inv_freq"``) of the repaired buffers, in module order.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    repaired = []
    for prefix, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if isinstance(module._buffers.get(n), Tensor)]
        if not names or any(True for _ in module.parameters(recurse=True)):
            continue
        fresh = _rebuild(module)
        if fresh is None:
            continue
        for name in sorted(names):
            current, expected = module._buffers[name], fresh._buffers.get(name)
            if not isinstance(expected, Tensor) or expected.shape != current.shape or current.is_meta:
                continue
            expected = expected.to(device=current.device, dtype=current.dtype)
            if _same(current, expected):
                continue
            with torch.no_grad():
                current.copy_(expected)
            if name == "inv_freq" and isinstance(getattr(module, "original_inv_freq", None), Tensor):
                module.original_inv_freq = current.clone()
            repaired.append(f"{prefix}.{name}" if prefix else name)
    if repaired:
        warnings.warn(
            f"{type(model).__name__}: non-persistent buffers left uninitialised by loading were recomputed: "
            f"{', '.join(repaired)}", stacklevel=2,
        )
    return repaired


def _same(current: Tensor, expected: Tensor) -> bool:
    if not current.is_floating_point():
        return torch.equal(current, expected)
    if not bool(torch.isfinite(current).all()):
        return False
    # A fresh computation on another device may differ by a rounding; garbage differs by far more.
    return torch.allclose(current.double(), expected.double(), rtol=1e-5, atol=0)


def _rebuild(module: nn.Module) -> nn.Module | None:
    """A new instance of ``module``'s class on the CPU from the constructor arguments it carries, or None."""
    try:
        parameters = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name != "device" and hasattr(module, parameter.name):
            kwargs[parameter.name] = getattr(module, parameter.name)
        elif parameter.default is parameter.empty or parameter.kind is parameter.POSITIONAL_ONLY:
            return None
    try:
        with torch.device("cpu"):
            return type(module)(**kwargs)
    except Exception:  # a constructor this generic call cannot satisfy: leave the module as it is
        return None
