"""Tiny randomly initialised transformers models (built from configs, nothing downloaded).

The builders return transformers models with a small vocabulary that is not a power of two;
``MODELS`` maps a name to ``(builder, shift)``. ``tiny_masked_lm`` returns a ready ``MaskedLM``.

The stand-in is the library's own :class:`~daca_kernels.models.bidirectional.BidirectionalLM`, bidirectional
on every supported transformers version. transformers' own decoders (Llama, Qwen3) are bidirectional
with ``is_causal=False`` only from transformers 5.2 (earlier versions ignore the flag): they are in
``MODELS`` where ``HONOURS_IS_CAUSAL``.
"""
import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM, ModernBertConfig

from daca_kernels.models.bidirectional import BidirectionalConfig, BidirectionalLM
from daca_kernels.models.masked_lm import MaskedLM

VOCAB = 53
MASK_ID = VOCAB - 1

HONOURS_IS_CAUSAL = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 2)
needs_is_causal = pytest.mark.skipif(
    not HONOURS_IS_CAUSAL, reason=f"transformers {transformers.__version__} ignores is_causal=False (honoured from 5.2)")


def _decoder_sizes():
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, is_causal=False,
    )


def bidirectional(tied=False, head_bias=False, seed=0, head_dim=None):
    """The library's bidirectional decoder; optionally tied, or with a biased, untied LM head."""
    torch.manual_seed(seed)
    sizes = {k: v for k, v in _decoder_sizes().items() if k != "is_causal"}
    model = BidirectionalLM(BidirectionalConfig(**sizes, head_dim=head_dim, tie_word_embeddings=tied))
    if head_bias:
        model.lm_head = nn.Linear(32, VOCAB, bias=True)
    return model


def llama(tied=False, head_bias=False, seed=0):
    """Bidirectional Llama (``is_causal=False``, honoured from transformers 5.2); optionally a biased, untied LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here: the stand-in needs neither

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**_decoder_sizes(), tie_word_embeddings=tied))
    if head_bias:
        model.lm_head = nn.Linear(32, VOCAB, bias=True)
    return model


def qwen3(tied=True, seed=0):
    """Bidirectional Qwen3 with tied input/output embeddings (Qwen3 is in transformers from 4.51)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

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
    "bidirectional": (lambda: bidirectional(tied=False), False),
    "bidirectional-biased-head": (lambda: bidirectional(tied=False, head_bias=True), False),
    "bidirectional-tied-shift": (lambda: bidirectional(tied=True, head_dim=8), True),
    "modernbert": (modernbert, False),
}
if HONOURS_IS_CAUSAL:
    MODELS.update({
        "llama": (lambda: llama(tied=False), False),
        "qwen3-tied-shift": (lambda: qwen3(tied=True), True),
    })

def tiny_masked_lm(*, vocab=61, hidden=32, layers=2, mask_id=None, shift=False, seed=0, head_bias=False, dtype=torch.float32):
    """A :class:`BidirectionalLM` in eval mode; ``mask_id`` defaults to the last id.

    A large initialiser range makes predictions depend on position and context, so that the
    confidences of different positions are well apart (no near-ties that rounding could flip).
    """
    torch.manual_seed(seed)
    config = BidirectionalConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.4,
    )
    model = BidirectionalLM(config).eval()
    if head_bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(vocab))
    model = model.to(dtype)
    return MaskedLM.from_hf(model, mask_id=vocab - 1 if mask_id is None else mask_id, shift=shift)
