"""Tiny randomly initialised bidirectional transformers models wrapped as ``MaskedLM`` (no downloads)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from daca_kernels.masked_lm import MaskedLM


def tiny_masked_lm(*, vocab=61, hidden=32, layers=2, mask_id=None, shift=False, seed=0, head_bias=False, dtype=torch.float32):
    """A bidirectional Llama (``is_causal=False``) in eval mode; ``mask_id`` defaults to the last id.

    A large initialiser range makes predictions depend on position and context, so that the
    confidences of different positions are well apart (no near-ties that rounding could flip).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, is_causal=False,
        tie_word_embeddings=False, initializer_range=0.4,
    )
    model = LlamaForCausalLM(config).eval()
    if head_bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(vocab))
    model = model.to(dtype)
    return MaskedLM.from_hf(model, mask_id=vocab - 1 if mask_id is None else mask_id, shift=shift)
