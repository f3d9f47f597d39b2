"""What the families' released modeling code imports or calls that the installed transformers lacks.

The released files (LLaDA, LLaDA-MoE, Dream / DiffuCoder, SDAR / TraDo, LLaDA2) were written for
transformers 4.46-4.57. [`released_code_support`][daca_kernels.models.released_code.released_code_support] supplies, while a
checkpoint's remote code is
imported and its model built, only the names that are missing (nothing already present is replaced):

- ``ROPE_INIT_FUNCTIONS["default"]`` (gone in transformers 5; Dream, LLaDA-MoE, SDAR and LLaDA2 build
  their rotary embedding with it): the standard frequencies ``1 / theta ** (arange(0, d, 2) / d)`` over
  ``d = head_dim * partial_rotary_factor`` rotary dimensions, attention factor 1.
- ``transformers.utils.LossKwargs`` (gone in transformers 5; SDAR's import): the ``TypedDict`` of the
  loss's ``num_items_in_batch``.
- ``transformers.utils.import_utils.is_torch_fx_available`` (gone in transformers 5; LLaDA2's import):
  True, as transformers 4 answered with torch installed.
- ``GenerationConfig.validate`` overrides that take fewer keywords than transformers 5 passes (Dream's
  ``DreamGenerationConfig.validate(self, is_init=False)``; transformers 5 calls it with
  ``user_set_attributes=`` while loading a checkpoint's generation config): a subclass defined while the
  support is active gets a ``validate`` that drops the keywords its own does not take.
- ``GenerationConfig.from_model_config`` of a subclass that adds fields (Dream's ``DreamGenerationConfig``:
  ``eps``, ``steps``, ``alg``, ...; ``diffusion_generate`` builds one from the model config whenever the
  caller passes no ``generation_config``): transformers 5 compares every field with a plain
  ``GenerationConfig()``'s and fails on the subclass's own (``AttributeError: ... 'eps'``); a subclass
  defined while the support is active and not defining its own gets transformers 4's construction, the
  model config's non-None fields through ``cls.from_dict``.
- ``flash_attn.ops.triton.layer_norm.rms_norm_fn`` when flash-attn is not installed (SDAR imports it at
  module level for every RMSNorm; flash-attn needs a CUDA build): a PyTorch RMSNorm with flash-attn's
  arithmetic (float32 normalisation and weight product, rounded once to the input's dtype).

What the released files register with transformers' Auto classes while they are imported
(``AutoConfig.register("llada", LLaDAConfig)``, ``AutoModel.register(...)``; LLaDA, LLaDA-MoE, Dream) is
undone when the support ends: transformers 5 takes a registered class before a checkpoint's own remote
code, so without that a process that loaded one LLaDA checkpoint would build every later checkpoint of
``model_type`` ``"llada"`` (hub LLaDA-8B's code or dllm's patched one, which differ in how they mask
padding) with the first one's classes. Registrations made before the support began are kept.

The model files themselves are never edited.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from typing import Optional, TypedDict

import torch
from torch import Tensor


def default_rope_parameters(config=None, device=None, seq_len=None, **kwargs) -> tuple[Tensor, float]:
    """transformers 4's ``"default"`` rotary initialiser: ``(inv_freq float32 [d / 2], 1.0)``.

    ``d`` is ``config.head_dim`` (else ``hidden_size // num_attention_heads``) times
    ``config.partial_rotary_factor`` (1 when absent or not in ``(0, 1]``); the base is ``config.rope_theta``
    (or ``config.rope_parameters["rope_theta"]``).
    """
    base = getattr(config, "rope_theta", None)
    if base is None:
        base = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    factor = getattr(config, "partial_rotary_factor", 1.0)
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        factor = 1.0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (base ** exponents), 1.0


class LossKwargs(TypedDict, total=False):
    """transformers 4's keyword arguments of a model's loss."""

    num_items_in_batch: Optional[int]  # noqa: UP045 (the released files' annotation style)


def rms_norm_fn(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-6, **_ignored) -> Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]`` (and ``bias [H]`` or None) in float32, returned in
    ``x``'s dtype: flash-attn's ``rms_norm_fn`` without a residual or dropout."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _flash_attn_stand_in() -> dict[str, types.ModuleType]:
    """Modules ``flash_attn``, ``flash_attn.ops``, ``flash_attn.ops.triton`` and
    ``flash_attn.ops.triton.layer_norm`` (holding [`rms_norm_fn`][daca_kernels.models.released_code.rms_norm_fn])."""
    names = ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.layer_norm")
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():
        # A spec without a loader, and no distribution metadata: transformers' checks for an installed
        # flash-attn (is_flash_attn_2_available) still answer False.
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name != names[-1])
    for parent, child in zip(names, names[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
        modules[parent].__path__ = []
    modules["flash_attn.ops.triton.layer_norm"].rms_norm_fn = rms_norm_fn
    modules["flash_attn"].__version__ = "0.0 (daca_kernels stand-in: rms_norm_fn only)"
    return modules


def _tolerant_validate(validate):
    """``validate`` called with only the keywords its signature names (unchanged if it takes ``**kwargs``)."""
    parameters = inspect.signature(validate).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return validate

    @functools.wraps(validate)
    def call(self, *args, **kwargs):
        return validate(self, *args, **{key: value for key, value in kwargs.items() if key in parameters})

    return call


def _from_model_config_of_fields(cls, model_config):
    """transformers 4's ``GenerationConfig.from_model_config`` for a subclass: ``cls.from_dict`` of the model
    config's fields that are not None (its special case, a text sub-config's generation fields, concerns
    composite models, which the released families are not)."""
    config_dict = model_config.to_dict() if not isinstance(model_config, dict) else dict(model_config)
    config_dict.pop("_from_model_config", None)
    config_dict = {key: value for key, value in config_dict.items() if value is not None}
    return cls.from_dict(config_dict, return_unused_kwargs=False, _from_model_config=True)


def _compares_with_plain_defaults() -> bool:
    """Whether the installed ``GenerationConfig.from_model_config`` reads every field of the built config
    from a plain ``GenerationConfig()`` (transformers 5; transformers 4 does only for composite models)."""
    from transformers import GenerationConfig

    try:
        source = inspect.getsource(GenerationConfig.from_model_config)
    except (OSError, TypeError):
        return False
    return "default_generation_config" in source and "decoder_config is not model_config" not in source


def _auto_registries() -> list[dict]:
    """The dictionaries in which ``AutoConfig.register`` and every Auto model class's ``register`` keep
    their entries (``_extra_content`` of transformers' lazy mappings; those without one are skipped)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = [configuration_auto.CONFIG_MAPPING]
    mappings += [value for value in vars(modeling_auto).values() if type(value).__name__ == "_LazyAutoMapping"]
    return [m._extra_content for m in mappings if isinstance(getattr(m, "_extra_content", None), dict)]


@contextlib.contextmanager
def auto_registrations_undone():
    """While active, registrations with transformers' Auto classes may be made; on exit the registries
    hold exactly what they held on entry (module docstring)."""
    registries = _auto_registries()
    saved = [dict(registry) for registry in registries]
    try:
        yield
    finally:
        for registry, before in zip(registries, saved):
            registry.clear()
            registry.update(before)


@contextlib.contextmanager
def released_code_support():
    """While active, the names listed in the module docstring exist where the released files look for
    them; on exit, what was added is removed again (a remote module imported meanwhile keeps the
    objects it bound), except ``ROPE_INIT_FUNCTIONS["default"]``, which stays: rebuilding a rotary
    module later ([`daca_kernels.models.model_loading.repair_buffers`][daca_kernels.models.model_loading.repair_buffers]) looks it up
    again."""
    from transformers import GenerationConfig, modeling_rope_utils, utils
    from transformers.utils import import_utils

    added: list[tuple[object, str]] = []
    if "default" not in modeling_rope_utils.ROPE_INIT_FUNCTIONS:
        modeling_rope_utils.ROPE_INIT_FUNCTIONS["default"] = default_rope_parameters
    for module, name, value in ((utils, "LossKwargs", LossKwargs),
                                (import_utils, "is_torch_fx_available", lambda: True)):
        if not hasattr(module, name):
            setattr(module, name, value)
            added.append((module, name))
    stand_in = {}
    if "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is None:
        stand_in = _flash_attn_stand_in()
        sys.modules.update(stand_in)
    own_hook = GenerationConfig.__dict__.get("__init_subclass__")

    plain_defaults = _compares_with_plain_defaults()

    def subclass_hook(cls, **kwargs):
        super(GenerationConfig, cls).__init_subclass__(**kwargs)
        if "validate" in cls.__dict__:
            cls.validate = _tolerant_validate(cls.__dict__["validate"])
        if plain_defaults and "from_model_config" not in cls.__dict__:
            cls.from_model_config = classmethod(_from_model_config_of_fields)

    if own_hook is None:
        GenerationConfig.__init_subclass__ = classmethod(subclass_hook)
    try:
        with auto_registrations_undone():
            yield
    finally:
        if own_hook is None:
            del GenerationConfig.__init_subclass__
        for name in stand_in:
            sys.modules.pop(name, None)
        for module, name in added:
            delattr(module, name)
