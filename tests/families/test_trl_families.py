"""``DiffusionGRPOTrainer`` on the family doubles: what users of LLaDA-8B, LLaDA-MoE and Dream /
DiffuCoder meet with TRL's defaults under transformers 5, and the trainer's answers to it.

- LLaDA-8B has no activation checkpointing (``gradient_checkpointing_enable()`` raises, and TRL turns
  ``gradient_checkpointing`` on by default): the decoder layers are checkpointed from outside
  (``daca_kernels.models.activation_checkpointing``): same gradients, and the layers really recompute.
- LLaDA-MoE has no ``generation_config`` (not a ``GenerationMixin``), which TRL's constructor reads.
- LLaDA-MoE and Dream declare tied weights as a list, which transformers 5's ``save_pretrained``
  refuses; their rotary frequencies come back as garbage from ``from_pretrained``.
- The reference model (``beta > 0``) of a policy whose class the Auto classes cannot find.
- LLaDA-8B's ``from_pretrained`` fails under transformers 5 (its ``__init__`` skips ``post_init()``).
- Per family: ``train()`` for 2 steps, ``save_model``, reload with the library's ``from_pretrained``
  (same weights and logits), and a resumed run equal to an uninterrupted one.

The doubles run on the task vocabulary of tests/trl_setup.py (their ids resized to it).
"""
import contextlib
import math

import pytest
import torch
from transformers import PreTrainedModel

pytest.importorskip("trl")

from support import assert_close_reduced, assert_model_gradients_close  # noqa: E402

from daca_kernels.models import families as known_families  # noqa: E402
from daca_kernels.models.activation_checkpointing import (  # noqa: E402
    checkpoint_layers,
    checkpointed_layers,
    decoder_layers,
    enable_checkpointing_fallback,
    uncheckpoint_layers,
)
from daca_kernels.models.model_loading import (  # noqa: E402
    default_generation_config,
    from_pretrained,
    repair_buffers,
    tied_weights_as_mapping,
)
from daca_kernels.rollout import generate  # noqa: E402
from daca_kernels.trl import trainer as daca_trainer  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from tests.trl_setup import family_model, family_trainer, straight_and_resumed  # noqa: E402

FAMILIES = ("llada", "llada_moe", "dream", "sdar", "llada2")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


def _tokens(model, rows=3, length=9, seed=1):
    return torch.randint(4, 14, (rows, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    """The model's own logits, called as its family's code needs (the block families with their
    block-causal mask, as released decoders pass it)."""
    family = known_families.recognise(model)
    block = model.config.block_size if family.block else None
    return model(input_ids=ids, **family.call_kwargs(ids, None, block, known_families.param_dtype(model))).logits


def _gradients(model, ids):
    model.zero_grad(set_to_none=True)
    logits = _logits(model, ids)
    loss = torch.log_softmax(logits.float(), -1)[..., 5:9].sum() / ids.numel()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- 1. activation checkpointing

def test_llada_checkpointing_fallback_same_gradients_and_recomputes():
    model = family_model("llada").train()
    with pytest.raises(ValueError):
        model.activation_checkpointing_enable()
    layers = decoder_layers(model)
    assert layers is model.model.transformer.blocks
    ids = _tokens(model)
    plain = _gradients(model, ids)
    keys = list(model.state_dict())
    calls = []
    for block in layers:
        block.attn_norm.register_forward_hook(lambda *args: calls.append(1))

    assert enable_checkpointing_fallback(model)
    model.activation_checkpointing_enable()  # what Trainer.train calls, now working
    assert checkpointed_layers(model) == list(range(len(layers)))
    calls.clear()
    checkpointed = _gradients(model, ids)
    # Every block ran twice: once in the forward, once recomputed in the backward.
    assert len(calls) == 2 * len(layers)
    assert_model_gradients_close(checkpointed, plain, what="checkpointed")
    assert list(model.state_dict()) == keys  # parameter names and checkpoints unchanged

    calls.clear()
    with torch.no_grad():
        _logits(model, ids)
    assert len(calls) == len(layers)  # no checkpointing without gradients (rollouts, reference passes)

    uncheckpoint_layers(model)
    assert checkpointed_layers(model) == []
    calls.clear()
    assert_model_gradients_close(_gradients(model, ids), plain, what="after uncheckpoint")
    assert len(calls) == len(layers)


def test_checkpoint_every_n_layers_and_native_support_left_alone():
    model = family_model("llada", n_layers=3).train()
    assert checkpoint_layers(model, every_n_layers=2) == [0, 2]
    assert checkpointed_layers(model) == [0, 2]
    with pytest.raises(ValueError, match="every_n_layers"):
        checkpoint_layers(model, every_n_layers=0)
    # LLaDA-MoE and Dream support transformers' own checkpointing: nothing is replaced.
    for family in ("llada_moe", "dream"):
        assert not enable_checkpointing_fallback(family_model(family))


def test_model_without_layers_is_left_alone():
    # Nothing to checkpoint: no fallback is installed, so the model's own error stays the one users see.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert not enable_checkpointing_fallback(model)
    with pytest.raises(ValueError, match="decoder layers"):
        decoder_layers(model)


def test_decoder_layers_of_a_zero3_partitioned_model_are_found_by_full_size():
    # A DeepSpeed ZeRO-3 partition holds no elements locally (numel 0) and carries its full size as
    # ds_numel: the layer list is still the one holding the most parameters.
    model = family_model("llada")
    for parameter in model.parameters():
        parameter.ds_numel = parameter.numel()
        parameter.data = parameter.data.new_empty(0)
    assert decoder_layers(model) is model.model.transformer.blocks


# ---------------------------------------------------------------- 2. generation config

def test_llada_moe_gets_a_generation_config_from_its_config(tmp_path):
    model = family_model("llada_moe")
    with pytest.raises(AttributeError):
        model.generation_config
    config = default_generation_config(model)
    assert model.generation_config is config
    assert (config.eos_token_id, config.pad_token_id) == (vocab.eos_id, vocab.pad_id)
    assert default_generation_config(model) is None  # a model that has one keeps it
    trainer = family_trainer(str(tmp_path), "llada_moe", beta=0.0)
    assert trainer.model.generation_config.eos_token_id == vocab.eos_id


# ---------------------------------------------------------------- 3. save and reload

@pytest.mark.parametrize("family", ["llada_moe", "dream"])
def test_list_tied_weights_save_and_reload(tmp_path, family):
    model = family_model(family)
    with pytest.raises(AttributeError, match="'list' object has no attribute 'keys'"):
        model.save_pretrained(tmp_path / "before")
    default_generation_config(model)
    assert tied_weights_as_mapping(model) == [""]
    assert model._tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert type(model)._tied_weights_keys == ["lm_head.weight"]  # the class is left as released
    model.save_pretrained(tmp_path / "saved")
    reloaded = type(model).from_pretrained(tmp_path / "saved")
    with pytest.warns(UserWarning, match="recomputed"):
        assert repair_buffers(reloaded)  # the rotary frequencies came back as uninitialised memory
    _assert_same_model(reloaded, model)


def _assert_same_model(got, want):
    want_state = want.state_dict()
    got_state = got.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        torch.testing.assert_close(got_state[name], tensor, rtol=0, atol=0, msg=name)
    got.eval(), want.eval()
    ids = _tokens(want)
    with torch.no_grad():
        torch.testing.assert_close(_logits(got, ids), _logits(want, ids), rtol=0, atol=0)


def _reload(family: str, path):
    """The saved checkpoint loaded with the family's class through the library's loader."""
    with pytest.warns(UserWarning, match="recomputed") if family != "llada" else contextlib.nullcontext():
        return from_pretrained(type(family_model(family)), path)


def test_llada_from_pretrained_needs_the_completed_construction(tmp_path):
    # LLaDA-8B's __init__ skips post_init(), which transformers 5's from_pretrained relies on.
    model = family_model("llada")
    cls = type(model)
    released = (vars(cls).get("__init__"), vars(PreTrainedModel)["from_pretrained"])
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(AttributeError, match="all_tied_weights_keys"):
        cls.from_pretrained(tmp_path / "saved")
    reloaded = from_pretrained(cls, tmp_path / "saved")
    _assert_same_model(reloaded, model)
    assert (vars(cls).get("__init__"), vars(PreTrainedModel)["from_pretrained"]) == released  # left as released
    with pytest.raises(AttributeError, match="all_tied_weights_keys"):
        type(model).from_pretrained(tmp_path / "saved")
    with pytest.raises(TypeError, match="model_class"):
        from_pretrained("LLaDAModelLM", tmp_path / "saved")


# ---------------------------------------------------------------- 4. reference model

def test_reference_model_copies_a_policy_the_auto_classes_cannot_find(tmp_path):
    # The double is registered with no Auto class, and a model built in memory has no name or path:
    # TRL's reload of config._name_or_path cannot build it. The reference is the policy's copy.
    policy = family_model("llada")
    assert policy.config._name_or_path == ""
    # seed 1: a group whose rewards differ (the random double's four completions under seed 0 all
    # score zero, and a zero advantage leaves the policy where it is).
    trainer = family_trainer(str(tmp_path), "llada", model=policy, beta=0.04, max_steps=1, seed=1)
    reference = trainer.ref_model
    assert type(reference) is type(policy) and reference is not trainer.model
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(p, initial[name], rtol=0, atol=0, msg=name)
    trainer.train()
    assert trainer.state.log_history[0]["reward_std"] > 0, "the group's rewards must differ for the policy to move"
    assert any(not torch.equal(p, initial[n]) for n, p in trainer.model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(p, initial[name], rtol=0, atol=0, msg=f"reference moved: {name}")
    assert any("kl_mean" in log for log in trainer.state.log_history)


def test_reference_model_of_a_reloaded_policy(tmp_path):
    # Loaded from a checkpoint (a real _name_or_path whose config names no Auto class): the copy is of
    # the loaded and repaired policy, rotary frequencies included.
    model = family_model("llada_moe")
    tied_weights_as_mapping(model)
    model.save_pretrained(tmp_path / "policy")
    policy = type(model).from_pretrained(tmp_path / "policy")
    with pytest.warns(UserWarning, match="recomputed: model.rotary_emb.inv_freq"):
        trainer = family_trainer(str(tmp_path), "llada_moe", model=policy, beta=0.04)
    assert type(trainer.ref_model) is type(model)
    _assert_same_model(trainer.ref_model, model)
    _assert_same_model(trainer.model, model)  # the trainer repaired the policy's buffers too


# ---------------------------------------------------------------- 5, 6. end to end, resume

@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_saves_and_reloads(tmp_path, family):
    trainer = family_trainer(str(tmp_path), family, max_steps=2, beta=0.04)
    assert trainer.args.gradient_checkpointing  # TRL's default, kept
    assert trainer.shift == (family == "dream")  # Dream's shifted logits, found from the model
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    if family == "llada":
        assert checkpointed_layers(trainer.model)  # the fallback, applied by Trainer.train
    trainer.save_model(str(tmp_path / "final"))
    _assert_same_model(_reload(family, tmp_path / "final"), trainer.model)


def test_dream_rollouts_in_dreams_own_sampler(tmp_path, monkeypatch):
    # sampling_rule="dream": the trainer's rollouts are generate(rule="dream") with Dream's options.
    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(daca_trainer, "generate", recorded)
    trainer = family_trainer(str(tmp_path), "dream", max_steps=1, sampling_rule="dream", sampling_alg="entropy",
                             sampling_alg_temp=0.5, top_p=0.9, top_k=5)
    assert trainer.train().global_step == 1 and calls
    options = {name: calls[0][name] for name in ("rule", "alg", "alg_temp", "eps", "top_p", "top_k", "block_length",
                                                  "mask_candidate")}
    assert options == dict(rule="dream", alg="entropy", alg_temp=0.5, eps=None, top_p=0.9, top_k=5,
                           block_length=None, mask_candidate="exclude")
    assert "remasking" not in calls[0]


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_models_decode_block_by_block_with_their_own_block_size(tmp_path, monkeypatch, family):
    calls = []

    def recorded(lm, *args, **kwargs):
        calls.append((lm.attention, kwargs))
        return generate(lm, *args, **kwargs)

    monkeypatch.setattr(daca_trainer, "generate", recorded)
    trainer = family_trainer(str(tmp_path), family, max_steps=1, diffusion_steps=4, sampling_threshold=0.9,
                             objective="bgpo", estimator="stratified", num_strata=2)
    size = trainer.attention[1]
    assert trainer.attention == ("block", 4)
    expected_steps = max(1, min(size, 4 * size // trainer.args.max_completion_length))
    assert trainer.sampler_options == dict(rule="llada", mask_candidate="exclude", block_length=None,
                                           steps=expected_steps, threshold=0.9)
    assert trainer.train().global_step == 1
    attention, kwargs = calls[0]
    assert attention == ("block", 4) and kwargs["threshold"] == 0.9 and kwargs["steps"] == expected_steps


def test_block_models_refuse_the_sampling_correction(tmp_path):
    # Their rollouts are their exact block-wise decode, which records no sampling log-probabilities.
    with pytest.raises(ValueError, match="^sampling_importance_sampling_correction"):
        family_trainer(str(tmp_path), "sdar", sampling_importance_sampling_correction=True)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_models_train_dispo_from_a_state_every_decode_reaches(tmp_path, monkeypatch, family):
    rollouts = []

    def recorded(lm, *args, **kwargs):
        rollouts.append((kwargs["branch_steps"], kwargs["steps"], generate(lm, *args, **kwargs)))
        return rollouts[-1][2]

    monkeypatch.setattr(daca_trainer, "generate", recorded)
    trainer = family_trainer(str(tmp_path), family, max_steps=1, diffusion_steps=8, objective="dispo",
                             dispo_branch_fraction=0.9, dispo_fillings=2)
    assert trainer.train().global_step == 1 and rollouts
    size, length = trainer.attention[1], trainer.args.max_completion_length
    for branch_steps, per_block, rollout in rollouts:
        cap = per_block * max(length // size - 1, 0)
        assert branch_steps == [min(int(0.9 * 8), cap)]
        (state,) = rollout.branches
        assert state.step == branch_steps[0] and bool(state.masked.any())
    assert trainer.state.log_history[0]["dispo/filling_reward"] is not None


@pytest.mark.parametrize("options, name", [
    (dict(sampling_rule="dream"), "sampling_rule"),
    (dict(remasking="random"), "remasking"),
    (dict(block_length=2), "block_length"),
    (dict(objective="dispo", sampling_threshold=0.9), "sampling_threshold"),
])
def test_block_models_refuse_what_their_decoding_cannot_honour(tmp_path, options, name):
    with pytest.raises(ValueError, match="^" + name):
        family_trainer(str(tmp_path), "sdar", **options)


def test_full_attention_models_take_the_threshold_and_the_cache_under_llada_rule(tmp_path):
    trainer = family_trainer(str(tmp_path), "llada", sampling_threshold=0.9, sampling_kv_cache="prefix")
    options = trainer.args.sampler_options("full")
    assert (options["threshold"], options["kv_cache"]) == (0.9, "prefix")
    with pytest.raises(ValueError, match="^sampling_kv_cache"):
        trainer.args.sampler_options(("block", 4))
    trainer.args.objective = "dispo"  # DiSPO's branch step may be skipped by a threshold
    with pytest.raises(ValueError, match="^sampling_threshold"):
        trainer.args.sampler_options("full")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_resumed_run_equals_uninterrupted(tmp_path, family):
    # 4 steps (2 generations of 2 inner iterations) straight, or 2 steps, a checkpoint, and a new
    # trainer resuming from it: same parameters.
    settings = dict(num_iterations=2, max_steps=4, num_prompts=8, save_strategy="steps", save_steps=2, beta=0.04)
    straight, resumed, _ = straight_and_resumed(lambda folder: family_trainer(str(folder), family, **settings),
                                                tmp_path)
    for (name, want), got in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert_close_reduced(got, want, n=64, what=name)  # the doubles' MLP width: their longest reduction

