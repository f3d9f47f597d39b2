"""MaskedLM.from_hf on the family doubles: what it detects (shift, mask id, attention structure), the
checks it runs at construction (and what their messages say), the refusals, and the repair of the buffers
``from_pretrained`` leaves uninitialised."""
import dataclasses
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from daca_kernels.models import families as known  # the library's family table (``families`` is the doubles' package)
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.models.model_loading import repair_buffers
from daca_kernels.rollout import generate
from families import dream, llada, llada2, llada_moe, sdar
from families.test_doubles import HUB_DOUBLES, TF5, _inputs, rotary_buffers, tokens

# The released LLaDA-MoE and LLaDA2 vocabulary: their configs hold no mask id, the released one is 156895.
RELEASED_VOCAB = 157184


@pytest.mark.parametrize("name, build, shift, mask_id, attention", [
    ("llada", llada.tiny, False, llada.MASK_ID, "full"),
    ("llada_moe", lambda: llada_moe.tiny(vocab_size=RELEASED_VOCAB), False, known.INCLUSION_MASK_ID, "full"),
    ("dream", dream.tiny, True, dream.MASK_ID, "full"),
    ("sdar", sdar.tiny, False, sdar.MASK_ID, ("block", sdar.BLOCK_SIZE)),
    ("llada2", lambda: llada2.tiny(vocab_size=RELEASED_VOCAB), False, known.INCLUSION_MASK_ID,
     ("block", known.LLADA2_BLOCK_SIZE)),
], ids=["llada", "llada_moe", "dream", "sdar", "llada2"])
def test_from_hf_with_the_model_alone_finds_shift_mask_id_and_attention(name, build, shift, mask_id, attention):
    model = build()
    lm = MaskedLM.from_hf(model)
    assert (lm.shift, lm.mask_id, lm.attention) == (shift, mask_id, attention)
    assert lm.head_weight is model.get_output_embeddings().weight
    assert known.recognise(model).name == name


def test_a_missing_mask_id_is_a_value_error_naming_it_and_explicit_arguments_win():
    for model in (llada_moe.tiny(), llada2.tiny()):
        with pytest.raises(ValueError, match=r"^mask_id: .*no mask_token_id.*156895 is outside .* 61 ids; pass"):
            MaskedLM.from_hf(model)
        assert MaskedLM.from_hf(model, mask_id=60).mask_id == 60
    assert MaskedLM.from_hf(dream.tiny(), mask_id=5).mask_id == 5
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, is_causal=False)
    with pytest.raises(ValueError, match="^mask_id: LlamaForCausalLM's config has no mask_token_id"):
        MaskedLM.from_hf(LlamaForCausalLM(config))


def test_a_shift_that_contradicts_the_family_is_refused():
    with pytest.raises(ValueError, match=r"^shift: Dream / DiffuCoder models predict token i from position i - 1"):
        MaskedLM.from_hf(dream.tiny(), shift=False)
    with pytest.raises(ValueError, match=r"^shift: LLaDA models predict token i from position i \(shift=False\)"):
        MaskedLM.from_hf(llada.tiny(), shift=True)
    assert MaskedLM.from_hf(dream.tiny(), shift=True).shift is True


def test_block_size_comes_from_the_config_or_the_argument():
    assert MaskedLM.from_hf(llada2.tiny(), mask_id=60, block_size=4).attention == ("block", 4)
    assert MaskedLM.from_hf(sdar.tiny(), block_size=2).attention == ("block", 2)
    with pytest.raises(ValueError, match="^block_size: DreamModel has full attention"):
        MaskedLM.from_hf(dream.tiny(), block_size=4)


def test_from_hf_keeps_the_family_record_whose_block_cache_protocol_the_sampler_reads(monkeypatch):
    for model, family in ((sdar.tiny(), known.SDAR), (llada2.tiny(), known.LLADA2), (dream.tiny(), known.DREAM)):
        assert MaskedLM.from_hf(model, mask_id=60).family is family
    lm = MaskedLM.from_hf(sdar.tiny())
    prompt = tokens(2, 4)
    options = dict(gen_length=4, steps=2, seed=0, temperature=0.5)
    # By default with the family's cache: each step runs only the current block, not the prompt again.
    columns = {kv_cache: generate(lm, prompt, kv_cache=kv_cache, **options).forward_tokens for kv_cache in (True, False)}
    assert generate(lm, prompt, **options).forward_tokens == columns[True] < columns[False]
    # A family record without a cache protocol: decoded without a cache, and a cache asked for is refused.
    uncached = dataclasses.replace(known.SDAR, block_cache_kwargs=None)
    monkeypatch.setattr(known, "recognise", lambda _: uncached)
    plain = MaskedLM.from_hf(sdar.tiny())
    assert plain.family is uncached and generate(plain, prompt, **options).forward_tokens == columns[False]
    with pytest.raises(ValueError, match="kv_cache: this model has no KV-cache protocol"):
        generate(plain, prompt, kv_cache=True, **options)
    with pytest.raises(TypeError, match="^family must be a Family record or None, got str"):
        MaskedLM(lm.hidden, lm.head_weight, None, lm.mask_id, family="sdar")


def test_llada_states_stop_before_the_head():
    # LLaDA-8B's backbone computes [B, L, V] logits after its final norm; MaskedLM stops at the norm.
    model = llada.tiny().eval()
    lm = MaskedLM.from_hf(model)
    head_calls = []
    model.model.transformer.ff_out.register_forward_hook(lambda *args: head_calls.append(1))
    ids = tokens(2, 7)
    with torch.no_grad():
        states = lm.hidden(ids)
        assert not head_calls
        expected = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    assert len(head_calls) == 1
    torch.testing.assert_close(states, expected.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(lm.logits(ids), expected.logits, rtol=1e-5, atol=1e-5)
    lm.hidden(ids).sum().backward()  # differentiable through the stopped call
    assert model.model.transformer.wte.weight.grad is not None
    forced = MaskedLM.from_hf(model, hidden_from="last_hidden_state", verify=False)
    with pytest.raises(AttributeError, match="last_hidden_state"):
        forced.hidden(ids)


@pytest.mark.parametrize("name", ["sdar", "llada2"])
def test_block_causal_hidden_states_are_those_of_the_released_decoding_mask(name):
    model = {"sdar": sdar, "llada2": llada2}[name].tiny()
    lm = MaskedLM.from_hf(model, mask_id=60, block_size=4)
    x = tokens(2, 12)
    if name == "sdar":
        expected = model(x, attention_mask=sdar.block_diffusion_attention_mask(12, 4)).logits
    else:
        mask = llada2.block_diffusion_attention_mask(12, 4, dtype=torch.float32).expand(2, 1, 12, 12)
        expected = model(x, attention_mask=mask, use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(x), expected, atol=1e-5, rtol=1e-5)
        y = x.clone()
        y[:, 5] = (y[:, 5] + 1) % 58
        moved = (lm.hidden(y) - lm.hidden(x)).abs().amax(dim=(0, 2))
    assert (moved[:4] == 0).all() and (moved[4:] > 1e-5).all()


def _with_family(monkeypatch, name, **changes):
    monkeypatch.setattr(known, name, dataclasses.replace(getattr(known, name), **changes))


def _padding_only(input_ids, attention_mask, block_size, dtype, form=None):
    """SDAR's mask form without the block rule: full attention over the attended tokens."""
    # No mask is full attention in the released copy (the double follows it).
    return {"attention_mask": known._keep_4d(input_ids, attention_mask, None), "use_cache": False}


def _two_d_no_cache(input_ids, attention_mask, block_size, dtype, form=None):
    return {"attention_mask": attention_mask, "use_cache": False}


def test_the_construction_check_runs_padded_and_says_what_failed(monkeypatch):
    # Each family called in a form its code does not honour is refused, with the failure named.
    with pytest.raises(ValueError, match=r"^model: DreamModel failed on a left-padded batch .*RuntimeError: Expected"):
        MaskedLM.from_hf(dream.tiny(), mask_form="2d")
    with pytest.raises(ValueError, match="^model: LLaDAMoEModelLM: a left-padded row's hidden states change with"):
        MaskedLM.from_hf(llada_moe.tiny(), mask_id=60, mask_form="2d")
    _with_family(monkeypatch, "SDAR", call_kwargs=_padding_only)
    with pytest.raises(ValueError, match="^model: SDARForCausalLM is not block-causal with block size 4"):
        MaskedLM.from_hf(sdar.tiny())
    # LLaDA2's code makes a 2-D mask with a 0 causal for the whole batch.
    _with_family(monkeypatch, "LLADA2", call_kwargs=_two_d_no_cache)
    with pytest.raises(ValueError, match="^model: LLaDA2MoeModelLM does not attend within and after a block"):
        MaskedLM.from_hf(llada2.tiny(), mask_id=60, block_size=4)


def test_diffusion_gemma_is_refused():
    gemma = pytest.importorskip("transformers.models.diffusion_gemma.modeling_diffusion_gemma",
                                reason="this transformers has no DiffusionGemma")
    DiffusionGemmaConfig, DiffusionGemmaTextConfig = gemma.DiffusionGemmaConfig, gemma.DiffusionGemmaTextConfig
    DiffusionGemmaForBlockDiffusion = gemma.DiffusionGemmaForBlockDiffusion
    text = DiffusionGemmaTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                                    moe_intermediate_size=16, num_experts=2, top_k_experts=1)
    with torch.device("meta"):  # only the class and config are read
        model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text))
    with pytest.raises(ValueError, match="^model: DiffusionGemmaForBlockDiffusion is not supported: .*uniform-noise"):
        MaskedLM.from_hf(model, mask_id=3)


# ---------------------------------------------------------------- buffers after from_pretrained

def _reload(name, tmp_path):
    """The double and its ``save_pretrained`` / ``from_pretrained`` copy."""
    model = HUB_DOUBLES[name].tiny()
    # transformers 5's save_pretrained reads _tied_weights_keys as a dict (target -> source); the released
    # list fails there. Their heads are not tied, so the dict is empty.
    model._tied_weights_keys = {}
    model.save_pretrained(tmp_path)
    return model, type(model).from_pretrained(tmp_path).eval()


@pytest.mark.skipif(not TF5, reason="transformers 5 leaves the buffers uninitialised")
@pytest.mark.parametrize("name", sorted(HUB_DOUBLES))
def test_repair_buffers_recomputes_what_from_pretrained_left_uninitialised(name, tmp_path):
    model, loaded = _reload(name, tmp_path)
    fresh, garbage = rotary_buffers(model), rotary_buffers(loaded)
    assert all(not torch.equal(fresh[k], garbage[k]) for k in fresh)
    with pytest.warns(UserWarning, match="non-persistent buffers left uninitialised by loading were recomputed"):
        repaired = repair_buffers(loaded)
    assert sorted(repaired) == sorted(f"{k}.inv_freq" for k in fresh)
    for key, value in rotary_buffers(loaded).items():
        torch.testing.assert_close(value, fresh[key], rtol=0, atol=0)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, **_inputs(name)).logits, model(x, **_inputs(name)).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert repair_buffers(loaded) == [] and repair_buffers(model) == []


@pytest.mark.skipif(not TF5, reason="transformers 5 leaves the buffers uninitialised")
def test_from_hf_repairs_a_loaded_model(tmp_path):
    model, loaded = _reload("dream", tmp_path)
    with pytest.warns(UserWarning, match="inv_freq"):
        lm = MaskedLM.from_hf(loaded)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(x), model(x).logits)


@pytest.mark.parametrize("name, build, stated", [
    ("llada", llada.tiny, "max_sequence_length"),
    ("llada_moe", llada_moe.tiny, "max_position_embeddings"),
    ("dream", dream.tiny, "max_position_embeddings"),
    ("sdar", sdar.tiny, "max_position_embeddings"),
    ("llada2", llada2.tiny, "max_position_embeddings"),
], ids=["llada", "llada_moe", "dream", "sdar", "llada2"])
def test_rotary_families_have_no_position_limit(name, build, stated):
    # Their configs state a context length, which their rotary code does not enforce: no max_length,
    # and an input past it runs.
    model = build().eval()
    lm = MaskedLM.from_hf(model, mask_id=5)
    assert lm.max_length is None
    length = getattr(model.config, stated) + 8
    ids = torch.randint(6, 50, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert lm.hidden(ids).isfinite().all()


def test_a_block_model_takes_no_mask_form():
    with pytest.raises(ValueError, match=r"^mask_form: .* got '2d' \(SDAR / TraDo is block-causal: its mask form is"):
        MaskedLM.from_hf(sdar.tiny(), mask_form="2d")
    assert MaskedLM.from_hf(sdar.tiny()).mask_form is None
