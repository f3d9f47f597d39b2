"""MaskedLM.from_hf on randomly initialised transformers models: the backbone/head split reproduces
the model's logits, the head is the model's own parameter, gradients reach the backbone."""
from types import SimpleNamespace

import pytest
import torch
from tiny_models import HONOURS_IS_CAUSAL, MASK_ID, VOCAB, bert, bidirectional, llama, modernbert, qwen3
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, RobertaConfig, RobertaForMaskedLM

from daca_kernels import linear_logprob
from daca_kernels.models.masked_lm import MaskedLM

BUILDERS = {
    "bidirectional-untied": lambda: bidirectional(tied=False),
    "bidirectional-tied": lambda: bidirectional(tied=True),
    "bidirectional-biased-head": lambda: bidirectional(tied=False, head_bias=True),
    "modernbert": modernbert,
}
if HONOURS_IS_CAUSAL:  # transformers' own decoders are bidirectional only where is_causal=False is honoured
    BUILDERS.update({
        "llama-untied": lambda: llama(tied=False),
        "llama-tied": lambda: llama(tied=True),
        "llama-biased-head": lambda: llama(tied=False, head_bias=True),
        "qwen3-tied": lambda: qwen3(tied=True),
        "qwen3-untied": lambda: qwen3(tied=False),
    })


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (3, 14), generator=g)
    attention_mask = torch.ones(3, 14, dtype=torch.long)
    attention_mask[1, :4] = 0  # a left-padded row
    return ids, attention_mask


@pytest.mark.parametrize("name", list(BUILDERS))
def test_hidden_and_head_reproduce_the_model_logits(name):
    model = BUILDERS[name]().eval()
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID)
    ids, attention_mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=attention_mask).logits
        hidden = lm.hidden(ids, attention_mask)
    assert hidden.shape == (3, 14, lm.head_weight.shape[1])
    logits = hidden @ lm.head_weight.T + (0 if lm.head_bias is None else lm.head_bias)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm.logits(ids, attention_mask).detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_head_is_the_models_own_parameter(name):
    model = BUILDERS[name]()
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID)
    output = model.get_output_embeddings()
    assert lm.head_weight is output.weight
    assert lm.head_bias is getattr(output, "bias", None)
    tied = model.get_input_embeddings().weight is output.weight
    assert tied == (name in ("bidirectional-tied", "llama-tied", "qwen3-tied", "modernbert"))
    assert (lm.head_bias is not None) == (name in ("bidirectional-biased-head", "llama-biased-head", "modernbert"))
    assert lm.vocab_size == VOCAB and lm.mask_id == MASK_ID and lm.shift is False
    assert {id(p) for p in lm.parameters()} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_the_backbone_is_bidirectional(name):
    lm = MaskedLM.from_hf(BUILDERS[name]().eval(), mask_id=MASK_ID)
    ids, _ = batch()
    changed = ids.clone()
    changed[:, -1] = MASK_ID
    with torch.no_grad():
        delta = (lm.hidden(changed, None)[:, 0] - lm.hidden(ids, None)[:, 0]).abs().max()
    assert delta > 1e-4, "position 0 must see the last token"


def test_a_causal_model_is_refused():
    # A decoder built without is_causal=False does not look ahead; the estimators would be wrong on it.
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match="is causal.*assume a bidirectional model"):
        MaskedLM.from_hf(model, mask_id=MASK_ID)
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID, verify=False)
    ids, _ = batch()
    changed = ids.clone()
    changed[:, -1] = MASK_ID
    with torch.no_grad():
        assert torch.equal(lm.hidden(changed, None)[:, 0], lm.hidden(ids, None)[:, 0])


@pytest.mark.parametrize("name", ["bidirectional-biased-head", "bidirectional-tied", "modernbert"])
def test_gradients_reach_backbone_and_head(name):
    model = BUILDERS[name]()
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID, shift=True)
    assert lm.shift is True
    ids, attention_mask = batch()
    hidden = lm.hidden(ids, attention_mask)[:, :-1].reshape(-1, lm.head_weight.shape[1])
    linear_logprob(hidden, lm.head_weight, ids[:, 1:].reshape(-1), bias=lm.head_bias).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert lm.head_weight.grad.abs().sum() > 0
    layer_grads = [g for n, g in grads.items() if "layers.0." in n]
    assert layer_grads and all(g.abs().sum() > 0 for g in layer_grads if g.dim() == 2)


def test_verify_refuses_post_processed_logits_and_keeps_the_training_mode():
    class SoftCapped(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 3.0 * torch.tanh(out.logits / 3.0)
            return out

    torch.manual_seed(0)
    model = SoftCapped(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, is_causal=False))
    model.lm_head.weight.data.mul_(20)
    model.train()
    with pytest.raises(ValueError, match="does not reproduce model"):
        MaskedLM.from_hf(model, mask_id=MASK_ID)
    assert model.training
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID, verify=False)
    assert lm.head_weight is model.lm_head.weight


def test_from_hf_rejects_models_without_a_head_and_bad_mask_ids():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, is_causal=False)
    with pytest.raises(ValueError, match="model must be a transformers model with an LM head"):
        MaskedLM.from_hf(LlamaModel(config), mask_id=MASK_ID)
    with pytest.raises(ValueError, match=rf"mask_id must be in \[0, {VOCAB}\), got {VOCAB}"):
        MaskedLM.from_hf(LlamaForCausalLM(config), mask_id=VOCAB)
    with pytest.raises(TypeError, match="mask_id must be an int, got bool"):
        MaskedLM.from_hf(LlamaForCausalLM(config), mask_id=True)


def test_from_hf_refuses_arguments_of_the_wrong_type():
    """A string shift would have been truthy (``shift="False"`` became shift=True)."""
    torch.manual_seed(0)
    model = bidirectional()
    with pytest.raises(TypeError, match="shift must be a bool, got str"):
        MaskedLM.from_hf(model, mask_id=MASK_ID, shift="False")
    with pytest.raises(TypeError, match="verify must be a bool, got str"):
        MaskedLM.from_hf(model, mask_id=MASK_ID, verify="no")
    with pytest.raises(TypeError, match="model must be a transformers model"):
        MaskedLM.from_hf("meta-llama/Llama-3", mask_id=MASK_ID)
    assert MaskedLM.from_hf(model, mask_id=MASK_ID, shift=False).shift is False


class LogitsBackbone(nn.Module):
    """A backbone that applies the head itself and returns logits (and, when asked, its hidden
    states, the last one being what the head reads), as LLaDA's remote code does."""

    def __init__(self, llama_model: nn.Module):
        super().__init__()
        self.body = llama_model.model
        self.lm_head = llama_model.lm_head

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        states = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return SimpleNamespace(logits=self.lm_head(states), hidden_states=(states,) if output_hidden_states else None)


class LogitsModel(nn.Module):
    def __init__(self, llama_model: nn.Module):
        super().__init__()
        self.backbone = LogitsBackbone(llama_model)

    @property
    def base_model(self):
        return self.backbone

    def get_output_embeddings(self):
        return self.backbone.lm_head

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.backbone(input_ids, attention_mask).logits)


def test_hidden_states_of_a_backbone_that_returns_logits():
    model = LogitsModel(bidirectional(tied=False))
    with pytest.raises(AttributeError, match="last_hidden_state"):
        MaskedLM.from_hf(model, mask_id=MASK_ID)
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID, hidden_from="hidden_states")
    ids, attention_mask = batch()
    torch.testing.assert_close(lm.logits(ids, attention_mask), model(ids, attention_mask).logits)
    with pytest.raises(ValueError, match="hidden_from"):
        MaskedLM.from_hf(model, mask_id=MASK_ID, hidden_from="logits")


def test_a_learned_position_table_is_the_models_max_length():
    # BERT: one row per position; past them transformers fails inside the embeddings.
    lm = MaskedLM.from_hf(bert(max_positions=16), mask_id=MASK_ID, verify=False)
    assert lm.max_length == 16
    # Past the table transformers 5 fails with a RuntimeError (a broadcast), transformers 4 with an
    # IndexError (the embedding lookup).
    with torch.no_grad():
        assert lm.hidden(torch.full((1, 16), 5)).shape == (1, 16, 32)
        with pytest.raises((RuntimeError, IndexError)):
            lm.hidden(torch.full((1, 17), 5))
    # RoBERTa counts its positions from padding_idx + 1: 18 rows hold 16 positions.
    torch.manual_seed(0)
    roberta = RobertaForMaskedLM(RobertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=18,
                                               pad_token_id=1)).eval()
    lm = MaskedLM.from_hf(roberta, mask_id=MASK_ID, verify=False)
    assert lm.max_length == 16
    with torch.no_grad():
        lm.hidden(torch.full((1, 16), 5))
        with pytest.raises((RuntimeError, IndexError)):
            lm.hidden(torch.full((1, 17), 5))


@pytest.mark.parametrize("name", ["bidirectional-untied", "modernbert"]
                         + [name for name in ("llama-untied", "qwen3-tied") if name in BUILDERS])
def test_rotary_models_have_no_max_length_and_run_past_their_stated_one(name):
    # Their configs state max_position_embeddings = 64, which their code does not enforce.
    model = BUILDERS[name]().eval()
    assert model.config.max_position_embeddings == 64
    lm = MaskedLM.from_hf(model, mask_id=MASK_ID)
    assert lm.max_length is None
    ids = torch.randint(3, VOCAB - 1, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(ids), model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
