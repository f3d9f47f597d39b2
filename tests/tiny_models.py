"""Tiny randomly initialised transformers models (built from configs, nothing downloaded).

The builders return transformers models with a small vocabulary that is not a power of two;
``MODELS`` maps a name to ``(builder, shift)``. ``tiny_masked_lm`` returns a ready ``MaskedLM``.
"""
import torch
from torch import nn
from transformers import (
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
    ModernBertConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from daca_kernels.masked_lm import MaskedLM

VOCAB = 53
MASK_ID = VOCAB - 1


def _decoder_sizes():
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, is_causal=False,
    )


def llama(tied=False, head_bias=False, seed=0):
    """Bidirectional Llama (``is_causal=False``); optionally a biased, untied LM head."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**_decoder_sizes(), tie_word_embeddings=tied))
    if head_bias:
        model.lm_head = nn.Linear(32, VOCAB, bias=True)
    return model


def qwen3(tied=True, seed=0):
    """Bidirectional Qwen3 with tied input/output embeddings."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**_decoder_sizes(), head_dim=8, tie_word_embeddings=tied))


def modernbert(seed=0):
    """ModernBERT masked LM: head transform (dense, act, norm), decoder with bias, tied weight."""
    torch.manual_seed(seed)
    config = ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        global_attn_every_n_layers=1, local_attention=16, max_position_embeddings=64,
    )
    return AutoModelForMaskedLM.from_config(config)


def bert(max_positions=16, vocab=VOCAB, seed=0):
    """BERT masked LM (learned absolute position embeddings of ``max_positions`` rows), in eval mode.
    Its positions count left padding, so ``MaskedLM.from_hf`` needs ``verify=False`` for it."""
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=max_positions)
    return BertForMaskedLM(config).eval()


# name -> (builder, shift): the Dream / DiffuCoder convention (shift=True) on a Qwen model.
MODELS = {
    "llama": (lambda: llama(tied=False), False),
    "llama-biased-head": (lambda: llama(tied=False, head_bias=True), False),
    "qwen3-tied-shift": (lambda: qwen3(tied=True), True),
    "modernbert": (modernbert, False),
}

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
