"""The tiny bidirectional policy of the reference loop: a Llama-architecture transformer built from
a config (no download), ``is_causal=False``, over the tasks' character vocabulary."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from daca_kernels.masked_lm import MaskedLM
from integration.tasks import vocab


@dataclass(frozen=True)
class ModelConfig:
    """Size of the tiny policy (defaults: about 0.1M parameters)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 192
    max_length: int = 96

    def to_dict(self) -> dict:
        return asdict(self)


def build_model(config: ModelConfig, seed: int) -> LlamaForCausalLM:
    """A randomly initialised bidirectional Llama, deterministic in ``seed``."""
    hf_config = LlamaConfig(
        vocab_size=vocab.size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_length,
        is_causal=False,
        tie_word_embeddings=False,
        pad_token_id=vocab.pad_id,
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(hf_config)
    return model


def as_masked_lm(model: LlamaForCausalLM) -> MaskedLM:
    """The policy as the estimators and the sampler see it (the mask id is the vocabulary's)."""
    return MaskedLM.from_hf(model, mask_id=vocab.mask_id)
