"""Test double of LLaDA2.0 (``inclusionAI/LLaDA2.0-mini-preview``, ``LLaDA2.0-mini``, ``-flash``; remote code
``modeling_llada2_moe.py`` and ``configuration_llada2_moe.py``), written for these tests; no released code is
copied. Read in public copies of the released files (``sajadn/Megatron-Bridge`` ``modeling_llada2_moe.py``,
and ``configuration_llada2_moe.py`` copies).

Interface facts reproduced:

* ``LLaDA2MoeConfig`` (``model_type = "llada2_moe"``): Bailing-MoE names -- ``hidden_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``use_qkv_bias``, ``use_qk_norm``,
  ``use_bias``, ``partial_rotary_factor`` (0.5: rotary on the first half of each head), ``rope_theta``,
  ``num_experts``, ``num_shared_experts``, ``num_experts_per_tok``, ``n_group``, ``topk_group``,
  ``routed_scaling_factor``, ``moe_intermediate_size``, ``first_k_dense_replace``, ``use_cache=True``
  (set on the instance, so it survives transformers 5), dropouts 0.1 by default (0 in ``tiny``). No block
  size and no mask id in the config: they are ``generate`` arguments (``block_length=32``, ``mask_id=156895``,
  ``eos_id=156892``).
* ``LLaDA2MoeModelLM(LLaDA2MoePreTrainedModel, GenerationMixin)``; ``_tied_weights_keys = ["lm_head.weight"]``
  (a list: transformers 5's ``save_pretrained`` fails with ``'list' object has no attribute 'keys'``);
  backbone ``model.model`` (``LLaDA2MoeModel``) with ``word_embeddings`` (not ``embed_tokens``), ``layers``
  (``attention`` -- not ``self_attn`` -- with a fused ``query_key_value``, ``query_layernorm``,
  ``key_layernorm``, ``dense``; ``mlp`` = dense ``LLaDA2MoeMLP`` for the first ``first_k_dense_replace``
  layers, else ``LLaDA2MoeSparseMoeBlock`` (``gate`` with ``weight`` and an ``expert_bias`` buffer,
  ``experts``, ``shared_experts``); ``input_layernorm``, ``post_attention_layernorm``), ``norm``,
  ``rotary_emb``; ``lm_head``; ``get_decoder()`` returns ``model.model``; ``supports_gradient_checkpointing``.
* ``forward`` returns ``MoeCausalLMOutputWithPast(loss, aux_loss, logits, past_key_values, hidden_states,
  attentions, router_logits)`` with ``logits`` cast to float32; no shift of the logits (position i predicts
  token i), but ``labels`` give the *autoregressive* shifted cross-entropy.
* Attention mask (SDPA path, the default): the model calls transformers'
  ``_prepare_4d_causal_attention_mask_for_sdpa`` (``transformers.modeling_attn_mask_utils``, which
  transformers 5.24 removed, so the released remote code does not import there;
  ``released_attention_mask`` below reproduces its rules and the double runs on both sides). ``None``
  or an all-ones 2-D mask -> no mask -> full bidirectional attention; a 2-D mask with any 0 anywhere in
  the batch -> a *causal* 4-D mask combined with the padding; a 4-D mask -> used as is, as an *additive* float
  mask (0 keep, -inf drop), broadcast over the batch (transformers' SDPA attention function: a ``(1, 1, L, L)``
  mask serves every row; the older release read in ``sajadn/Megatron-Bridge`` checked the size exactly).
  So one padded row flips the whole batch from bidirectional to causal. (With ``attn_implementation="eager"``
  the released model builds a causal mask even for ``None``.) Block-causal attention is what ``generate``
  passes: ``block_diffusion_attention_mask`` below, 0/-inf in bfloat16 -- which SDPA refuses for a float32
  model (``Expected attn_mask dtype to be bool or float or to match query dtype``).
* Cache: ``use_cache`` (default ``config.use_cache=True``) makes the model call
  ``DynamicCache.from_legacy_cache(past_key_values)`` (when it is not a ``Cache``) and
  ``past_key_values.get_usable_length(seq_len)``; transformers 5.23's ``DynamicCache`` has neither, so any
  forward with ``use_cache`` true raises ``AttributeError`` there -- pass ``use_cache=False``. (The released
  ``generate`` does not pass it.) There is no ``store_kv``: the released ``generate`` recomputes the whole
  prefix every step.
* Rotary: ``LLaDA2MoeRotaryEmbedding`` registers ``inv_freq`` non-persistent; ``_init_weights`` handles only
  ``nn.Linear``/``nn.Embedding``, so under transformers 5 ``from_pretrained`` leaves it uninitialised.

Released decoding rule -- ``LLaDA2MoeModelLM.generate(inputs, temperature=0.0, block_length=32, steps=32,
gen_length=2048, top_p=None, top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95, eos_id=156892,
mask_id=156895)`` (batch size 1 only; ``@torch.no_grad``): ``steps = min(steps, gen_length //
minimal_topk)``; ``num_blocks = ceil((prompt_len + gen_length) / block_length)``; ``x`` = prompt then mask
ids; the block-causal additive mask (blocks counted from position 0, prompt included); starting at block
``prompt_len // block_length``, for each block the model runs on ``x[:, :block_end]`` (no cache) with the
mask and ``position_ids`` ``arange``, for at most ``steps`` steps (stop early when the block has no mask
left); per step the block's logits are sampled (``temperature == 0`` and no top-k/top-p: argmax and its
softmax probability; else logits / temperature when != 1, top-k, top-p, ``multinomial``); the number to
reveal is ``get_num_transfer_tokens(block_length, steps)[step]``; confidence is the chosen probability
(``-inf`` where not masked); if at least that many masked positions have confidence > ``threshold`` all of
them are revealed, else the top ``min(count, masked)`` by confidence. With ``eos_early_stop``, an ``eos_id``
just revealed with no mask before it returns ``x[:, :eos_pos + 1]``. After each block, stop if an ``eos_id``
appeared after the prompt. Returns ``x[:, :prompt_len + gen_length]`` cut after the first ``eos_id``
following the prompt (included).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from families._blocks import GatedMLP, RMSNorm, RotaryEmbedding
from families._lm_head import BackboneAndHeadAccessors


class LLaDA2MoeConfig(PretrainedConfig):
    model_type = "llada2_moe"

    def __init__(self, vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", use_qkv_bias=False,
                 use_qk_norm=True, use_bias=True, rms_norm_eps=1e-5, norm_head=False, tie_word_embeddings=False,
                 embedding_dropout=0.1, attention_dropout=0.1, output_dropout=0.1, initializer_range=0.02,
                 max_position_embeddings=128, rope_theta=10000.0, use_cache=True, use_sliding_window=False,
                 sliding_window=4096, max_window_layers=28, rope_scaling=None, pad_token_id=59, num_experts=4,
                 num_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                 moe_intermediate_size=16, first_k_dense_replace=1, head_dim=None, output_router_logits=False,
                 partial_rotary_factor=0.5, **kwargs):
        self.num_hidden_layers, self.vocab_size, self.hidden_size = num_hidden_layers, vocab_size, hidden_size
        self.intermediate_size, self.num_attention_heads = intermediate_size, num_attention_heads
        self.num_key_value_heads, self.hidden_act = num_key_value_heads, hidden_act
        self.use_qkv_bias, self.use_qk_norm, self.use_bias, self.norm_head = use_qkv_bias, use_qk_norm, use_bias, norm_head
        self.rms_norm_eps, self.initializer_range = rms_norm_eps, initializer_range
        self.embedding_dropout, self.attention_dropout, self.output_dropout = embedding_dropout, attention_dropout, output_dropout
        self.max_position_embeddings, self.rope_theta, self.use_cache = max_position_embeddings, rope_theta, use_cache
        self.use_sliding_window, self.sliding_window, self.max_window_layers = use_sliding_window, sliding_window, max_window_layers
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rope_scaling = rope_scaling
        self.num_experts, self.num_shared_experts, self.num_experts_per_tok = num_experts, num_shared_experts, num_experts_per_tok
        self.n_group, self.topk_group, self.moe_intermediate_size = n_group, topk_group, moe_intermediate_size
        self.first_k_dense_replace, self.output_router_logits = first_k_dense_replace, output_router_logits
        self.routed_scaling_factor, self.partial_rotary_factor = routed_scaling_factor, partial_rotary_factor
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)


class LLaDA2MoeRMSNorm(RMSNorm):
    pass


class LLaDA2MoeRotaryEmbedding(RotaryEmbedding):
    @staticmethod
    def rotary_dim(config):
        return int(config.head_dim * config.partial_rotary_factor)


def apply_partial_rotary(x, cos, sin):
    rot, keep = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
    r1, r2 = rot.chunk(2, dim=-1)
    rot = rot * cos.unsqueeze(1) + torch.cat((-r2, r1), dim=-1) * sin.unsqueeze(1)
    return torch.cat([rot, keep], dim=-1)


class LLaDA2MoeMLP(GatedMLP):
    def __init__(self, config, intermediate_size):
        super().__init__(config.hidden_size, intermediate_size)


class LLaDA2MoeGate(nn.Module):
    """Sigmoid scores, ``expert_bias`` used for the choice only, group-limited top-k, renormalised, scaled."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        choice = (scores + self.expert_bias).view(x.shape[0], self.n_group, -1)
        group_idx = torch.topk(choice.topk(2, dim=-1)[0].sum(-1), k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros(x.shape[0], self.n_group, device=x.device).scatter_(1, group_idx, 1)
        allowed = group_mask.unsqueeze(-1).expand_as(choice).reshape(x.shape[0], -1).bool()
        idx = torch.topk((scores + self.expert_bias).masked_fill(~allowed, float("-inf")), k=self.top_k, dim=-1)[1]
        weight = torch.gather(scores, 1, idx)
        if self.top_k > 1:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weight * self.routed_scaling_factor, logits


class LLaDA2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList([LLaDA2MoeMLP(config, config.moe_intermediate_size)
                                      for _ in range(config.num_experts)])
        self.gate = LLaDA2MoeGate(config)
        self.shared_experts = (LLaDA2MoeMLP(config, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, hidden_states):
        B, L, H = hidden_states.shape
        idx, weight, router_logits = self.gate(hidden_states)
        x = hidden_states.view(-1, H)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            if rows.numel():
                y.index_add_(0, rows, (expert(x[rows]) * weight[rows, slot, None]).to(x.dtype))
        y = y.view(B, L, H)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y, (router_logits.view(B, L, -1), idx.view(B, L, -1))


class LLaDA2MoeSdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.num_key_value_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.is_causal = False
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads)
                                         * self.head_dim, bias=config.use_qkv_bias)
        if config.use_qk_norm:
            self.query_layernorm = LLaDA2MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = LLaDA2MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                position_embeddings=None, **kwargs):
        B, L, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(B, L, self.num_heads + 2 * self.num_key_value_heads, -1)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(
            [self.num_heads, self.num_key_value_heads, self.num_key_value_heads], dim=-2))
        if self.config.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        kv_len = k.shape[-2]
        if past_key_value is not None:
            kv_len += past_key_value.get_usable_length(kv_len, self.layer_idx)
        cos, sin = position_embeddings
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx, {"sin": sin, "cos": cos})
        groups = self.num_heads // self.num_key_value_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=attention_mask,
            dropout_p=self.config.attention_dropout if self.training else 0.0,
            is_causal=self.is_causal and attention_mask is None and L > 1)
        return self.dense(out.transpose(1, 2).reshape(B, L, -1)), None, past_key_value


class LLaDA2MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention = LLaDA2MoeSdpaAttention(config, layer_idx)
        self.mlp = (LLaDA2MoeSparseMoeBlock(config)
                    if config.num_experts is not None and layer_idx >= config.first_k_dense_replace
                    else LLaDA2MoeMLP(config, config.intermediate_size))
        self.input_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, output_router_logits=False, use_cache=False, position_embeddings=None,
                **kwargs):
        h, _, present = self.attention(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                       position_ids=position_ids, past_key_value=past_key_value,
                                       position_embeddings=position_embeddings)
        hidden_states = hidden_states + h
        out = self.mlp(self.post_attention_layernorm(hidden_states))
        out, router_logits = out if isinstance(out, tuple) else (out, None)
        outputs = (hidden_states + out,)
        if use_cache:
            outputs += (present,)
        if output_router_logits:
            outputs += (router_logits,)
        return outputs


class LLaDA2MoePreTrainedModel(PreTrainedModel):
    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _skip_keys_device_placement = "past_key_values"
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


def released_attention_mask(attention_mask, inputs_embeds, past_len: int, sdpa: bool):
    """The additive ``(batch, 1, q_len, kv_len)`` mask (0 keep, the dtype's minimum drop) or ``None`` that
    transformers' ``_prepare_4d_causal_attention_mask_for_sdpa`` (``sdpa``) or
    ``_prepare_4d_causal_attention_mask`` builds from ``attention_mask`` (``None``, 2-D ``(batch, kv_len)``
    with 1 = keep, or 4-D) for ``inputs_embeds`` ``(batch, q_len, hidden)`` after ``past_len`` cached keys.

    Key ``k`` is causal-visible from query ``i`` when ``k <= i + past_len``; a 2-D mask drops every key
    whose entry is not 1; no mask and one query give ``None``. SDPA: ``None`` or an all-ones 2-D mask
    gives ``None`` (no mask at all) when ``q_len == 1`` or ``kv_len == q_len``, except while tracing
    (``torch.compile``), where it is causal; a 4-D mask is returned as is; on CUDA a query row with every
    key dropped (left padding) keeps every key. Eager: a 4-D mask must be exactly
    ``(batch, 1, q_len, kv_len)`` (else ``ValueError``) and is read as 1 = keep.
    """
    batch, q_len = inputs_embeds.shape[:2]
    kv_len, dtype, device = q_len + past_len, inputs_embeds.dtype, inputs_embeds.device
    lowest = torch.finfo(dtype).min
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    if attention_mask is not None and attention_mask.dim() == 4:
        if sdpa:
            return attention_mask
        if tuple(attention_mask.shape) != (batch, 1, q_len, kv_len):
            raise ValueError(f"Incorrect 4D attention_mask shape: {tuple(attention_mask.shape)}; "
                             f"expected: {(batch, 1, q_len, kv_len)}.")
        dropped = (1.0 - attention_mask) != 0
        return torch.zeros_like(dropped, dtype=dtype).masked_fill(dropped, lowest)
    if attention_mask is None and q_len == 1:
        return None  # the causal mask of one query keeps every key
    no_padding = attention_mask is None or (not tracing and bool((attention_mask == 1).all()))
    if sdpa and no_padding and not tracing and (q_len == 1 or kv_len == q_len):
        return None
    query = torch.arange(q_len, device=device)[:, None]
    dropped = (torch.arange(kv_len, device=device)[None, :] > query + past_len).expand(batch, 1, q_len, kv_len)
    if attention_mask is not None:
        dropped = dropped | (attention_mask != 1)[:, None, None, :]
    if sdpa and not tracing and device.type in ("cuda", "xpu"):
        dropped = dropped & ~dropped.all(dim=-1, keepdim=True)
    return torch.zeros(batch, 1, q_len, kv_len, dtype=dtype, device=device).masked_fill(dropped, lowest)


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self._use_sdpa = config._attn_implementation == "sdpa"
        self.norm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LLaDA2MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                output_router_logits=None, return_dict=None, **kwargs):
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        output_router_logits = output_router_logits if output_router_logits is not None else self.config.output_router_logits
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        B, L = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if self.gradient_checkpointing and self.training:
            use_cache = False
        past_len = 0
        if use_cache:
            use_legacy_cache = not isinstance(past_key_values, Cache)
            if use_legacy_cache:  # transformers 5: DynamicCache has no from_legacy_cache -> AttributeError
                past_key_values = DynamicCache.from_legacy_cache(past_key_values)
            past_len = past_key_values.get_usable_length(L)  # ... nor get_usable_length
        if position_ids is None:
            position_ids = torch.arange(past_len, L + past_len, dtype=torch.long,
                                        device=(input_ids if input_ids is not None else inputs_embeds).device)[None]
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        attention_mask = released_attention_mask(attention_mask, inputs_embeds, past_len,
                                                 sdpa=self._use_sdpa and not output_attentions)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden = () if output_hidden_states else None
        all_router = () if output_router_logits else None
        next_cache = None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            if self.gradient_checkpointing and self.training:
                outs = self._gradient_checkpointing_func(layer.__call__, hidden_states, attention_mask, position_ids,
                                                         past_key_values, False, output_router_logits, use_cache,
                                                         position_embeddings)
            else:
                outs = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_value=past_key_values, output_router_logits=output_router_logits,
                             use_cache=use_cache, position_embeddings=position_embeddings)
            hidden_states = outs[0]
            if use_cache:
                next_cache = outs[1]
            if output_router_logits and outs[-1] is not None:
                all_router += (outs[-1],)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden += (hidden_states,)
        if use_cache and use_legacy_cache:
            next_cache = next_cache.to_legacy_cache()
        if not return_dict:
            return tuple(v for v in (hidden_states, next_cache, all_hidden, all_router) if v is not None)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=next_cache,
                                      hidden_states=all_hidden, attentions=None, router_logits=all_router)


class LLaDA2MoeModelLM(BackboneAndHeadAccessors, LLaDA2MoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, output_router_logits=None, return_dict=None, **kwargs):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                             output_router_logits=output_router_logits, return_dict=return_dict)
        logits = self.lm_head(outputs[0]).float()
        loss = None
        if labels is not None:
            loss = nn.CrossEntropyLoss()(logits[..., :-1, :].reshape(-1, self.config.vocab_size),
                                         labels[..., 1:].reshape(-1).to(logits.device))
        if not return_dict:
            output = (logits,) + tuple(outputs[1:])
            return (loss,) + output if loss is not None else output
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=None, logits=logits,
                                         past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                                         attentions=None, router_logits=outputs.router_logits)

    @staticmethod
    def _sample_with_temperature_topk_topp(logits, temperature=1.0, top_k=0, top_p=1.0):
        shape = logits.shape[:-1]
        logits = logits.reshape(-1, logits.shape[-1])
        if temperature == 0.0 and top_k in (None, 0) and (top_p is None or top_p >= 1.0):
            token = logits.argmax(dim=-1, keepdim=True)
            return token.view(*shape), F.softmax(logits, dim=-1).gather(-1, token).view(*shape)
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        if top_k is not None and top_k > 0:
            logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1:], float("-inf"))
        if top_p is not None and top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
            drop[..., 1:] = drop[..., :-1].clone()
            drop[..., 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        probs = F.softmax(logits, dim=-1)
        token = torch.multinomial(probs, num_samples=1)
        return token.view(*shape), probs.gather(-1, token).view(*shape)

    @torch.no_grad()
    def generate(self, inputs=None, temperature=0.0, block_length=32, steps=32, gen_length=2048, top_p=None,
                 top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95, eos_id=156892, mask_id=156895):
        """The released block-diffusion ``generate`` (see the module docstring), re-implemented."""
        steps = min(steps, gen_length // minimal_topk)
        prompt = inputs.to(self.device)
        prompt_len = prompt.shape[1]
        num_blocks = (prompt_len + gen_length + block_length - 1) // block_length
        total = num_blocks * block_length
        mask = block_diffusion_attention_mask(total, block_length, self.device)
        position_ids = torch.arange(total, device=self.device)[None]
        x = torch.full((1, total), mask_id, dtype=torch.long, device=self.device)
        x[:, :prompt_len] = prompt.clone()
        schedule = get_num_transfer_tokens(block_length, steps)
        for block in range(prompt_len // block_length, num_blocks):
            end = (block + 1) * block_length
            cur = x[:, :end]  # a view: revealing writes into x
            for step in range(steps):
                active = cur[:, -block_length:] == mask_id
                if active.sum() == 0:
                    break
                logits = self.forward(cur, attention_mask=mask[:, :, :end, :end],
                                      position_ids=position_ids[:, :end]).logits
                x0, x0_p = self._sample_with_temperature_topk_topp(logits[:, -block_length:], temperature, top_k, top_p)
                count = schedule[step].item()
                confidence = torch.where(active, x0_p, -torch.inf)
                transfer = torch.zeros_like(x0, dtype=torch.bool)
                high = confidence[0] > threshold
                if high.sum().item() >= count:
                    transfer[0] = high
                else:
                    transfer[0, torch.topk(confidence[0], k=min(count, active.sum().item()))[1]] = True
                if transfer.any():
                    cur[:, -block_length:][transfer] = x0[transfer]
                if eos_early_stop and (x0[transfer] == eos_id).any():
                    eos_at = (cur[0] == eos_id).nonzero(as_tuple=True)[0]
                    if len(eos_at) > 0 and (cur[0, prompt_len:eos_at[0].item()] != mask_id).all():
                        return x[:, : eos_at[0].item() + 1]
            if eos_id is not None and (x[0, prompt_len:end] == eos_id).any():
                break
        answer = x[:, : prompt_len + gen_length]
        eos_at = (answer[0][prompt_len:] == eos_id).nonzero(as_tuple=True)[0]
        first = eos_at[0].item() if len(eos_at) > 0 else gen_length
        return answer[:, : prompt_len + first + 1]


def get_num_transfer_tokens(block_length, steps):
    """Tokens revealed per step within a block: ``block_length // steps``, the first remainder steps one more."""
    if steps == 0:
        return torch.tensor([], dtype=torch.int64)
    counts = torch.full((steps,), block_length // steps, dtype=torch.int64)
    counts[: block_length % steps] += 1
    return counts


def block_diffusion_attention_mask(total_length, block_length, device=None, dtype=torch.bfloat16):
    """The ``(1, 1, L, L)`` additive block-causal mask the released ``generate`` builds (0 keep, -inf drop,
    bfloat16 there; pass ``dtype`` to match a float32 model)."""
    num_blocks = total_length // block_length
    blocks = torch.tril(torch.ones(num_blocks, num_blocks, device=device))
    keep = blocks.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[None, None].bool()
    return torch.where(keep, 0.0, float("-inf")).to(dtype)


MASK_ID, EOS_ID, PAD_ID, VOCAB = 60, 58, 59, 61


def tiny(seed=0, **overrides):
    """A randomly initialised ``LLaDA2MoeModelLM`` in eval mode (vocab 61, hidden 32, 2 layers: one dense, one
    MoE with 4 experts top-2 and a shared expert; GQA 4/2 heads of 8, rotary on 4 dims), dropouts 0."""
    torch.manual_seed(seed)
    config = LLaDA2MoeConfig(**{"initializer_range": 0.2, "embedding_dropout": 0.0, "attention_dropout": 0.0,
                                "output_dropout": 0.0, "eos_token_id": EOS_ID, **overrides})
    return LLaDA2MoeModelLM(config).eval()
