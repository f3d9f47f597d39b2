"""The family doubles show the interface facts their docstrings list (these tests document the doubles;
they pass against the doubles as they are, failure modes of the released code included)."""
import itertools

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput, MoeCausalLMOutputWithPast

from families import dream, llada, llada2, llada_moe, sdar

TF5 = int(transformers.__version__.split(".")[0]) >= 5
needs_tf5 = pytest.mark.skipif(not TF5, reason="a transformers 5 behaviour")


def tokens(batch=2, length=8, seed=0, high=58):
    return torch.randint(0, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def write_hub_checkpoint(model, directory):
    """What a hub checkpoint holds: config.json, generation_config.json, model.safetensors (the doubles with
    list ``_tied_weights_keys`` cannot ``save_pretrained`` under transformers 5)."""
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{directory}/model.safetensors")


def rotary_buffers(model):
    return {name: m.inv_freq for name, m in model.named_modules() if hasattr(m, "original_inv_freq")}


# ---------------------------------------------------------------- LLaDA-8B

def test_llada_output_is_causal_lm_output_without_last_hidden_state():
    model = llada.tiny()
    out = model(tokens(), use_cache=False)
    assert isinstance(out, CausalLMOutputWithPast) and out.logits.shape == (2, 8, llada.VOCAB)
    assert not hasattr(out, "last_hidden_state") and out.hidden_states is None
    hidden = model(tokens(), use_cache=False, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.n_layers + 1
    with pytest.raises(ValueError, match="output_attentions"):
        model(tokens(), use_cache=False, output_attentions=True)


@needs_tf5
def test_llada_config_loses_use_cache_under_transformers5():
    model = llada.tiny()
    with pytest.raises(AttributeError, match="use_cache"):
        model(tokens())


def test_llada_backbone_names_and_heads():
    model = llada.tiny()
    assert model.base_model_prefix == "model" and type(model.base_model).__name__ == "LLaDAModel"
    assert not isinstance(model.base_model, transformers.PreTrainedModel)
    assert set(model.model.transformer.keys()) == {"wte", "emb_drop", "ln_f", "blocks", "ff_out"}
    assert model.get_output_embeddings() is model.model.transformer.ff_out
    assert model.get_input_embeddings() is model.model.transformer.wte
    assert model.config.mask_token_id == llada.MASK_ID and model.config.hidden_size == model.config.d_model
    tied = llada.tiny(weight_tying=True)
    assert "ff_out" not in tied.model.transformer and tied.get_output_embeddings() is tied.model.transformer.wte
    x = tokens()
    out = tied(x, use_cache=False, output_hidden_states=True)
    torch.testing.assert_close(out.logits, out.hidden_states[-1] @ tied.model.transformer.wte.weight.T)


def test_llada_ignores_every_attention_mask():
    model = llada.tiny()
    x = tokens()
    plain = model(x, use_cache=False).logits
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    for form in ({"attention_mask": mask}, {"attention_bias": mask[:, None, None, :].expand(2, 1, 8, 8).bool()}):
        assert torch.equal(model(x, use_cache=False, **form).logits, plain)
    # so a left-padded row differs from the row alone: its padding is attended
    assert not torch.allclose(plain[1, 3:], model(x[1:, 3:], use_cache=False).logits[0], atol=1e-3)
    with pytest.raises(RuntimeError):  # a 4-D mask as attention_mask fails in the bias arithmetic
        model(x, attention_mask=mask[:, None, None, :].expand(2, 1, 8, 8), use_cache=False)


def test_llada_has_no_kv_cache_and_no_gradient_checkpointing():
    model = llada.tiny()
    with pytest.raises(AssertionError, match="kvcache"):
        model(tokens(), use_cache=True)
    assert not model.supports_gradient_checkpointing
    with pytest.raises(ValueError, match="does not support"):
        model.gradient_checkpointing_enable()


def test_llada_gets_a_generation_config_from_its_can_generate_override():
    model = llada.tiny()
    assert model.can_generate() and model.generation_config is not None


@needs_tf5
def test_llada_saves_but_from_pretrained_fails_without_post_init(tmp_path):
    model = llada.tiny()
    model.save_pretrained(tmp_path)
    with pytest.raises(AttributeError, match="all_tied_weights_keys"):
        llada.LLaDAModelLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------- LLaDA-MoE

def test_llada_moe_output_decoder_and_ignored_mask():
    model = llada_moe.tiny()
    x = tokens()
    out = model(x)
    assert isinstance(out, MoeCausalLMOutputWithPast) and not hasattr(out, "last_hidden_state")
    assert type(model.get_decoder()).__name__ == "LLaDAMoEModel" and model.get_output_embeddings() is model.lm_head
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    assert torch.equal(model(x, attention_mask=mask).logits, out.logits)
    assert torch.equal(model(x, attention_mask=mask[:, None, None, :].bool()).logits, out.logits)
    with pytest.raises(AssertionError, match="loss"):
        model(x, labels=x)
    with pytest.raises(AssertionError, match="cache"):
        model(x, use_cache=True)


def test_llada_moe_layers_are_mixtures_of_four_experts_top2():
    model = llada_moe.tiny()
    moe = model.model.layers[0].mlp
    assert type(moe).__name__ == "LLaDAMoESparseMoeBlock" and len(moe.experts) == 4 and moe.top_k == 2
    assert model._tied_weights_keys == ["lm_head.weight"]


def test_llada_moe_is_not_generative_and_has_no_generation_config():
    model = llada_moe.tiny()
    assert not model.can_generate()
    if TF5:
        with pytest.raises(AttributeError, match="generation_config"):
            model.generation_config


def test_llada_moe_gradient_checkpointing_trains():
    model = llada_moe.tiny().train()
    model.gradient_checkpointing_enable()
    assert model.model.gradient_checkpointing
    model(tokens()).logits.square().mean().backward()
    assert model.model.embed_tokens.weight.grad is not None


# ---------------------------------------------------------------- Dream / DiffuCoder

def test_dream_output_and_names():
    model = dream.tiny()
    out = model(tokens())
    assert isinstance(out, MaskedLMOutput) and not hasattr(out, "last_hidden_state")
    assert type(model.get_decoder()).__name__ == "DreamBaseModel" and model.can_generate()
    assert model.config.model_type == "Dream" and model.config.mask_token_id == dream.MASK_ID
    assert model.generation_config.mask_token_id == dream.MASK_ID
    assert model(tokens(), num_logits_to_keep=3).logits.shape == (2, 3, dream.VOCAB)


def test_dream_attention_accepts_full_or_4d_bool_and_refuses_a_2d_long_mask():
    model = dream.tiny()
    x = tokens()
    plain = model(x).logits
    assert torch.equal(model(x, "full").logits, plain)
    torch.testing.assert_close(model(x, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool)).logits, plain)
    with pytest.raises(RuntimeError, match="Expected attn_mask dtype to be bool or float"):
        model(x, attention_mask=torch.ones_like(x))


def test_dream_generation_shifts_logits():
    model = dream.tiny()
    prompt = tokens(1, 5)
    seen = {}

    def capture(step, x, logits):
        seen["x"], seen["logits"] = x.clone(), logits.clone()
        return logits

    model.diffusion_generate(prompt, max_new_tokens=4, steps=1, generation_logits_hook_func=capture)
    raw = model(seen["x"], "full").logits
    torch.testing.assert_close(seen["logits"][:, 1:], raw[:, :-1])
    torch.testing.assert_close(seen["logits"][:, 0], raw[:, 0])


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_dream_diffusion_generate_greedy_and_seeded_runs_are_reproducible(alg):
    model = dream.tiny()
    prompt = tokens(2, 5)
    greedy = model.diffusion_generate(prompt, max_new_tokens=6, steps=6, alg=alg, return_dict_in_generate=True,
                                      output_history=True)
    assert greedy.sequences.shape == (2, 11) and torch.equal(greedy.sequences[:, :5], prompt)
    assert not (greedy.sequences == dream.MASK_ID).any() and len(greedy.history) == 6
    if alg != "origin":  # origin draws which positions to reveal even at temperature 0
        assert torch.equal(model.diffusion_generate(prompt, max_new_tokens=6, steps=6, alg=alg), greedy.sequences)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.diffusion_generate(prompt, max_new_tokens=6, steps=3, alg=alg, temperature=0.8,
                                             top_p=0.9, top_k=20, alg_temp=0.5 if alg != "origin" else None))
    assert torch.equal(*runs) and not (runs[0] == dream.MASK_ID).any()


def test_dream_diffusion_generate_with_left_padding_and_length_checks():
    model = dream.tiny()
    prompt = tokens(2, 5)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    out = model.diffusion_generate(prompt, attention_mask=mask, max_new_tokens=4, steps=4, alg="entropy")
    assert out.shape == (2, 9) and not (out[:, 5:] == dream.MASK_ID).any()
    with pytest.raises(ValueError, match="max_length"):
        model.diffusion_generate(prompt, max_length=5, steps=2)


# ---------------------------------------------------------------- SDAR / TraDo

def test_sdar_output_names_and_config_fields():
    model = sdar.tiny()
    mask = sdar.block_diffusion_attention_mask(8, sdar.BLOCK_SIZE)
    out = model(tokens(), attention_mask=mask)
    assert isinstance(out, CausalLMOutputWithPast) and not hasattr(out, "last_hidden_state")
    assert isinstance(out.past_key_values, DynamicCache)  # config.use_cache is True
    assert model.config.block_size == sdar.BLOCK_SIZE and model.config.mask_token_id == sdar.MASK_ID
    assert type(model.get_decoder()).__name__ == "SDARModel" and model.supports_gradient_checkpointing
    assert sdar.get_num_transfer_tokens(8, 3).tolist() == [3, 3, 2]


def test_sdar_needs_a_tensor_mask_and_refuses_a_2d_padding_mask():
    model = sdar.tiny()
    x = tokens(2, 8)
    with pytest.raises(TypeError):
        model(x)
    full = model(x, attention_mask=torch.ones(1, 8, 8)).logits
    torch.testing.assert_close(model(x, attention_mask=torch.ones_like(x)).logits, full)  # all True: full attention
    padding = torch.ones_like(x)
    padding[1, :2] = 0
    with pytest.raises(RuntimeError):  # (B, L) broadcast against (L, L) scores
        model(x, attention_mask=padding)


def _block_causal_checks(logits_of, x, block):
    base = logits_of(x)
    length = x.shape[1]
    for changed in (1, 5, 6):
        y = x.clone()
        y[:, changed] = (y[:, changed] + 1) % 58
        moved = (logits_of(y) - base).abs().amax(dim=(0, 2)) > 1e-5
        first = changed // block * block
        assert not moved[:first].any(), "an earlier block saw a later token"
        assert moved[first:].all(), "its own block (earlier positions too) and later blocks must see it"
        assert length > first


def test_sdar_block_causal_attention_from_the_generate_mask():
    model = sdar.tiny()
    mask = sdar.block_diffusion_attention_mask(12, sdar.BLOCK_SIZE)
    _block_causal_checks(lambda x: model(x, attention_mask=mask).logits, tokens(2, 12), sdar.BLOCK_SIZE)


def test_sdar_kv_cache_store_and_read():
    model = sdar.tiny()
    x = tokens(2, 12)
    mask = sdar.block_diffusion_attention_mask(12, sdar.BLOCK_SIZE)
    full = model(x, attention_mask=mask).logits
    plain = DynamicCache()
    model(x[:, :8], attention_mask=mask[:, :8, :8], past_key_values=plain, use_cache=True, store_kv=True)
    assert plain.get_seq_length() == 8
    if TF5:
        with pytest.raises(TypeError, match="not subscriptable"):
            model(x[:, 8:], attention_mask=mask[:, 8:], past_key_values=plain, use_cache=True, store_kv=False)
    cache = sdar.SubscriptableCache()
    model(x[:, :8], attention_mask=mask[:, :8, :8], past_key_values=cache, use_cache=True, store_kv=True)
    block = model(x[:, 8:], attention_mask=mask[:, 8:], past_key_values=cache, use_cache=True, store_kv=False).logits
    torch.testing.assert_close(block, full[:, 8:], atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 8  # reading does not store
    model(x[:, 8:], attention_mask=mask[:, 8:], past_key_values=cache, use_cache=True, store_kv=True)
    assert cache.get_seq_length() == 12


# ---------------------------------------------------------------- LLaDA2

@needs_tf5
def test_llada2_default_forward_hits_the_removed_legacy_cache_api():
    with pytest.raises(AttributeError, match="from_legacy_cache"):
        llada2.tiny()(tokens())


def test_llada2_output_and_names():
    model = llada2.tiny()
    out = model(tokens(), use_cache=False)
    assert isinstance(out, MoeCausalLMOutputWithPast) and not hasattr(out, "last_hidden_state")
    assert out.logits.dtype == torch.float32
    assert model.get_input_embeddings() is model.model.word_embeddings
    layer = model.model.layers[1]
    assert hasattr(layer.attention, "query_key_value") and type(layer.mlp).__name__ == "LLaDA2MoeSparseMoeBlock"
    assert len(layer.mlp.experts) == 4 and type(model.model.layers[0].mlp).__name__ == "LLaDA2MoeMLP"


def test_llada2_one_padded_row_flips_the_whole_batch_to_causal():
    model = llada2.tiny()
    x = tokens()
    plain = model(x, use_cache=False).logits
    assert torch.equal(model(x, attention_mask=torch.ones_like(x), use_cache=False).logits, plain)
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    padded = model(x, attention_mask=mask, use_cache=False).logits
    causal = torch.full((8, 8), float("-inf")).triu(1).expand(2, 1, 8, 8)
    torch.testing.assert_close(padded[0], model(x, attention_mask=causal, use_cache=False).logits[0])
    assert not torch.allclose(padded[0], plain[0])


def test_llada2_block_causal_mask_and_its_shape_and_dtype_rules():
    model = llada2.tiny()
    mask = llada2.block_diffusion_attention_mask(12, 4, dtype=torch.float32)
    _block_causal_checks(lambda x: model(x, attention_mask=mask.expand(2, 1, 12, 12), use_cache=False).logits,
                         tokens(2, 12), 4)
    with pytest.raises(ValueError, match="Attention mask should be of size"):
        model(tokens(2, 12), attention_mask=mask, use_cache=False)
    with pytest.raises(RuntimeError, match="attn_mask dtype"):  # generate's bfloat16 mask on a float32 model
        model(tokens(1, 12), attention_mask=llada2.block_diffusion_attention_mask(12, 4), use_cache=False)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5.23 deprecates the module
def test_llada2_mask_rules_are_those_of_transformers_modeling_attn_mask_utils():
    masks = pytest.importorskip("transformers.modeling_attn_mask_utils", reason="removed in transformers 5.24")
    g = torch.Generator().manual_seed(0)
    for batch, q_len, past, dtype, kind in itertools.product((1, 3), (1, 5), (0, 3), (torch.float32, torch.bfloat16),
                                                             ("none", "ones", "padded", "4-d")):
        embeds, kv_len = torch.randn(batch, q_len, 4, generator=g).to(dtype), q_len + past
        mask = {"none": None, "ones": torch.ones(batch, kv_len, dtype=torch.long),
                "padded": (torch.rand(batch, kv_len, generator=g) < 0.7).long().index_fill(1, torch.tensor([0]), 0),
                "4-d": (torch.rand(batch, 1, q_len, kv_len, generator=g) < 0.7).to(dtype)}[kind]
        for sdpa, theirs in ((True, masks._prepare_4d_causal_attention_mask_for_sdpa), (False, masks._prepare_4d_causal_attention_mask)):
            expected, got = theirs(mask, (batch, q_len), embeds, past), llada2.released_attention_mask(mask, embeds, past, sdpa)
            case = (batch, q_len, past, dtype, kind, sdpa)
            assert (got is None) == (expected is None), case
            assert got is None or (got.dtype == expected.dtype and torch.equal(got, expected)), case


def test_llada2_generate_runs_in_bfloat16_and_greedy_is_reproducible():
    model = llada2.tiny(use_cache=False).to(torch.bfloat16)
    prompt = tokens(1, 5)
    kwargs = dict(block_length=4, steps=4, gen_length=8, eos_id=llada2.EOS_ID, mask_id=llada2.MASK_ID)
    first = model.generate(prompt, **kwargs)
    assert torch.equal(first[:, :5], prompt) and first.shape[1] <= 13
    assert torch.equal(model.generate(prompt, **kwargs), first)


# ---------------------------------------------------------------- transformers 5 loading, all families

HUB_DOUBLES = {"llada_moe": llada_moe, "dream": dream, "sdar": sdar, "llada2": llada2}


@needs_tf5
@pytest.mark.parametrize("name", sorted(HUB_DOUBLES))
def test_list_tied_weights_keys_break_save_pretrained(name, tmp_path):
    model = HUB_DOUBLES[name].tiny()
    assert isinstance(model._tied_weights_keys, list)
    with pytest.raises(AttributeError, match="'list' object has no attribute 'keys'"):
        model.save_pretrained(tmp_path)


def _inputs(name):
    if name == "sdar":
        return dict(attention_mask=sdar.block_diffusion_attention_mask(8, 4))
    if name == "llada2":
        return dict(use_cache=False)
    return {}


@needs_tf5
@pytest.mark.parametrize("name", sorted(HUB_DOUBLES))
def test_from_pretrained_leaves_rotary_buffers_uninitialised(name, tmp_path):
    model = HUB_DOUBLES[name].tiny()
    write_hub_checkpoint(model, tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    fresh, reloaded = rotary_buffers(model), rotary_buffers(loaded)
    assert fresh.keys() == reloaded.keys() and fresh
    for key in fresh:
        assert not torch.equal(fresh[key], reloaded[key]), key
    for key, value in model.state_dict().items():  # every saved weight came back
        torch.testing.assert_close(loaded.state_dict()[key], value)
    x = tokens()
    assert not torch.allclose(model(x, **_inputs(name)).logits, loaded(x, **_inputs(name)).logits)
    if name == "dream":
        assert type(loaded.generation_config).__name__ == "DreamGenerationConfig"
        assert loaded.generation_config.mask_token_id == dream.MASK_ID
