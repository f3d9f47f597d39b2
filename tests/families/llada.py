"""Test double of LLaDA-8B (``GSAI-ML/LLaDA-8B-Instruct`` / ``-Base``, remote code ``modeling_llada.py``
and ``configuration_llada.py``), written for these tests; no released code is copied.

Interface facts reproduced (all read in the released ``modeling_llada.py`` / ``configuration_llada.py``):

* ``LLaDAConfig`` (``model_type = "llada"``) takes OLMo-style field names, defaults merged from a
  ``ModelConfig`` dataclass: ``d_model``, ``n_heads``, ``n_kv_heads``, ``n_layers``, ``mlp_hidden_size``,
  ``mlp_ratio``, ``activation_type``, ``block_type`` (``"llama"`` in the checkpoints),
  ``block_group_size``, ``rope``, ``rope_theta``, ``rope_full_precision``, ``weight_tying``
  (``False`` in the 8B checkpoints), ``vocab_size``, ``embedding_size``, ``max_sequence_length``,
  ``layer_norm_type``, ``rms_norm_eps``, ``include_bias``, ``include_qkv_bias``, ``init_device``,
  ``mask_token_id`` (126336 in the checkpoints; here ``vocab_size - 1``), ``eos_token_id``,
  ``pad_token_id``; ``use_cache`` defaults to ``False``; read-only properties ``hidden_size``,
  ``num_attention_heads``, ``num_hidden_layers``; ``architectures`` defaults to ``["LLaDAModelLM"]``.
* ``LLaDAModelLM(PreTrainedModel)`` ("Extremely barebones HF model wrapper"): ``base_model_prefix =
  "model"``, ``self.model`` is a plain ``nn.Module`` ``LLaDAModel`` (so ``base_model`` is not a
  ``PreTrainedModel``); no ``get_decoder`` override; ``__init__`` never calls ``post_init()`` and builds
  the backbone with ``init_params=False`` (weights keep torch's default layer init).
* Backbone names: ``model.model.transformer`` is an ``nn.ModuleDict`` with ``wte`` (embedding),
  ``emb_drop``, ``ln_f`` and ``blocks`` (``block_group_size == 1``), plus ``ff_out`` (the LM head,
  ``nn.Linear``) only when ``weight_tying`` is false; with ``weight_tying`` the logits are
  ``F.linear(x, wte.weight)``. Llama blocks: ``attn_norm``, ``q_proj``, ``k_proj``, ``v_proj``,
  ``attn_out``, ``ff_norm``, ``ff_proj``, ``up_proj``, ``ff_out``, ``rotary_emb``.
* ``get_output_embeddings()`` returns ``transformer.ff_out`` (untied) or ``transformer.wte`` (tied);
  ``get_input_embeddings()`` returns ``transformer.wte``; ``tie_weights(self)`` takes no arguments.
* ``forward(input_ids, inputs_embeds, attention_mask, attention_bias, past_key_values, labels,
  use_cache, output_attentions, output_hidden_states, return_dict, cache_position)`` returns
  ``transformers.modeling_outputs.CausalLMOutputWithPast(logits=..., past_key_values=...,
  hidden_states=...)`` -- there is no ``last_hidden_state``; ``hidden_states`` is ``None`` unless
  ``output_hidden_states=True`` (then one entry per block input plus the final ``ln_f`` output).
  ``output_attentions=True`` raises ``ValueError``; ``labels`` only warns (no loss computed).
  ``return_dict=False`` returns ``(logits, attn_key_values, hidden_states)``.
* Attention is bidirectional (``is_causal=False`` in SDPA) and ignores every mask: ``attention_mask``
  (if it contains a 0, turned into an additive ``(B, 1, 1, L)`` bias) and
  ``attention_bias`` are formed into a bias of shape checks and all, but both attention calls pass
  ``attn_mask=None`` to SDPA, so padding is attended (ML-GSAI/LLaDA issues #89 and #90 quote the hub code).
  dllm's later patch of the file honours the mask; the double follows the hub. A 4-D mask given as
  ``attention_mask`` fails in its ``view(batch_size, -1)`` / bias addition with a ``RuntimeError``.
  ``tests/released/test_doubles_match_released.py`` checks the double against the released file.
* No KV cache: ``LLaDAModel.forward`` asserts ``past_key_values is None and not use_cache`` ("The kvcache
  is not suppotred for MDM."), so ``use_cache=True`` (or ``config.use_cache=True``) fails.
* Rotary tables are not buffers: ``RotaryEmbedding`` keeps sin/cos in a shared ``BufferCache`` dict,
  computed in ``__init__`` on a real device (cpu or cuda, never meta) and extended on demand, so they
  survive ``from_pretrained`` with meta-device init.
* ``supports_gradient_checkpointing`` is not set (``PreTrainedModel``'s ``False``), so
  ``gradient_checkpointing_enable()`` raises ``ValueError``; the released backbone has its own
  ``set_activation_checkpointing(strategy)`` instead (not reproduced).
* ``can_generate(self)`` is overridden as an *instance* method returning ``True``, so transformers gives the
  model a ``generation_config``; ``prepare_inputs_for_generation`` exists but the model cannot generate
  with ``generate()`` (sampling lives in the repo's separate ``generate.py``).
* Under transformers 5 (observed with 5.23): ``PretrainedConfig.__init__`` drops generation keys such as
  ``use_cache`` from its kwargs, and the released config passes ``use_cache`` that way, so the config has no
  ``use_cache`` and ``model(input_ids)`` raises ``AttributeError: ... no attribute 'use_cache'`` unless
  ``use_cache=False`` is passed; and because ``__init__`` skips ``post_init()``, ``save_pretrained`` works but
  ``from_pretrained`` raises ``AttributeError: ... no attribute 'all_tied_weights_keys'``.
* The released module ends with ``AutoModel.register(LLaDAConfig, LLaDAModelLM)`` and the config module
  with ``AutoConfig.register("llada", LLaDAConfig)``; the double does not register (global side effect).
"""
import math
import warnings
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

_DEFAULTS = dict(
    d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, mlp_ratio=2, mlp_hidden_size=64,
    activation_type="silu", block_type="llama", block_group_size=1, alibi=False, rope=True,
    rope_full_precision=True, rope_theta=10000.0, flash_attention=False, attention_dropout=0.0,
    residual_dropout=0.0, embedding_dropout=0.0, input_emb_norm=False, layer_norm_type="rms",
    layer_norm_with_affine=True, rms_norm_eps=1e-5, max_sequence_length=128, include_bias=False,
    include_qkv_bias=False, scale_logits=False, vocab_size=61, embedding_size=61, weight_tying=False,
    eos_token_id=58, pad_token_id=58, mask_token_id=60, init_device=None, init_fn="mitchell", init_std=0.02,
)


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, use_cache: bool = False, **kwargs):
        all_kwargs = dict(_DEFAULTS)
        all_kwargs.update(kwargs)
        all_kwargs["use_cache"] = use_cache
        all_kwargs.setdefault("architectures", ["LLaDAModelLM"])
        super().__init__(**all_kwargs)

    @property
    def num_attention_heads(self):
        return self.n_heads

    @property
    def num_hidden_layers(self):
        return self.n_layers

    @property
    def hidden_size(self):
        return self.d_model


class LLaDAOutput(NamedTuple):
    logits: torch.FloatTensor
    attn_key_values: Optional[list]
    hidden_states: Optional[tuple]


class RMSLayerNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.weight = nn.Parameter(torch.ones(config.d_model))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _real_device(config):
    if config.init_device is not None and config.init_device != "meta":
        return torch.device(config.init_device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class RotaryEmbedding(nn.Module):
    """Sin/cos tables kept in a dict shared by the blocks (``cache``), not in buffers."""

    def __init__(self, config, cache: dict):
        super().__init__()
        self.config = config
        self._cache = cache
        self.get_rotary_embedding(config.max_sequence_length, _real_device(config))

    def get_rotary_embedding(self, seq_len, device):
        sin, cos = self._cache.get("rope_pos_sin"), self._cache.get("rope_pos_cos")
        if sin is None or sin.shape[-2] < seq_len:
            dim = self.config.d_model // self.config.n_heads
            inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
            freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float), inv)
            pos = torch.cat((freqs, freqs), dim=-1)
            sin, cos = pos.sin()[None, None], pos.cos()[None, None]
            self._cache["rope_pos_sin"], self._cache["rope_pos_cos"] = sin, cos
        return sin[:, :, :seq_len].to(device), cos[:, :, :seq_len].to(device)

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k):
        q_, k_ = q.float(), k.float()
        q_len, k_len = q_.shape[-2], k_.shape[-2]
        sin, cos = self.get_rotary_embedding(k_len, q_.device)
        qs, qc = sin[:, :, k_len - q_len:k_len], cos[:, :, k_len - q_len:k_len]
        q_ = q_ * qc + self._rotate_half(q_) * qs
        k_ = k_ * cos + self._rotate_half(k_) * sin
        return q_.type_as(q), k_.type_as(k)


class LLaDALlamaBlock(nn.Module):
    def __init__(self, layer_id, config, cache):
        super().__init__()
        self.layer_id, self.config = layer_id, config
        d, hd = config.d_model, config.d_model // config.n_heads
        hidden = config.mlp_hidden_size or config.mlp_ratio * d
        qkv_bias = config.include_bias | config.include_qkv_bias
        self.attn_norm = RMSLayerNorm(config)
        self.ff_norm = RMSLayerNorm(config)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, config.n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, config.n_kv_heads * hd, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.up_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.ff_out = nn.Linear(hidden, d, bias=config.include_bias)
        self.rotary_emb = RotaryEmbedding(config, cache)

    def attention(self, q, k, v, attention_bias):
        B, T, C = q.shape
        nh, nkv = self.config.n_heads, self.config.n_kv_heads
        q = q.view(B, T, nh, C // nh).transpose(1, 2)
        k = k.view(B, T, nkv, C // nh).transpose(1, 2)
        v = v.view(B, T, nkv, C // nh).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        if nh != nkv:
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        if attention_bias is not None:
            attention_bias = attention_bias[:, :, :T, :T].to(q.dtype)
        # The released code forms the bias and then passes no mask to SDPA: padding is attended.
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)
        return self.attn_out(att.transpose(1, 2).reshape(B, T, C))

    def forward(self, x, attention_bias=None):
        h = self.attn_norm(x)
        x = x + self.attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), attention_bias)
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    def __init__(self, config, init_params: bool = True):
        super().__init__()
        self.config = config
        self._cache = {}
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.embedding_size or config.vocab_size, config.d_model),
            emb_drop=nn.Dropout(config.embedding_dropout),
            ln_f=RMSLayerNorm(config),
        ))
        self.transformer.update({"blocks": nn.ModuleList(
            [LLaDALlamaBlock(i, config, self._cache) for i in range(config.n_layers)])})
        if not config.weight_tying:
            self.transformer.update({"ff_out": nn.Linear(
                config.d_model, config.embedding_size or config.vocab_size, bias=config.include_bias)})

    def forward(self, input_ids, input_embeddings=None, attention_mask=None, attention_bias=None,
                past_key_values=None, use_cache=False, last_logits_only=False, output_hidden_states=None):
        assert self.config.rope, "Rope must be used in Llama-Encoder for MDM."
        assert (past_key_values is None and not use_cache), "The kvcache is not suppotred for MDM."
        B, L = input_ids.shape if input_embeddings is None else input_embeddings.shape[:2]
        x = self.transformer.wte(input_ids) if input_embeddings is None else input_embeddings
        x = self.transformer.emb_drop(x)
        if attention_mask is not None and 0.0 in attention_mask:
            attention_mask = attention_mask.to(torch.float).view(B, -1)[:, None, None, :]
            attention_mask = (1.0 - attention_mask) * torch.finfo(attention_mask.dtype).min
        else:
            attention_mask = None
        if attention_bias is not None or attention_mask is not None:
            if attention_bias is None:
                attention_bias = torch.zeros(1, 1, L, L, device=x.device)
            elif attention_bias.dtype in (torch.int8, torch.bool):
                attention_bias = attention_bias.to(torch.float)
                attention_bias.masked_fill_(attention_bias == 0.0, torch.finfo(attention_bias.dtype).min)
            attention_bias = attention_bias.to(torch.float)
            if attention_mask is not None:
                attention_bias = attention_bias + attention_mask
                attention_bias.masked_fill_(attention_bias == float("-inf"), torch.finfo(attention_bias.dtype).min)
        hidden = []
        for block in self.transformer.blocks:
            if output_hidden_states:
                hidden.append(x)
            x = block(x, attention_bias=attention_bias)
        if last_logits_only:
            x = x[:, -1:, :]
        x = self.transformer.ln_f(x)
        if output_hidden_states:
            hidden.append(x)
        if self.config.weight_tying:
            logits = F.linear(x, self.transformer.wte.weight, None)
        else:
            logits = self.transformer.ff_out(x)
        if self.config.scale_logits:
            logits.mul_(1 / math.sqrt(self.config.d_model))
        return LLaDAOutput(logits=logits, attn_key_values=None,
                           hidden_states=tuple(hidden) if output_hidden_states else None)


class LLaDAModelLM(PreTrainedModel):
    """Extremely barebones HF model wrapper (as the released class calls itself)."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock", "LLaDASequentialBlock", "LLaDALlamaBlock"]

    def __init__(self, config, model=None, init_params=False):
        super().__init__(config)
        if not model:
            # the released code copies the fields into its plain ``ModelConfig`` dataclass
            model_config = SimpleNamespace(**config.to_dict())
            model_config.init_device = "cpu"
            self.model = LLaDAModel(model_config, init_params=init_params)
        else:
            self.model = model

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, attention_bias=None,
                past_key_values=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None):
        if use_cache is None:
            use_cache = self.config.use_cache
        if output_attentions:
            raise ValueError("output_attentions is not yet supported in LLaDA")
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        outputs = self.model.forward(
            input_ids=input_ids, input_embeddings=inputs_embeds, attention_mask=attention_mask,
            attention_bias=attention_bias, past_key_values=past_key_values, use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        if labels is not None:
            warnings.warn("Note that for LLaDA, you cannot calculate the loss here.", UserWarning)
        if not return_dict:
            return (outputs.logits,) + outputs[1:]
        return CausalLMOutputWithPast(logits=outputs.logits, past_key_values=outputs.attn_key_values,
                                      hidden_states=outputs.hidden_states)

    def can_generate(self) -> bool:
        return True

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs):
        if past_key_values:
            input_ids = input_ids[:, -1:]
        model_inputs = {"input_ids": input_ids, "past_key_values": past_key_values}
        model_inputs.update(kwargs)
        model_inputs["use_cache"] = kwargs.pop("use_cache", self.config.use_cache)
        return model_inputs

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def set_input_embeddings(self, value):
        self.model.transformer.wte = value

    def get_output_embeddings(self):
        if self.config.weight_tying:
            return self.model.transformer.wte
        return self.model.transformer.ff_out

    def set_output_embeddings(self, value):
        if self.config.weight_tying:
            self.model.transformer.wte = value
        else:
            self.model.transformer.ff_out = value

    def tie_weights(self):
        if self.config.weight_tying:
            self.model.transformer.ff_out = self.model.transformer.wte


MASK_ID = _DEFAULTS["mask_token_id"]
VOCAB = _DEFAULTS["vocab_size"]


def tiny(seed=0, **overrides):
    """A randomly initialised ``LLaDAModelLM`` in eval mode (vocab 61, mask id 60, hidden 32, 2 blocks)."""
    torch.manual_seed(seed)
    return LLaDAModelLM(LLaDAConfig(**overrides)).eval()
