"""Test double of LLaDA-MoE (``inclusionAI/LLaDA-MoE-7B-A1B-Instruct`` / ``-Base``, remote code
``modeling_lladamoe.py`` and ``configuration_lladamoe.py``), written for these tests; no released code is
copied. The released files were read in a public mirror (``InfiniTensor/InfiniLM``, ``modeling_lladamoe.py``);
``tests/released/test_doubles_match_released.py`` checks the double against the released file.

Interface facts reproduced:

* ``LLaDAMoEConfig`` (``model_type = "lladamoe"``; an early mirror named it ``LLaDAConfig`` with
  ``model_type = "llada"``, the released ``configuration_lladamoe.py`` does not) with Mixtral/OLMoE-style
  names: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
  ``dense_intermediate_size``, ``expert_intermediate_size``, ``shared_expert_intermediate_size``,
  ``num_experts``, ``num_experts_per_tok``, ``moe_layer_freq`` (per layer, 0 = dense MLP),
  ``moe_router_enable_expert_bias``, ``moe_router_score_function``, ``norm_topk_prob``, ``qk_layernorm``,
  ``rope_theta``, ``rope_scaling``, ``max_position_embeddings``, ``use_cache=False``,
  ``tie_word_embeddings=False``, ``output_router_logits``, ``router_aux_loss_coef``. It sets
  ``self.use_cache`` itself, so the attribute survives transformers 5 (which drops ``use_cache`` from the
  kwargs given to ``PretrainedConfig.__init__``). The mask id (156895 in the Instruct checkpoint's
  tokenizer) is not a config field; the double uses ``vocab_size - 1``.
* ``LLaDAMoEModelLM(LLaDAMoEPreTrainedModel)`` -- *not* a ``GenerationMixin`` and with no
  ``prepare_inputs_for_generation`` -- so ``can_generate()`` is ``False`` and transformers 5 never sets
  ``model.generation_config``: reading it raises ``AttributeError: ... has no attribute
  'generation_config'`` (what TRL's trainers hit). Its docstring says ``model.generate()`` cannot be used.
* ``_tied_weights_keys = ["lm_head.weight"]`` is a *list* (transformers 4 style); transformers 5's
  ``save_pretrained`` calls ``.keys()`` on it and fails with ``AttributeError: 'list' object has no
  attribute 'keys'``. The head is a separate ``lm_head`` ``nn.Linear`` (untied).
* Backbone: ``model.model`` (``LLaDAMoEModel``, a ``PreTrainedModel``) with ``embed_tokens``, ``layers``
  (``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and optional ``q_norm``/``k_norm``;
  ``mlp`` = ``LLaDAMoESparseMoeBlock`` (``gate``, ``experts``) or a dense ``LLaDAMoEMLP``;
  ``shared_expert`` when ``shared_expert_intermediate_size`` is set; ``input_layernorm``,
  ``post_attention_layernorm``), ``norm``, ``rotary_emb``. ``get_decoder()`` returns ``model.model``.
* ``forward`` returns ``MoeCausalLMOutputWithPast`` (``loss``, ``aux_loss``, ``logits``,
  ``past_key_values``, ``hidden_states``, ``attentions``, ``router_logits``) -- no
  ``last_hidden_state``. ``labels`` or ``num_logits_to_keep != 0`` fail an assert ("LLaDAMoE model does
  not support calculate loss in the forward pass.").
* The attention mask is ignored everywhere (set to ``None`` in the model, the layer and the attention;
  full bidirectional attention, ``is_causal=False``), with a warning saying so. Any form is accepted.
* No cache: ``LLaDAMoEModel.forward`` asserts ``not use_cache and past_key_values is None and
  cache_position is None`` ("The cache mechanism is not suppotred for LLaDA MoE by default.").
* Router: softmax over experts, (optional ``expert_bias`` buffer added), top-k, *no* renormalisation
  (``norm_topk_prob`` is hard-coded ``False`` in the block), weighted sum of experts.
* ``supports_gradient_checkpointing = True``; the model calls ``self._gradient_checkpointing_func(
  decoder_layer.__call__, ...)`` when ``gradient_checkpointing and training``.
* Rotary: ``LLaDAMoERotaryEmbedding`` registers ``inv_freq`` as a *non-persistent* buffer computed in
  ``__init__``. ``LLaDAMoEPreTrainedModel._init_weights`` only handles ``nn.Linear``/``nn.Embedding``,
  so under transformers 5 ``from_pretrained`` (meta-device init, then ``torch.empty_like`` for
  non-persistent buffers and ``_init_weights`` for what was not loaded) leaves ``inv_freq``
  uninitialised memory. (The released rotary class takes ``ROPE_INIT_FUNCTIONS[rope_type]`` with
  ``rope_type="default"``; transformers 5.23's table has no ``"default"`` key, so the released class
  would fail at construction there -- the double computes the default frequencies itself.)
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import logging

from families._blocks import GatedMLP, RMSNorm, RotaryEmbedding, rotate_half
from families._lm_head import BackboneAndHeadAccessors

logger = logging.get_logger(__name__)


class LLaDAMoEConfig(PretrainedConfig):
    model_type = "lladamoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=61, hidden_size=32, dense_intermediate_size=64, expert_intermediate_size=16,
                 shared_expert_intermediate_size=None, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=None, hidden_act="silu", max_position_embeddings=128,
                 initializer_range=0.02, rms_norm_eps=1e-5, use_cache=False, pad_token_id=1, bos_token_id=None,
                 eos_token_id=58, tie_word_embeddings=False, rope_theta=50000.0, partial_rotary_factor=-1,
                 rope_scaling=None, attention_bias=False, attention_dropout=0.0, clip_qkv=None,
                 num_experts_per_tok=2, num_experts=4, output_router_logits=False, router_aux_loss_coef=0.01,
                 norm_topk_prob=None, qk_layernorm=True, moe_layer_freq=None,
                 moe_router_enable_expert_bias=None, moe_router_score_function=None, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.dense_intermediate_size = dense_intermediate_size
        self.expert_intermediate_size = expert_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act, self.initializer_range, self.rms_norm_eps = hidden_act, initializer_range, rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta, self.rope_scaling, self.partial_rotary_factor = rope_theta, rope_scaling, partial_rotary_factor
        self.attention_bias, self.attention_dropout, self.clip_qkv = attention_bias, attention_dropout, clip_qkv
        self.num_experts_per_tok, self.num_experts = num_experts_per_tok, num_experts
        self.output_router_logits, self.router_aux_loss_coef = output_router_logits, router_aux_loss_coef
        self.norm_topk_prob, self.qk_layernorm = norm_topk_prob, qk_layernorm
        self.moe_layer_freq = [1] * num_hidden_layers if moe_layer_freq is None else moe_layer_freq
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.moe_router_score_function = moe_router_score_function
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class LLaDAMoERMSNorm(RMSNorm):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__(hidden_size, eps)


class LLaDAMoERotaryEmbedding(RotaryEmbedding):
    @staticmethod
    def rotary_dim(config):
        return config.hidden_size // config.num_attention_heads


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LLaDAMoEMLP(GatedMLP):
    def __init__(self, config, mlp_type):
        size = {"dense": config.dense_intermediate_size, "expert": config.expert_intermediate_size,
                "shared_expert": config.shared_expert_intermediate_size}[mlp_type]
        super().__init__(config.hidden_size, size)


class LLaDAMoESdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.is_causal = False
        b = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=b)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=b)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=b)
        if config.qk_layernorm:
            self.q_norm = LLaDAMoERMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LLaDAMoERMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        B, L, _ = hidden_states.shape
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(B, L, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(B, L, -1)
        q = q.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, *position_embeddings)
        # For the diffusion LM the mask is dropped: full attention.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False,
                                             dropout_p=self.config.attention_dropout if self.training else 0.0,
                                             enable_gqa=self.num_heads != self.num_key_value_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1)), None, None


class LLaDAMoESparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = config.num_experts, config.num_experts_per_tok, False
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([LLaDAMoEMLP(config, "expert") for _ in range(self.num_experts)])
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        else:
            self.expert_bias = None

    def forward(self, hidden_states):
        B, L, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        if self.expert_bias is not None:
            weights = weights + self.expert_bias
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out.view(B, L, H)


class LLaDAMoEDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.mlp_type = "dense" if config.moe_layer_freq[layer_idx] == 0 else "moe"
        self.self_attn = LLaDAMoESdpaAttention(config, layer_idx)
        self.mlp = LLaDAMoESparseMoeBlock(config) if self.mlp_type == "moe" else LLaDAMoEMLP(config, "dense")
        self.input_layernorm = LLaDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LLaDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.shared_expert_intermediate_size is not None and self.mlp_type == "moe":
            self.shared_expert = LLaDAMoEMLP(config, "shared_expert")

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, output_router_logits=False, use_cache=False, cache_position=None,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        h, _, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask=None,
                                 position_embeddings=position_embeddings)
        hidden_states = residual + h
        h = self.post_attention_layernorm(hidden_states)
        out = self.mlp(h)
        if hasattr(self, "shared_expert"):
            out = out + self.shared_expert(h)
        return (hidden_states + out,)


class LLaDAMoEPreTrainedModel(PreTrainedModel):
    config_class = LLaDAMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDAMoEDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()


class LLaDAMoEModel(LLaDAMoEPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LLaDAMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LLaDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LLaDAMoERotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                output_router_logits=None, return_dict=None, cache_position=None):
        assert (not use_cache and past_key_values is None and cache_position is None), \
            "The cache mechanism is not suppotred for LLaDA MoE by default."
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time, "
                             "and must specify either one")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        logger.warning_once("LLaDA MoE employs a bidirectional attention mechanism; the attention_mask passed "
                            "to forward is ignored.")
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden = () if output_hidden_states else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            if self.gradient_checkpointing and self.training:
                hidden_states = self._gradient_checkpointing_func(
                    layer.__call__, hidden_states, None, position_ids, None, False, False, False, None,
                    position_embeddings)[0]
            else:
                hidden_states = layer(hidden_states, position_embeddings=position_embeddings)[0]
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden += (hidden_states,)
        if not return_dict:
            return tuple(v for v in (hidden_states, None, all_hidden) if v is not None)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=None,
                                      hidden_states=all_hidden, attentions=None, router_logits=None)


class LLaDAMoEModelLM(BackboneAndHeadAccessors, LLaDAMoEPreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = LLaDAMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts, self.num_experts_per_tok = config.num_experts, config.num_experts_per_tok
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, output_router_logits=None, return_dict=None, cache_position=None,
                num_logits_to_keep=0):
        assert (labels is None and num_logits_to_keep == 0), \
            "LLaDAMoE model does not support calculate loss in the forward pass."
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, return_dict=return_dict,
                             cache_position=cache_position)
        logits = self.lm_head(outputs[0][:, -num_logits_to_keep:, :])
        if not return_dict:
            return (logits,) + tuple(outputs[1:])
        return MoeCausalLMOutputWithPast(loss=None, aux_loss=None, logits=logits, past_key_values=None,
                                         hidden_states=outputs.hidden_states, attentions=None, router_logits=None)


MASK_ID = 60
VOCAB = 61


def tiny(seed=0, **overrides):
    """A randomly initialised ``LLaDAMoEModelLM`` in eval mode (vocab 61, 4 experts top-2, hidden 32)."""
    torch.manual_seed(seed)
    config = LLaDAMoEConfig(**{"initializer_range": 0.2, **overrides})
    return LLaDAMoEModelLM(config).eval()
