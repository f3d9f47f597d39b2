"""Test double of Dream-7B (``Dream-org/Dream-v0-Instruct-7B`` / ``-Base-7B``) and DiffuCoder
(``apple/DiffuCoder-7B-Instruct`` / ``-cpGRPO``, which ship the same ``modeling_dream.py``,
``configuration_dream.py`` and ``generation_utils.py``), written for these tests; no released code is copied.
The released files were read in public copies (Dream-derived repositories that keep the released classes);
``diffusion_generate`` here is this file's own re-implementation of the released algorithm.

Interface facts reproduced:

* ``DreamConfig`` (``model_type = "Dream"``): Qwen2 names (``hidden_size``, ``intermediate_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``rope_theta``, ``rope_scaling``,
  ``max_position_embeddings``, ``sliding_window`` ...), ``use_cache=False`` and ``tie_word_embeddings=False``
  by default, ``mask_token_id`` (151666 in the checkpoints) and ``pad_token_id`` (151643) set *after*
  ``PretrainedConfig.__init__``. The generation config also carries ``mask_token_id``.
* ``DreamModel(DreamGenerationMixin, DreamPreTrainedModel)``; ``_tied_weights_keys = ["lm_head.weight"]``
  (a list: transformers 5's ``save_pretrained`` fails with ``'list' object has no attribute 'keys'``);
  backbone ``model.model`` = ``DreamBaseModel`` (``embed_tokens``, ``layers`` with ``self_attn``
  (``q_proj``/``k_proj``/``v_proj`` with bias, ``o_proj`` without, and its own unused ``rotary_emb``),
  ``mlp``, ``input_layernorm``, ``post_attention_layernorm``), ``norm``, ``rotary_emb``; separate
  ``lm_head``; ``get_decoder()`` returns ``model.model``; ``supports_gradient_checkpointing = True``.
  ``can_generate()`` is ``True`` (transformers matches "GenerationMixin" in the base class names).
* ``forward(input_ids, attention_mask, position_ids, ...)`` -- ``diffusion_generate`` calls it positionally
  as ``self(x, attention_mask, tok_idx)`` -- returns ``MaskedLMOutput(loss, logits, hidden_states,
  attentions)``: no ``last_hidden_state``, no ``past_key_values``. ``num_logits_to_keep`` slices the last
  positions. ``labels`` go to ``self.loss_function``.
* Logits are *shifted*: the logit at position ``i - 1`` predicts token ``i`` (the generator does
  ``logits = cat([logits[:, :1], logits[:, :-1]], 1)``).
* Attention: SDPA with ``is_causal=False`` and ``attn_mask=attention_mask if isinstance(attention_mask,
  torch.Tensor) else None``. So ``None`` and the string ``"full"`` give full attention, a 4-D bool
  ``(B, 1, L, L)`` mask works, and the usual 2-D ``(B, L)`` int64 tokenizer mask goes straight into SDPA:
  ``RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got
  attn_mask.dtype: long int ...``. Padding must be expressed as a 4-D mask plus ``position_ids``.
* Rotary: ``DreamRotaryEmbedding`` registers ``inv_freq`` non-persistent, computed in ``__init__``;
  ``DreamPreTrainedModel._init_weights`` handles only ``nn.Linear``/``nn.Embedding``, so under
  transformers 5 ``from_pretrained`` leaves ``inv_freq`` as uninitialised memory.
* ``DreamPreTrainedModel.from_pretrained`` is overridden: after loading it replaces
  ``model.generation_config`` by ``DreamGenerationConfig.from_pretrained(path, ...)`` (so the checkpoint
  needs a ``generation_config.json``). ``tiny()`` gives the double that loaded form.

``diffusion_generate(inputs, generation_config=None, **kwargs)`` (``generation_utils.py``; the released
method is decorated ``@torch.no_grad()``): with ``generation_config=None`` a fresh ``DreamGenerationConfig`` is
built from the *model config* (``model.generation_config`` is then not read; it only fills the missing special
token ids of a config that is passed); kwargs update a copy of it --
``max_new_tokens``, ``max_length``, ``steps`` (512), ``eps`` (1e-3), ``temperature`` (0.0), ``top_p``,
``top_k``, ``alg`` ("origin" | "maskgit_plus" | "topk_margin" | "entropy"), ``alg_temp``,
``num_return_sequences``, ``output_history``, ``return_dict_in_generate``, ``mask_token_id`` -- plus
``attention_mask``, ``generation_tokens_hook_func(step, x, logits) -> x`` and
``generation_logits_hook_func(step, x, logits) -> logits``. ``max_length = max_new_tokens +
prompt_length`` (else 20 + prompt length, capped at ``max_position_embeddings``); prompt length >=
``max_length`` raises ``ValueError``. The prompt is right-padded with the mask id to ``max_length``. If the
attention mask has a 0, it is right-padded with 1s, ``tok_idx = cumsum(mask) - 1`` (1 at padding) becomes
``position_ids`` and the mask becomes the 4-D bool ``mask[:, None, None, :] & mask[:, None, :, None]``;
otherwise ``"full"`` and no position ids. ``timesteps = linspace(1, eps, steps + 1)``; at step ``i`` (``t =
timesteps[i]``, ``s = timesteps[i + 1]``) the model runs on the whole sequence, logits are shifted, the
logits hook runs, and the masked positions' logits are decoded:

* ``origin``: each masked position is revealed independently with probability ``1 - s / t`` (1 at the last
  step) -- ``torch.rand`` over the masked positions first, then a sample for the chosen ones.
* otherwise: every masked position gets a token and a confidence -- the probability of the chosen token
  (``maskgit_plus``), top-1 minus top-2 probability (``topk_margin``) or the negative entropy
  ``sum p log(p + 1e-10)`` (``entropy``); ``k = int(mean masked count per row * (1 - s / t))`` (all at the
  last step) positions per row are revealed: the top-``k`` confidences (``alg_temp`` None or 0) or
  ``multinomial(softmax(confidence / alg_temp), k)`` without replacement; non-masked positions have
  confidence ``-inf``.

Token choice (``sample_tokens``): logits / temperature (if > 0), top-p then top-k filtering (removed logits
set to ``finfo.min``), softmax; temperature > 0 samples ``Categorical(probs)`` with confidence the chosen
probability, else the argmax and its probability. The tokens hook runs after every step. Returns the
sequences, or ``DreamModelOutput(sequences, history)`` with ``return_dict_in_generate`` (history: one
``x`` per step if ``output_history``). Draws use the global torch RNG, so seeding reproduces them.
"""
import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput
from transformers.utils import ModelOutput

from families._blocks import GatedMLP, RMSNorm, RotaryEmbedding, rotate_half
from families._lm_head import BackboneAndHeadAccessors


class DreamConfig(PretrainedConfig):
    model_type = "Dream"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128,
                 initializer_range=0.02, rms_norm_eps=1e-6, use_cache=False, tie_word_embeddings=False,
                 rope_theta=10000.0, rope_scaling=None, use_sliding_window=False, sliding_window=4096,
                 max_window_layers=28, attention_dropout=0.0, mask_token_id=60, pad_token_id=59, **kwargs):
        self.vocab_size, self.max_position_embeddings = vocab_size, max_position_embeddings
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window if use_sliding_window else None
        self.max_window_layers = max_window_layers
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act, self.initializer_range, self.rms_norm_eps = hidden_act, initializer_range, rms_norm_eps
        self.use_cache, self.rope_theta, self.rope_scaling = use_cache, rope_theta, rope_scaling
        self.attention_dropout = attention_dropout
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id


class DreamGenerationConfig(GenerationConfig):
    """The Dream generation fields with the released defaults (the rest is ``GenerationConfig``'s)."""

    DREAM_FIELDS = dict(temperature=0.0, top_p=None, top_k=None, max_length=20, max_new_tokens=None, eps=1e-3,
                        steps=512, alg="origin", alg_temp=None, num_return_sequences=1,
                        return_dict_in_generate=False, output_history=False, mask_token_id=None,
                        pad_token_id=None, bos_token_id=None, eos_token_id=None)

    def __init__(self, **kwargs):
        own = {k: kwargs.pop(k, v) for k, v in self.DREAM_FIELDS.items()}
        super().__init__(**kwargs)
        for k, v in own.items():
            setattr(self, k, v)

    def validate(self, *args, **kwargs):
        pass


@dataclass
class DreamModelOutput(ModelOutput):
    sequences: torch.LongTensor = None
    history: Optional[tuple] = None


def _top_p(logits, top_p):
    sorted_logits, order = torch.sort(logits, descending=True)
    remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    remove = torch.zeros_like(remove).scatter_(-1, order, remove)
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def _top_k(logits, top_k):
    kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False, neg_entropy=False):
    """Tokens and confidences for rows of logits, as the released ``sample_tokens`` defines them."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = _top_p(logits, top_p)
    if top_k is not None:
        logits = _top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        try:
            x0 = torch.distributions.Categorical(probs=probs).sample()
            confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        except Exception:  # the released code falls back to the argmax
            confidence, x0 = probs.max(dim=-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        top2 = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top2[:, 0] - top2[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


class DreamGenerationMixin:
    @torch.no_grad()
    def diffusion_generate(self, inputs=None, generation_config=None, **kwargs):
        tokens_hook = kwargs.pop("generation_tokens_hook_func", lambda step, x, logits: x)
        logits_hook = kwargs.pop("generation_logits_hook_func", lambda step, x, logits: logits)
        attention_mask = kwargs.pop("attention_mask", None)
        max_length_given = kwargs.get("max_length") is not None
        if generation_config is None:
            config = DreamGenerationConfig(mask_token_id=self.config.mask_token_id, pad_token_id=self.config.pad_token_id,
                                           bos_token_id=self.config.bos_token_id, eos_token_id=self.config.eos_token_id)
        else:
            config = copy.deepcopy(generation_config)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"):
                if getattr(config, name, None) is None:
                    setattr(config, name, getattr(self.generation_config, name, None))
        for key, value in kwargs.items():
            if hasattr(config, key):
                setattr(config, key, value)
        assert inputs is not None
        prompt_len = inputs.shape[-1]
        if config.max_new_tokens is not None:
            config.max_length = config.max_new_tokens + prompt_len
        elif not max_length_given and config.max_length == 20:
            config.max_length = min(20 + prompt_len, getattr(self.config, "max_position_embeddings", 10**9))
        if prompt_len >= config.max_length:
            raise ValueError(f"Input length of input_ids is {prompt_len}, but `max_length` is set to "
                             f"{config.max_length}.")
        if config.num_return_sequences > 1:
            inputs = inputs.repeat_interleave(config.num_return_sequences, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
        return self._sample(inputs, attention_mask, config, tokens_hook, logits_hook)

    def _sample(self, input_ids, attention_mask, config, tokens_hook, logits_hook):
        mask_id, steps, eps, alg = config.mask_token_id, config.steps, config.eps, config.alg
        temperature, top_p, top_k, alg_temp = config.temperature, config.top_p, config.top_k, config.alg_temp
        histories = [] if (config.return_dict_in_generate and config.output_history) else None
        x = F.pad(input_ids, (0, config.max_length - input_ids.shape[1]), value=mask_id)
        if attention_mask is not None and torch.any(attention_mask == 0.0):
            attention_mask = F.pad(attention_mask, (0, config.max_length - attention_mask.shape[1]), value=1.0)
            tok_idx = attention_mask.long().cumsum(-1) - 1
            tok_idx.masked_fill_(attention_mask == 0, 1)
            attention_mask = torch.logical_and(attention_mask.unsqueeze(1).unsqueeze(-2),
                                               attention_mask.unsqueeze(1).unsqueeze(-1))
        else:
            tok_idx, attention_mask = None, "full"
        timesteps = torch.linspace(1, eps, steps + 1, device=x.device)
        x = tokens_hook(None, x, None)
        for i in range(steps):
            mask_index = x == mask_id
            logits = self(x, attention_mask, tok_idx).logits
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            logits = logits_hook(i, x, logits)
            mask_logits = logits[mask_index]
            t, s = timesteps[i], timesteps[i + 1]
            if alg == "origin":
                p_transfer = 1 - s / t if i < steps - 1 else 1
                x0 = torch.full_like(x[mask_index], mask_id)
                chosen = torch.rand(*x0.shape, device=x.device) < p_transfer
                _, x0[chosen] = sample_tokens(mask_logits[chosen], temperature=temperature, top_p=top_p, top_k=top_k)
                x[mask_index] = x0.clone()
            else:
                if alg not in ("maskgit_plus", "topk_margin", "entropy"):
                    raise RuntimeError(f"Unknown alg: {alg}")
                confidence, x0 = sample_tokens(mask_logits, temperature=temperature, top_p=top_p, top_k=top_k,
                                               margin_confidence=alg == "topk_margin", neg_entropy=alg == "entropy")
                mean_masked = mask_index.sum() / mask_index.shape[0]
                k = int(mean_masked * (1 - s / t)) if i < steps - 1 else int(mean_masked)
                full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
                full_confidence[mask_index] = confidence
                if k > 0:
                    if alg_temp is None or alg_temp == 0:
                        _, where = torch.topk(full_confidence, k)
                    else:
                        where = torch.multinomial(F.softmax(full_confidence / alg_temp, dim=-1), num_samples=k)
                    proposal = torch.full_like(x, mask_id)
                    proposal[mask_index] = x0.clone()
                    rows = torch.arange(x.size(0), device=x.device).unsqueeze(1).expand_as(where)
                    x[rows, where] = proposal[rows, where]
            x = tokens_hook(i, x, logits)
            if histories is not None:
                histories.append(x.clone())
        if config.return_dict_in_generate:
            return DreamModelOutput(sequences=x, history=histories)
        return x


class DreamRMSNorm(RMSNorm):
    pass


class DreamRotaryEmbedding(RotaryEmbedding):
    @staticmethod
    def rotary_dim(config):
        return config.hidden_size // config.num_attention_heads


class DreamSdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.is_causal = False
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = DreamRotaryEmbedding(config=config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                position_embeddings=None, **kwargs):
        B, L, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings if position_embeddings is not None else self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask if isinstance(attention_mask, torch.Tensor) else None,
            dropout_p=self.config.attention_dropout if self.training else 0.0, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class DreamMLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size)


class DreamDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DreamSdpaAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None, **kwargs):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, position_embeddings=position_embeddings)
        h = self.post_attention_layernorm(hidden_states)
        return (hidden_states + self.mlp(h),)


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DreamDecoderLayer"]
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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args, **kwargs):
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        # The released override: the loaded generation config lacks the Dream fields, so reload it.
        model.generation_config = DreamGenerationConfig.from_pretrained(
            pretrained_model_name_or_path, subfolder=kwargs.get("subfolder", ""),
            local_files_only=kwargs.get("local_files_only", False))
        return model


class DreamBaseModel(DreamPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DreamRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None):
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training:
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
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden_states,)
            if self.gradient_checkpointing and self.training:
                hidden_states = self._gradient_checkpointing_func(
                    layer.__call__, hidden_states, attention_mask, position_ids, past_key_values, False,
                    use_cache, cache_position, position_embeddings)[0]
            else:
                hidden_states = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_value=past_key_values, position_embeddings=position_embeddings)[0]
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden += (hidden_states,)
        if not return_dict:
            return tuple(v for v in (hidden_states, all_hidden) if v is not None)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden, attentions=None)


class DreamModel(BackboneAndHeadAccessors, DreamGenerationMixin, DreamPreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None, num_logits_to_keep=0,
                **loss_kwargs):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states, return_dict=return_dict,
                             cache_position=cache_position)
        logits = self.lm_head(outputs[0][:, -num_logits_to_keep:, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **loss_kwargs)
        if not return_dict:
            output = (logits,) + tuple(outputs[1:])
            return (loss,) + output if loss is not None else output
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=None)


MASK_ID, PAD_ID, EOS_ID, VOCAB = 60, 59, 58, 61


def tiny(seed=0, **overrides):
    """A randomly initialised ``DreamModel`` in eval mode (vocab 61, mask id 60, hidden 32, 2 layers), with the
    ``DreamGenerationConfig`` a hub checkpoint loads (bos/eos 58, pad 59, mask 60)."""
    torch.manual_seed(seed)
    config = DreamConfig(**{"initializer_range": 0.2, "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, **overrides})
    model = DreamModel(config).eval()
    model.generation_config = DreamGenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        mask_token_id=config.mask_token_id)
    return model
