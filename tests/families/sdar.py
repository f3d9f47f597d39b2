"""Test double of SDAR (``JetAstra/SDAR-1.7B-Chat``, ``-4B-Chat`` ...) and TraDo (``Gen-Verse/TraDo-4B-Instruct``,
``-8B-Instruct``, trained from SDAR with the same ``modeling_sdar.py`` / ``configuration_sdar.py``), written for
these tests; no released code is copied. Read in ``JetAstra/SDAR`` (``training/model/SDAR-4B-Chat/modeling_sdar.py``,
``generate.py``) and in a TraDo (``dLLM-RL``) copy of ``models/sdar/modeling_sdar.py`` that quotes the released
inference attention.

Interface facts reproduced:

* ``SDARConfig`` (``model_type = "sdar"``) is Qwen3's (``head_dim``, ``rope_theta``, ``use_cache=True``,
  ``tie_word_embeddings=False`` ...). The block size and mask id are not constructor arguments: the modeling
  code reads ``config.block_size``, ``config.mask_token_id`` and ``config.fuse_cross_entropy`` (extra
  ``config.json`` keys); the released decoding script instead takes ``block_length`` and ``mask_id``
  arguments (``mask_id`` from the tokenizer's mask token, 151669 for SDAR).
* ``SDARForCausalLM(SDARPreTrainedModel, GenerationMixin)``; ``_tied_weights_keys = ["lm_head.weight"]`` (a
  list: transformers 5's ``save_pretrained`` fails with ``'list' object has no attribute 'keys'``); backbone
  ``model.model`` (``SDARModel``: ``embed_tokens``, ``layers`` (``self_attn`` with ``q_proj``/``k_proj``/
  ``v_proj``/``o_proj`` and per-head ``q_norm``/``k_norm``; ``mlp``; ``input_layernorm``;
  ``post_attention_layernorm``), ``norm``, ``rotary_emb``); ``lm_head``; ``get_decoder()`` returns
  ``model.model``; ``supports_gradient_checkpointing = True`` (``SDARDecoderLayer`` is a
  ``GradientCheckpointingLayer``).
* ``forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache,
  output_attentions, output_hidden_states, cache_position, logits_to_keep=0, **kwargs)`` with ``store_kv``
  passed through ``kwargs``; returns ``CausalLMOutputWithPast(loss, logits, past_key_values, hidden_states,
  attentions)``; logits are *not* shifted (position i predicts token i). ``logits`` is ``None`` when
  ``config.fuse_cross_entropy`` and ``self.training``. ``labels`` give a plain (unshifted) cross-entropy.
* The model builds no mask itself. In the copy ``Gen-Verse/dLLM-RL`` loads (``models/sdar/modeling_sdar.py``,
  the released file these tests check the double against, ``tests/released/test_block_doubles.py``) the
  caller's mask becomes an additive SDPA mask: ``None`` -> no mask (full attention); a 2-D ``(B, L)`` mask ->
  a key-padding mask (``[B, 1, 1, L]``, 0 = hidden); a 4-D mask (bool, or 0/1 float) -> used as is, cut to the
  keys. (``JetAstra/SDAR``'s hub copy instead decides on ``torch.all(attention_mask)`` between
  ``flash_attn_func(causal=False)`` and SDPA with the bool mask, so ``None`` raises there; the double follows
  the dLLM-RL copy, and also takes ``generate.py``'s ``(1, L, L)`` mask, which SDPA broadcasts.)
  Block-causal attention comes from the mask the caller passes:
  ``block_diffusion_attention_mask`` below builds it exactly as ``generate.py`` does -- ``(1, L, L)``
  float 0/1, position ``q`` sees key ``k`` iff ``k // block_length <= q // block_length`` (blocks counted
  from position 0 of the whole sequence, prompt included).
* KV cache: ``past_key_values`` (a ``DynamicCache``, made by the model when ``use_cache`` and none is given),
  ``store_kv=True`` appends this call's keys/values (``cache.update``), ``store_kv=False`` reads the cache and
  prepends it *without* storing (``past_key_value[layer_idx]``). transformers 5.23's ``DynamicCache`` is not
  subscriptable, so that read raises ``TypeError: 'DynamicCache' object is not subscriptable`` once the cache
  holds a layer; a cache class with ``__getitem__(layer) -> (keys, values)`` (see ``SubscriptableCache``)
  avoids it. Position ids are ``cache_position`` (cache length onward) unless given.
* Rotary: ``SDARRotaryEmbedding`` registers ``inv_freq`` non-persistent; ``SDARPreTrainedModel._init_weights``
  handles ``nn.Linear``, ``nn.Embedding`` and ``SDARRMSNorm`` only, so under transformers 5 ``from_pretrained``
  leaves ``inv_freq`` uninitialised.
* Not reproduced: the GitHub training copy replaces ``forward`` in training mode by a concatenated
  noisy/clean sequence with a flex-attention mask and a fused diffusion loss (``logits=None``); whether the
  hub files contain it could not be checked.

Released decoding rule -- ``block_diffusion_generate(model, prompt, mask_id, gen_length=128, block_length=8,
denoising_steps=8, temperature=1.0, top_k=0, top_p=1.0, remasking_strategy='low_confidence_dynamic',
confidence_threshold=0.85, stopping_criteria_idx=None)`` in ``generate.py`` (batch of prompts given as
``prompt['input_ids']``, no padding handling): ``num_blocks = ceil((prompt_len + gen_length) /
block_length)``; ``x`` = prompt then mask ids up to ``num_blocks * block_length``; position ids
``arange(total)``; a fresh ``DynamicCache``. Prefill: the ``prompt_len // block_length`` whole prompt blocks
run once with ``use_cache=True, store_kv=True`` and the block-causal mask. Then for each remaining block
(the first may hold the prompt's tail), with the mask rows of that block over all keys up to its end, up to
``denoising_steps + 1`` iterations: if the block has no mask left, run it once more with ``store_kv=True``
(commit) and go to the next block; else run with ``store_kv=False``, sample every position of the block
(``sample_with_temperature_topk_topp``: logits / temperature if != 1, top-k, top-p, softmax,
``multinomial`` -- always sampled, even at temperature 0 in this script -- confidence = the drawn token's
probability) and reveal, among the still-masked positions, ``num_transfer_tokens[step]`` of them
(``get_num_transfer_tokens``: ``block_length // steps`` each, the first ``block_length % steps`` steps one
more): ``sequential`` the leftmost ones, ``low_confidence_static`` the most confident,
``low_confidence_dynamic`` all whose confidence exceeds ``confidence_threshold`` if there are at least
``num_transfer_tokens[step]`` of them, else the most confident ``num_transfer_tokens[step]``. After a block,
stop if any ``stopping_criteria_idx`` token appears after the prompt. Returns the whole ``x``.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from families._blocks import GatedMLP, RMSNorm, RotaryEmbedding, rotate_half
from families._lm_head import BackboneAndHeadAccessors


class SDARConfig(PretrainedConfig):
    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
                 max_position_embeddings=128, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                 tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                 use_sliding_window=False, sliding_window=4096, max_window_layers=28, attention_dropout=0.0,
                 **kwargs):
        self.vocab_size, self.max_position_embeddings = vocab_size, max_position_embeddings
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.use_sliding_window, self.sliding_window = use_sliding_window, sliding_window
        self.max_window_layers = max_window_layers
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim, self.hidden_act = head_dim, hidden_act
        self.initializer_range, self.rms_norm_eps, self.use_cache = initializer_range, rms_norm_eps, use_cache
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.attention_bias, self.attention_dropout = attention_bias, attention_dropout
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class SubscriptableCache(DynamicCache):
    """A ``DynamicCache`` that also answers ``cache[layer] -> (keys, values)``, as the released attention
    reads it (the transformers 4 cache API)."""

    def __getitem__(self, layer_idx):
        layer = self.layers[layer_idx]
        return layer.keys, layer.values


class SDARRMSNorm(RMSNorm):
    pass


class SDARMLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size)


class SDARAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True  # set in the released class, unused: SDPA is called with is_causal=False
        nh, nkv, b = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, nh * self.head_dim, bias=b)
        self.k_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(nh * self.head_dim, config.hidden_size, bias=b)
        self.q_norm = SDARRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = SDARRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        store_kv = kwargs.get("store_kv", False)
        if past_key_value is not None and store_kv:
            k, v = past_key_value.update(k, v, self.layer_idx)
        elif past_key_value is not None and not store_kv and len(past_key_value) > self.layer_idx:
            past_k, past_v = past_key_value[self.layer_idx]  # only read, do not store
            k, v = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
        if attention_mask is not None:
            # A 2-D mask is a key-padding mask; a 4-D one is cut to the keys (a 3-D one, generate.py's, broadcasts).
            mask = attention_mask[:, None, None, :] if attention_mask.dim() == 2 else attention_mask
            attention_mask = (mask[..., :k.shape[-2]] if mask.dim() == 4 else mask).bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False, scale=self.scaling,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out), None


class SDARDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SDARAttention(config, layer_idx)
        self.mlp = SDARMLP(config)
        self.input_layernorm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, store_kv=False, cache_position=None,
                position_embeddings=None, **kwargs):
        h, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                              past_key_value=past_key_value, store_kv=store_kv)
        hidden_states = hidden_states + h
        return (hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)),)


class SDARRotaryEmbedding(RotaryEmbedding):
    pass


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SDARDecoderLayer"]
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
        elif isinstance(module, SDARRMSNorm):
            module.weight.data.fill_(1.0)


class SDARModel(SDARPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = SDARRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, store_kv=None, output_attentions=None,
                output_hidden_states=None, cache_position=None, **kwargs):
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if cache_position is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden = () if output_hidden_states else None
        for layer in self.layers[: self.config.num_hidden_layers]:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            hidden_states = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_value=past_key_values, use_cache=use_cache, store_kv=store_kv,
                                  cache_position=cache_position, position_embeddings=position_embeddings)[0]
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden += (hidden_states,)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                       past_key_values=past_key_values if use_cache else None,
                                       hidden_states=all_hidden, attentions=None)


class SDARForCausalLM(BackboneAndHeadAccessors, SDARPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = SDARModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, cache_position=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, cache_position=cache_position, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, keep, :].contiguous()
        if getattr(self.config, "fuse_cross_entropy", False) and self.training:
            logits = None  # the released code leaves the logits to a fused loss in training
        else:
            logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = nn.CrossEntropyLoss()(logits.view(-1, self.config.vocab_size), labels.view(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=None)


def block_diffusion_attention_mask(total_length, block_length, device=None):
    """The ``(1, L, L)`` float 0/1 block-causal mask ``generate.py`` passes (``L`` a multiple of ``block_length``)."""
    num_blocks = total_length // block_length
    blocks = torch.tril(torch.ones(num_blocks, num_blocks, device=device))
    return blocks.repeat_interleave(block_length, dim=0).repeat_interleave(block_length, dim=1).unsqueeze(0)


def get_num_transfer_tokens(block_length, steps):
    """Tokens revealed per step within a block: ``block_length // steps``, the first remainder steps one more."""
    counts = torch.zeros(steps, dtype=torch.int64) + block_length // steps
    counts[: block_length % steps] += 1
    return counts


MASK_ID, VOCAB, BLOCK_SIZE = 60, 61, 4


def tiny(seed=0, **overrides):
    """A randomly initialised ``SDARForCausalLM`` in eval mode (vocab 61, hidden 32, 2 layers, GQA 4/2 heads),
    with ``config.block_size = 4`` and ``config.mask_token_id = 60``."""
    torch.manual_seed(seed)
    config = SDARConfig(**{"initializer_range": 0.2, "block_size": BLOCK_SIZE, "mask_token_id": MASK_ID,
                           "fuse_cross_entropy": False, "pad_token_id": 59, "eos_token_id": 58, **overrides})
    return SDARForCausalLM(config).eval()
