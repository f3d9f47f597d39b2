"""The tiny bidirectional policy of the reference loop: the library's Llama-style
[`BidirectionalLM`][daca_kernels.models.bidirectional.BidirectionalLM] built from a config (no download), over the tasks'
character vocabulary (bidirectional on every supported transformers version)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from daca_kernels.models.bidirectional import BidirectionalConfig, BidirectionalLM
from daca_kernels.models.masked_lm import MaskedLM
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


def build_model(config: ModelConfig, seed: int) -> BidirectionalLM:
    """A randomly initialised bidirectional decoder, deterministic in ``seed``."""
    hf_config = BidirectionalConfig(
        vocab_size=vocab.size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_length,
        tie_word_embeddings=False,
        pad_token_id=vocab.pad_id,
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BidirectionalLM(hf_config)
    return model


def as_masked_lm(model: BidirectionalLM) -> MaskedLM:
    """The policy as the estimators and the sampler see it (the mask id is the vocabulary's)."""
    return MaskedLM.from_hf(model, mask_id=vocab.mask_id)
