"""Hub-style checkpoints of the families' released modeling code, for the conformance tests.

The released files (the modeling code a hub checkpoint loads with ``trust_remote_code=True``) live outside
the repository, in ``../shared/released-models/<folder>/`` beside the clone (or wherever
``DACA_RELEASED_MODELS`` points); ``python -m scripts.fetch_released_models DIR`` fetches the same files
from their sources at the recorded commits. :func:`write_checkpoint` writes a directory such as a hub
checkpoint holds: ``config.json`` with the family's ``auto_map`` and ``architectures``, the modeling files
copied from that folder, and tiny random weights in ``model.safetensors``. :func:`load` loads it the way a
user does.

Nothing here changes a released file: what a file needs under the installed transformers is supplied by
the library at run time (:mod:`daca_kernels.models.model_loading`).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[2]
FETCH_SCRIPT = "python -m scripts.fetch_released_models ../shared/released-models"


def released_root() -> Path:
    """The folder holding one sub-folder per released family."""
    return Path(os.environ.get("DACA_RELEASED_MODELS", REPO.parent / "shared" / "released-models"))


def require(folder: str) -> Path:
    """``released_root() / folder``, or skip the test with a reason naming the fetch script."""
    path = released_root() / folder
    if not path.is_dir():
        pytest.skip(f"the released modeling code of {folder!r} is not at {path}: fetch it with `{FETCH_SCRIPT}` "
                    "(or set DACA_RELEASED_MODELS)")
    return path


@dataclass(frozen=True)
class Released:
    """One folder of released code: its files, how a hub checkpoint names them, and a tiny config.

    Attributes:
        folder: the folder name under :func:`released_root`.
        files: the files a checkpoint directory holds (modeling, configuration, generation utilities).
        auto_map: the checkpoint's ``auto_map`` (as the hub's ``config.json`` has it).
        architectures: the checkpoint's ``architectures``.
        model_type: the configuration class's ``model_type``.
        config: tiny settings (vocabulary 64, hidden 32, 2 layers, 4 heads). ``mask_token_id`` is set for
            every family, also where the released configs have none (LLaDA-MoE, LLaDA2: the library's
            default is the released tokenizers' id 156895, outside a tiny vocabulary); SDAR's
            ``fuse_cross_entropy`` is a field its code reads that only the released ``config.json`` files
            carry.
        mask_id, eos_id, pad_id: special ids of the tiny vocabulary.
        auto_class: the Auto class the family's own scripts load it with.
    """

    folder: str
    files: tuple[str, ...]
    auto_map: dict
    architectures: tuple[str, ...]
    model_type: str
    config: dict = field(repr=False)
    auto_class: str = "AutoModel"
    mask_id: int = 63
    eos_id: int = 62
    pad_id: int = 61

    @property
    def block(self) -> bool:
        return self.folder in ("sdar", "llada2")


def _auto(config: str, model: str, *classes: str) -> dict:
    return {"AutoConfig": config, **{name: model for name in classes}}


VOCAB = 64
_LLADA_CONFIG = dict(
    d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_ratio=2, mlp_hidden_size=64, activation_type="silu",
    block_type="llama", block_group_size=1, alibi=False, rope=True, rope_full_precision=True, rope_theta=10000.0,
    flash_attention=False, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, input_emb_norm=False,
    layer_norm_type="rms", layer_norm_with_affine=True, rms_norm_eps=1e-5, max_sequence_length=128, include_bias=False,
    include_qkv_bias=False, scale_logits=False, vocab_size=VOCAB, embedding_size=VOCAB, weight_tying=False,
    eos_token_id=62, pad_token_id=61, mask_token_id=63, init_device="cpu", init_fn="normal", init_std=0.2,
    use_cache=False,
)
_LLADA_MAP = _auto("configuration_llada.LLaDAConfig", "modeling_llada.LLaDAModelLM", "AutoModel", "AutoModelForCausalLM")
_DREAM_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, rms_norm_eps=1e-6, rope_theta=10000.0,
    mask_token_id=63, pad_token_id=61, bos_token_id=62, eos_token_id=62, tie_word_embeddings=False, use_cache=False,
)
_DREAM_MAP = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}

FAMILIES = {
    "llada": Released("llada", ("modeling_llada.py", "configuration_llada.py"), _LLADA_MAP, ("LLaDAModelLM",), "llada",
                      _LLADA_CONFIG),
    "llada_dllm": Released("llada_dllm", ("modeling_llada.py", "configuration_llada.py"), _LLADA_MAP,
                           ("LLaDAModelLM",), "llada", _LLADA_CONFIG),
    "lladamoe": Released(
        "lladamoe", ("modeling_lladamoe.py", "configuration_lladamoe.py"),
        _auto("configuration_lladamoe.LLaDAMoEConfig", "modeling_lladamoe.LLaDAMoEModelLM", "AutoModel",
              "AutoModelForCausalLM"),
        ("LLaDAMoEModelLM",), "lladamoe",
        dict(vocab_size=VOCAB, hidden_size=32, dense_intermediate_size=64, expert_intermediate_size=16,
             shared_expert_intermediate_size=None, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=128, initializer_range=0.2, rope_theta=50000.0, partial_rotary_factor=1.0,
             num_experts=4, num_experts_per_tok=2, qk_layernorm=True, moe_layer_freq=[1, 1], norm_topk_prob=False,
             pad_token_id=61, eos_token_id=62, mask_token_id=63, use_cache=False, tie_word_embeddings=False),
        auto_class="AutoModelForCausalLM"),
    "dream": Released("dream", ("modeling_dream.py", "configuration_dream.py", "generation_utils.py"), _DREAM_MAP,
                      ("DreamModel",), "Dream", _DREAM_CONFIG),
    "dream_dllm": Released("dream_dllm", ("modeling_dream.py", "configuration_dream.py", "generation_utils.py"),
                           _DREAM_MAP, ("DreamModel",), "Dream", _DREAM_CONFIG),
    "sdar": Released(
        "sdar", ("modeling_sdar.py", "configuration_sdar.py"),
        _auto("configuration_sdar.SDARConfig", "modeling_sdar.SDARForCausalLM", "AutoModel", "AutoModelForCausalLM"),
        ("SDARForCausalLM",), "sdar",
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, initializer_range=0.2, rms_norm_eps=1e-6,
             rope_theta=10000.0, block_size=4, mask_token_id=63, pad_token_id=61, eos_token_id=62,
             tie_word_embeddings=False, use_cache=False, fuse_cross_entropy=False),
        auto_class="AutoModelForCausalLM"),
    "llada2": Released(
        "llada2", ("modeling_llada2_moe.py", "configuration_llada2_moe.py"),
        _auto("configuration_llada2_moe.LLaDA2MoeConfig", "modeling_llada2_moe.LLaDA2MoeModelLM", "AutoModel",
              "AutoModelForCausalLM"),
        ("LLaDA2MoeModelLM",), "llada2_moe",
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, embedding_dropout=0.0, attention_dropout=0.0,
             output_dropout=0.0, max_position_embeddings=128, rope_theta=10000.0, pad_token_id=61, eos_token_id=62,
             num_experts=4, num_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
             moe_intermediate_size=16, first_k_dense_replace=1, partial_rotary_factor=0.5, block_size=4,
             mask_token_id=63, use_cache=False, tie_word_embeddings=False),
        auto_class="AutoModelForCausalLM"),
}


def write_checkpoint(name: str, directory: Path | str, *, seed: int = 0, **overrides) -> Path:
    """Write a hub-style checkpoint of family ``name`` (a key of :data:`FAMILIES`) into ``directory``.

    The config is built by the released configuration class (through ``AutoConfig`` and the ``auto_map``),
    the model by the released modeling class with torch seeded by ``seed``; weights are saved as
    ``model.safetensors``. ``overrides`` replace config settings. Returns the directory.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from daca_kernels.models.model_loading import complete_construction, released_code_support

    spec = FAMILIES[name]
    source = require(spec.folder)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for file in spec.files:
        shutil.copy(source / file, directory / file)
    settings = {**spec.config, **overrides, "model_type": spec.model_type, "auto_map": spec.auto_map,
                "architectures": list(spec.architectures)}
    (directory / "config.json").write_text(json.dumps(settings, indent=1))
    with released_code_support(), complete_construction(), cuda_on_cpu():
        config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
        model_class = _model_class(spec, config)
        torch.manual_seed(seed)
        model = model_class(config)
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    save_file(_untied(state), directory / "model.safetensors", metadata={"format": "pt"})
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.to_json_file(directory / "generation_config.json")
    return directory


class cuda_on_cpu(TorchFunctionMode):
    """Without a CUDA device, tensors a model's constructor asks for on ``"cuda"`` are made on the CPU.

    dllm's patched LLaDA builds its backbone with ``init_device = "cuda"`` written into its constructor,
    so it cannot be built on a CPU otherwise. With CUDA available this mode changes nothing.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.cuda.is_available():
            args = tuple(_cpu_if_cuda(arg) for arg in args)
            kwargs = {key: _cpu_if_cuda(value) if key == "device" else value for key, value in kwargs.items()}
        return func(*args, **kwargs)


def _cpu_if_cuda(value):
    if isinstance(value, (str, torch.device)) and not isinstance(value, bool):
        try:
            if torch.device(value).type == "cuda":
                return torch.device("cpu")
        except (RuntimeError, TypeError):
            return value
    return value


def _model_class(spec: Released, config):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = spec.auto_map[spec.auto_class]
    return get_class_from_dynamic_module(reference, config._name_or_path)


def _untied(state: dict) -> dict:
    """safetensors refuses tensors sharing memory: keep one copy of each storage."""
    seen, out = {}, {}
    for key, value in state.items():
        pointer = (value.data_ptr(), tuple(value.shape))
        if pointer in seen:
            continue
        seen[pointer] = key
        out[key] = value
    return out


def load(directory: Path | str, name: str, *, dtype: torch.dtype = torch.float32):
    """Load the checkpoint with the library's loader (:func:`daca_kernels.models.model_loading.from_pretrained`)
    through the family's Auto class and ``trust_remote_code=True``, in eval mode."""
    import transformers

    from daca_kernels.models.model_loading import from_pretrained

    auto = getattr(transformers, FAMILIES[name].auto_class)
    with cuda_on_cpu():
        return from_pretrained(auto, str(directory), trust_remote_code=True, dtype=dtype).eval()
