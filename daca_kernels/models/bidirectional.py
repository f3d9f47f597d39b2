"""A small bidirectional transformer, the same on every transformers version the library supports.

Tests, examples and the reference loop need a model that looks ahead. A transformers decoder built
with ``LlamaConfig(is_causal=False)`` does so only from transformers 5.2: earlier versions ignore the
flag and build a causal model, which [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] refuses.
[`BidirectionalLM`][daca_kernels.models.bidirectional.BidirectionalLM] is a
Llama-style decoder stack without the causal mask (RMSNorm, rotary positions, grouped-query
attention through ``scaled_dot_product_attention``, a SwiGLU MLP) written as a transformers
``PreTrainedModel``, so ``MaskedLM.from_hf``, ``save_pretrained`` / ``from_pretrained`` and the TRL
trainer treat it as any other transformers model. Its parameters carry the names and shapes of
``LlamaForCausalLM``'s (without biases). It is meant for tests and small experiments, not for
loading released checkpoints.

``attention_mask`` is a 2-D ``[B, L]`` key-padding mask (1 = real token); every query also sees its
own position, so a row made only of padding never turns into NaN.

Example::

    from daca_kernels.models.bidirectional import BidirectionalConfig, BidirectionalLM
    model = BidirectionalLM(BidirectionalConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2))
    lm = MaskedLM.from_hf(model, mask_id=99)

Importing this module needs transformers (the ``hf`` extra).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from daca_kernels._optional import require

transformers = require("transformers", "hf", "daca_kernels.models.bidirectional")
from transformers import PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput  # noqa: E402

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


class BidirectionalConfig(PretrainedConfig):
    """Sizes of a [`BidirectionalLM`][daca_kernels.models.bidirectional.BidirectionalLM] (the names and defaults of ``LlamaConfig``
    where they exist).

    ``head_dim`` None is ``hidden_size // num_attention_heads``; ``num_key_value_heads`` None is
    ``num_attention_heads``; ``mask_token_id`` is read by [`MaskedLM.from_hf`][daca_kernels.models.masked_lm.MaskedLM.from_hf] when given.
    """

    model_type = "daca_bidirectional"
    auto_map = {}  # read by TRL when it loads a model by path (none: the class is registered with the Auto classes)

    def __init__(self, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                 num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, max_position_embeddings: int = 256, rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-6, initializer_range: float = 0.02, tie_word_embeddings: bool = False,
                 mask_token_id: int | None = None, pad_token_id: int | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        # Read by code that asks whether a decoder is bidirectional (the prefix KV cache's protocol).
        self.is_causal = False
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x [B, heads, L, d]`` (the half-split convention of Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, config: BidirectionalConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keep: Tensor | None, cache=None) -> Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:  # a transformers Cache: the keys and values to attend (kept ones first)
            k, v = cache.update(k, v, self.layer_idx)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, config: BidirectionalConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: BidirectionalConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config, layer_idx)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keep: Tensor | None, cache=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keep, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class BidirectionalPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the config class shared by the backbone and the LM."""

    config_class = BidirectionalConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["_Layer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, _RMSNorm):
            module.weight.fill_(1.0)


class BidirectionalModel(BidirectionalPreTrainedModel):
    """The backbone: embeddings, the layers, the final norm; returns ``last_hidden_state``.

    ``gradient_checkpointing`` (set by transformers' ``gradient_checkpointing_enable``, with the
    checkpoint function) recomputes each layer in the backward while training."""

    gradient_checkpointing = False

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def _rotary(self, position_ids: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        angles = position_ids.to(device=device, dtype=torch.float32)[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, L, d]
        return angles.cos(), angles.sin()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                past_key_values=None, use_cache: bool | None = None, **kwargs) -> BaseModelOutput:
        """``attention_mask``: a 2-D ``[B, L]`` key-padding mask (1 = attend), a 4-D bool ``[B, 1, L, K]``
        mask (True = attend; ``K`` counts the cached keys first), or None. ``past_key_values``: a
        transformers ``Cache`` whose ``update`` returns the keys and values each layer attends (used
        only when ``use_cache``; never while training with checkpointing)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, length = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(length, device=x.device).expand(batch, length)
        cos, sin = self._rotary(position_ids, x.device)
        cache = past_key_values if use_cache else None
        keep = None
        if attention_mask is not None and attention_mask.dim() == 4:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"a 4-D attention_mask must be bool (True = attend), got {attention_mask.dtype}")
            keep = attention_mask
        elif attention_mask is not None:
            if attention_mask.dim() != 2 or cache is not None:
                raise ValueError("attention_mask must be a 2-D [B, L] key-padding mask (without a cache) or a 4-D bool "
                                 f"[B, 1, L, K] mask, got {attention_mask.dim()}-D")
            own = torch.eye(length, dtype=torch.bool, device=x.device)
            keep = (attention_mask.bool()[:, None, None, :] | own)  # [B, 1, L, L]
        states = [x] if output_hidden_states else None
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            x = self._gradient_checkpointing_func(layer.__call__, x, cos, sin, keep) if checkpointed else \
                layer(x, cos, sin, keep, cache)
            if states is not None:
                states.append(x)
        x = self.norm(x)
        if states is not None:
            states[-1] = x
        return BaseModelOutput(last_hidden_state=x, hidden_states=None if states is None else tuple(states))


class BidirectionalLM(BidirectionalPreTrainedModel):
    """The backbone (``model``) and an LM head (``lm_head``, tied to the input embeddings when
    ``config.tie_word_embeddings``); ``forward`` returns ``logits [B, L, V]`` (and the mean
    cross-entropy over ``labels`` other than -100 when given)."""

    # transformers 5 maps each tied parameter to its source; transformers 4 lists the tied names.
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"} if _TRANSFORMERS_MAJOR >= 5 else ["lm_head.weight"]

    def __init__(self, config: BidirectionalConfig):
        super().__init__(config)
        self.model = BidirectionalModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None, labels: Tensor | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs) -> MaskedLMOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


# Registered with the Auto classes, so that a saved model loads by path (``AutoModelForCausalLM.from_pretrained``,
# the TRL trainer given a directory) once this module is imported.
transformers.AutoConfig.register(BidirectionalConfig.model_type, BidirectionalConfig, exist_ok=True)
transformers.AutoModel.register(BidirectionalConfig, BidirectionalModel, exist_ok=True)
transformers.AutoModelForCausalLM.register(BidirectionalConfig, BidirectionalLM, exist_ok=True)
transformers.AutoModelForMaskedLM.register(BidirectionalConfig, BidirectionalLM, exist_ok=True)
