"""``daca_kernels.trl``: the TRL trainer trains, equals the library's estimators and losses on one
batch, reproduces its masks, splits over two processes, and refuses bad options.

The tiny setup (tests/trl_setup.py) runs the library's chunked PyTorch path (``DACA_BACKEND=torch``):
what is checked here is the trainer's plumbing; the kernels are checked against the same path
elsewhere.
"""
import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytest.importorskip("trl")

from support import assert_close_reduced  # noqa: E402
from trl.trainer.utils import get_config_model_id  # noqa: E402

from daca_kernels import bgpo_loss, branch_logprob, dispo_step_loss, elbo_sample_scores, grpo_loss, spg_loss  # noqa: E402
from daca_kernels.likelihood import estimate_logprob, masked_logprob, monte_carlo_masks  # noqa: E402
from daca_kernels.models.masked_lm import MaskedLM  # noqa: E402
from daca_kernels.presets import PRESETS  # noqa: E402
from daca_kernels.trl import (  # noqa: E402
    DiffusionGRPOTrainer,
    EpochRepeatSampler,
    rollout_advantages,
)
from integration.model import ModelConfig, build_model  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from tests.trl_setup import (  # noqa: E402
    ROWS,
    TINY,
    StopAfter,
    digit_reward,
    estimator_batch,
    sort_dataset,
    sort_reward,
    sort_tokenizer,
    tiny_config,
    tiny_trainer,
)

ROOT = Path(__file__).resolve().parents[2]


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


def first_batch(trainer: DiffusionGRPOTrainer) -> dict:
    """The inputs of the first training step (``train()`` would set the accumulation count)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


@pytest.mark.parametrize("preset", ["diffu-grpo", "daca-grpo", "dispo+DACA"])
def test_trains_three_steps(tmp_path, preset):
    # daca-grpo and DiSPO with DACA: SML K = 4 and DPS; with two inner iterations (old
    # log-probabilities) and a KL to the reference model.
    extra = dict(num_iterations=2, beta=0.05) if preset != "diffu-grpo" else {}
    trainer = tiny_trainer(str(tmp_path), preset=preset, **extra)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 3
    assert math.isfinite(result.training_loss)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no parameter changed"
    if preset != "diffu-grpo":
        assert any("kl_mean" in log for log in trainer.state.log_history)
    if preset == "dispo+DACA":
        steps = [log["dispo/step_loss"] for log in trainer.state.log_history if "dispo/step_loss" in log]
        assert len(steps) == 3 and all(math.isfinite(v) for v in steps)
        # The second update of a generation is off-policy: its step ratios moved away from 1.
        assert any(log.get("dispo/ratio_mean", 1.0) != 1.0 for log in trainer.state.log_history)


def _lm(trainer) -> MaskedLM:
    return MaskedLM.from_hf(trainer.model, mask_id=vocab.mask_id)


ESTIMATOR_SETTINGS = {
    "one_step": dict(estimator="one_step", prompt_mask_prob=0.15),
    "stratified": dict(estimator="stratified", num_strata=3),
    "coupled": dict(estimator="coupled"),
    "elbo": dict(estimator="elbo", elbo_samples=2),
}


@pytest.mark.parametrize("name", list(ESTIMATOR_SETTINGS))
def test_grpo_parity_one_batch(tmp_path, name):
    settings = ESTIMATOR_SETTINGS[name]
    trainer = tiny_trainer(str(tmp_path), dps=True, loss_type="grpo", **settings)
    inputs = first_batch(trainer)
    seed = inputs["mask_seeds"][0]
    assert inputs["loss_mask"].any() and torch.equal(inputs["loss_mask"] & ~inputs["completion_mask"],
                                                     torch.zeros_like(inputs["loss_mask"]))
    got = trainer.per_token_logps(trainer.model, inputs, seed)
    expected = estimate_logprob(_lm(trainer), inputs["input_ids"], inputs["completion_mask"], inputs["loss_mask"],
                                inputs["attention_mask"], seed=seed, **{"num_strata": 4, "elbo_samples": 2,
                                                                        "prompt_mask_prob": 0.0, **settings})
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    loss = trainer.compute_loss(trainer.model, inputs)
    expected_loss, _ = grpo_loss(expected, None, inputs["advantages"], inputs["loss_mask"],
                                 token_weights=inputs["token_weights"], loss_type="grpo")
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)


def test_dapo_normaliser_is_the_global_token_count(tmp_path):
    trainer = tiny_trainer(str(tmp_path), estimator="stratified", num_strata=2)
    inputs = first_batch(trainer)
    logp = estimate_logprob(_lm(trainer), inputs["input_ids"], inputs["completion_mask"], inputs["loss_mask"],
                            inputs["attention_mask"], estimator="stratified", num_strata=2, seed=inputs["mask_seeds"][0])
    expected, _ = grpo_loss(logp, None, inputs["advantages"], inputs["loss_mask"], loss_type="dapo",
                            num_items_in_batch=inputs["loss_mask"].sum())
    torch.testing.assert_close(trainer.compute_loss(trainer.model, inputs), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("objective", ["bgpo", "spg"])
def test_elbo_objective_parity_one_batch(tmp_path, objective):
    trainer = tiny_trainer(str(tmp_path), objective=objective, estimator="elbo", elbo_samples=3, dps=True)
    inputs = first_batch(trainer)
    seed = inputs["mask_seeds"][0]
    samples = monte_carlo_masks(inputs["input_ids"], inputs["completion_mask"], inputs["loss_mask"],
                                inputs["attention_mask"], estimator="elbo", elbo_samples=3, seed=seed,
                                mask_id=vocab.mask_id)
    lm = _lm(trainer)
    logp = torch.stack([masked_logprob(lm, inputs["input_ids"], s.masked, loss_mask=s.scored,
                                       attention_mask=inputs["attention_mask"]) for s in samples])
    scored = torch.stack([s.scored for s in samples])
    t = torch.stack([s.t for s in samples]).float()
    weights = inputs["token_weights"]
    if objective == "bgpo":
        scores = elbo_sample_scores(logp, scored, t, token_weights=weights)
        expected, _ = bgpo_loss(scores, scores.detach(), inputs["advantages"])
    else:
        expected, _ = spg_loss(logp, scored, t, inputs["loss_mask"], inputs["advantages"], negative_bound="mix",
                               token_weights=weights, num_items_in_batch=inputs["loss_mask"].sum())
    # BGPO back-propagates sample by sample: all but the last sample inside compute_loss, the last
    # through the returned loss (as the trainer's training_step does); the gradients are those of the
    # loss on all samples at once.
    backward_calls = []
    backward = trainer.accelerator.backward
    trainer.accelerator.backward = lambda loss, **kwargs: backward_calls.append(loss) or backward(loss, **kwargs)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    assert len(backward_calls) == (len(samples) - 1 if objective == "bgpo" else 0)
    loss.backward()
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    expected.backward()
    want = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and any(g.abs().max() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def _parameter_grads(model, loss) -> list:
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True,
                               retain_graph=True)


def test_dispo_parity_one_batch(tmp_path):
    # DiSPO with DACA, Z = 3 fillings, alpha = 0.7, two inner iterations (so the old step
    # log-probabilities are computed at generation). The branch state is the rollout at the start of
    # step 1 of 2; the fillings complete its masked positions; their rewards are the reward
    # functions' on the decoded fillings; the loss is grpo_loss plus 0.7 * dispo_step_loss on
    # branch_logprob of the same states, in value and in gradient.
    alpha, z = 0.7, 3
    trainer = tiny_trainer(str(tmp_path), preset="dispo+DACA", num_strata=2, dispo_fillings=z, dispo_alpha=alpha,
                           loss_type="grpo", num_iterations=2)
    inputs = first_batch(trainer)
    state, filled, fillings, rewards = (inputs[k] for k in ("branch_state", "branch_filled", "branch_fillings",
                                                            "branch_rewards"))
    ids, completion, attention = inputs["input_ids"], inputs["completion_mask"], inputs["attention_mask"]
    assert fillings.shape == (ROWS, z, ids.shape[1]) and rewards.shape == (ROWS, z)
    assert torch.equal(filled, state == vocab.mask_id) and not (filled & ~completion).any()
    assert (filled.sum(1) == completion.sum(1) // 2).all()
    assert torch.equal(state[~filled], ids[~filled]), "committed tokens stay"
    each = filled[:, None].expand_as(fillings)
    assert torch.equal(fillings[~each], state[:, None].expand_as(fillings)[~each])
    assert (fillings[each] != vocab.mask_id).all()
    assert not all(torch.equal(fillings[:, 0], fillings[:, j]) for j in range(1, z)), "the fillings differ"

    tokenizer = trainer.processing_class
    start = int(completion[0].nonzero()[0])
    answers = dict(zip(*sort_dataset(4)[:].values()))
    prompts, texts = [], []
    for b in range(ROWS):
        prompt = tokenizer.decode(ids[b, :start][attention[b, :start].bool()])
        for j in range(z):
            tokens = fillings[b, j, start:].tolist()
            tokens = tokens[:tokens.index(vocab.eos_id)] if vocab.eos_id in tokens else tokens
            prompts.append(prompt)
            texts.append(tokenizer.decode(tokens, skip_special_tokens=True))
    expected_rewards = torch.tensor(sort_reward(prompts, texts, [answers[p] for p in prompts])) + torch.tensor(
        digit_reward(prompts, texts))
    torch.testing.assert_close(rewards.flatten(), expected_rewards)

    lm = _lm(trainer)
    step_filled = filled.repeat_interleave(z, dim=0)
    step_logp = branch_logprob(lm, state, fillings.flatten(0, 1), step_filled, attention_mask=attention)
    assert inputs["old_iterations"] == [0, 1]
    assert_close_reduced(inputs["branch_old"].flatten(0, 1), step_logp, n=TINY.intermediate_size)
    # Fixed random rewards and advantages, so that every row carries gradient.
    generator = torch.Generator().manual_seed(1)
    inputs["branch_rewards"] = torch.rand(ROWS, z, generator=generator)
    inputs["advantages"] = torch.randn(ROWS, generator=generator)
    seed = inputs["mask_seeds"][0]
    logp = estimate_logprob(lm, ids, completion, inputs["loss_mask"], attention, estimator="stratified", num_strata=2,
                            seed=seed)
    base, _ = grpo_loss(logp, inputs["old"][:, 0], inputs["advantages"], inputs["loss_mask"],
                        token_weights=inputs["token_weights"], loss_type="grpo")
    step, _ = dispo_step_loss(step_logp, inputs["branch_old"].flatten(0, 1), step_filled,
                              inputs["branch_rewards"].flatten(), z, num_items_in_batch=step_filled.sum())
    expected = base + alpha * step
    loss = trainer.compute_loss(trainer.model, inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    step_grads = _parameter_grads(trainer.model, step)
    assert any(g is not None and g.abs().max() > 0 for g in step_grads), "the step loss carries gradient"
    for got, want in zip(_parameter_grads(trainer.model, loss), _parameter_grads(trainer.model, expected)):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_resuming_from_a_checkpoint_continues_the_run(tmp_path):
    # 4 steps (2 generations of 2 inner iterations) straight through, or 2 steps, a checkpoint, and a
    # new trainer resuming from it: the same rollouts, masks and updates, so the same parameters.
    settings = dict(preset="dispo+DACA", num_iterations=2, max_steps=4, num_prompts=8, save_strategy="steps",
                    save_steps=2)
    straight = tiny_trainer(str(tmp_path / "straight"), **settings)
    straight.train()
    interrupted = tiny_trainer(str(tmp_path / "split"), **settings)
    interrupted.add_callback(StopAfter(2))
    interrupted.train()
    assert interrupted.state.global_step == 2
    resumed = tiny_trainer(str(tmp_path / "split"), **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for (name, want), got in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert_close_reduced(got, want, n=TINY.intermediate_size, what=name)


def _rewards_after(trainer, step: int) -> list:
    return [(log["step"], log["reward"]) for log in trainer.state.log_history if "reward" in log and log["step"] > step]


def test_resuming_in_a_later_epoch_continues_the_run(tmp_path):
    # 3 prompts, one per generation (num_iterations = 1): an epoch is 3 steps, and the sampler draws a
    # new order of the prompts in each epoch. A run resumed at the end of epoch 0 (step 3) or inside
    # epoch 1 (step 4) trains on the uninterrupted run's prompts: same parameters, same logged rewards.
    settings = dict(num_prompts=3, max_steps=7)
    orders = []
    for epoch in (0, 1):
        sampler = EpochRepeatSampler(range(3), mini_repeat_count=1, seed=0)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] != orders[1], "the test needs epochs whose orders differ"
    straight = tiny_trainer(str(tmp_path / "straight"), **settings)
    straight.train()
    assert straight.state.epoch > 2
    interrupted = tiny_trainer(str(tmp_path / "split"), save_strategy="steps", save_steps=1, **settings)
    interrupted.add_callback(StopAfter(4))
    interrupted.train()
    for step in (3, 4):
        resumed = tiny_trainer(str(tmp_path / f"resumed{step}"), **settings)
        resumed.train(resume_from_checkpoint=str(tmp_path / "split" / f"checkpoint-{step}"))
        assert resumed.state.global_step == 7
        assert _rewards_after(resumed, step) == _rewards_after(straight, step)
        for (name, want), got in zip(straight.model.named_parameters(), resumed.model.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"resumed at {step}: {name}")


def test_second_trainer_on_a_model_trained_in_bf16(tmp_path):
    # A bf16 run leaves accelerate's autocast wrapper in the model's forward; the next trainer's check of
    # the architecture runs the class's forward (the wrapper's bf16 logits are off by about 2x the
    # float32 tolerance on this model) and puts the instance's forward back.
    model = build_model(ModelConfig(hidden_size=96, num_layers=2, num_heads=2, intermediate_size=192, max_length=16), 0)

    def trainer(name: str) -> DiffusionGRPOTrainer:
        args = tiny_config(str(tmp_path / name), bf16=True, max_steps=1)
        return DiffusionGRPOTrainer(model=model, reward_funcs=[sort_reward], args=args, train_dataset=sort_dataset(4),
                                    processing_class=sort_tokenizer())

    trainer("first").train()
    second = trainer("second")
    forward = model.__dict__["forward"]
    second._check_model()
    assert model.__dict__["forward"] is forward
    second.train()
    assert second.state.global_step == 1


def test_reward_function_logs_follow_the_completions(tmp_path):
    # A reward function's log_extra columns and log_metric values reach TRL's logs once per rollout
    # completion; DiSPO's fillings, scored by the same function, add nothing to them.
    def logging_reward(prompts, completions, log_extra, log_metric, **kwargs):
        log_extra("text", list(completions))
        log_metric("scored", float(len(completions)))
        return [0.0] * len(completions)

    trainer = tiny_trainer(str(tmp_path), objective="dispo", max_steps=2)
    trainer.reward_funcs.append(logging_reward)
    trainer.reward_func_names.append("logging_reward")
    trainer.reward_processing_classes.append(None)
    trainer.reward_weights = torch.ones(3)
    trainer.train()
    assert list(trainer._logs["extra"]["text"]) == list(trainer._logs["completion"])
    assert [log["scored"] for log in trainer.state.log_history if "scored" in log] == [4.0, 4.0]


def test_old_and_reference_passes_rebuild_the_masks(tmp_path):
    # Before any update, the old (and reference) values of inner iteration 1, computed at generation,
    # equal the current pass of that iteration: the masks come back from the seed. (Iteration 0 also
    # gets old values: TRL's rule, as gradient_accumulation_steps = 1 is not a multiple of
    # steps_per_generation * num_iterations = 2.)
    trainer = tiny_trainer(str(tmp_path), preset="daca-grpo", num_iterations=2, beta=0.05)
    first = first_batch(trainer)
    assert first["old_iterations"] == [0, 1] and first["iteration"] == 0
    trainer._step = 1
    second = trainer._prepare_inputs(None)
    assert second["iteration"] == 1 and second["input_ids"] is first["input_ids"]
    current = trainer.per_token_logps(trainer.model, second, second["mask_seeds"][1])
    assert_close_reduced(second["old"][:, 1], current, n=TINY.intermediate_size)
    assert_close_reduced(second["ref"][:, 1], current, n=TINY.intermediate_size)
    assert len(set(second["mask_seeds"])) == 2


def test_rows_of_a_shard_get_the_masks_of_the_whole_batch(tmp_path):
    trainer = tiny_trainer(str(tmp_path), estimator="elbo", elbo_samples=2)
    inputs = first_batch(trainer)
    seed = inputs["mask_seeds"][0]
    whole = trainer.per_token_logps(trainer.model, inputs, seed)
    shard = {k: v[2:] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()}
    assert_close_reduced(trainer.per_token_logps(trainer.model, shard, seed), whole[2:], n=TINY.intermediate_size)


# Two prompts' groups of G = 4 rewards, and each peer's advantages of them by hand.
PEER_REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0, 0.0])
MINUS_MEAN = torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, 1.0, -1.0, -1.0])  # d1, SPG: r - mean, not divided by the std
# DiffuCoder: r - the mean of the group's other rewards.
LEAVE_ONE_OUT = torch.tensor([2 / 3, -2 / 3, 0.0, 0.0, 4 / 3, 4 / 3, -4 / 3, -4 / 3])
# TRL's GRPO (the presets with no released trainer to follow): divided by the group's sample std + 1e-4
# (sample variances 1/6 and 4/3).
GROUP_SCALED = MINUS_MEAN / (torch.tensor([1 / 6] * 4 + [4 / 3] * 4).sqrt() + 1e-4)
PEER_ADVANTAGES = {"diffu-grpo": MINUS_MEAN, "daca-grpo": MINUS_MEAN, "grpo": MINUS_MEAN, "grpo+DACA": MINUS_MEAN,
                   "sml-only": MINUS_MEAN, "dps-only": MINUS_MEAN, "elbo-mc": MINUS_MEAN,
                   "spg": MINUS_MEAN, "spg+DACA": MINUS_MEAN,
                   "coupled": LEAVE_ONE_OUT, "coupled+DACA": LEAVE_ONE_OUT,
                   "bgpo": GROUP_SCALED, "bgpo+DACA": GROUP_SCALED, "dispo": GROUP_SCALED, "dispo+DACA": GROUP_SCALED}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_use_their_peers_advantages(tmp_path, preset):
    assert PEER_ADVANTAGES.keys() == PRESETS.keys()
    config = tiny_config(str(tmp_path), preset=preset)
    torch.testing.assert_close(rollout_advantages(config, PEER_REWARDS, 4), PEER_ADVANTAGES[preset])


def test_given_advantage_options_win_over_the_preset(tmp_path):
    config = tiny_config(str(tmp_path), preset="coupled", scale_rewards=True, leave_one_out=False)
    assert (config.scale_rewards, config.leave_one_out) == ("group", False)
    torch.testing.assert_close(rollout_advantages(config, PEER_REWARDS, 4), GROUP_SCALED)
    plain = tiny_config(str(tmp_path))
    assert (plain.scale_rewards, plain.leave_one_out) == ("group", False)


def test_trainer_trains_on_the_presets_advantages(tmp_path):
    # DiffuCoder's recipe: the batch's advantages are the leave-one-out ones of its logged rewards.
    trainer = tiny_trainer(str(tmp_path), preset="coupled")
    inputs = first_batch(trainer)
    logged = trainer._logs["rewards"]
    rewards = torch.tensor(logged["sort_reward"]) + torch.tensor(logged["digit_reward"])
    grouped = rewards.view(-1, 4)
    expected = (grouped - (grouped.sum(1, keepdim=True) - grouped) / 3).flatten()
    assert expected.abs().max() > 0
    torch.testing.assert_close(inputs["advantages"], expected)


def test_preset_fills_what_is_not_given(tmp_path):
    config = tiny_config(str(tmp_path), preset="daca-grpo", num_strata=2)
    assert (config.objective, config.estimator, config.num_strata, config.dps) == ("grpo", "stratified", 2, True)
    plain = tiny_config(str(tmp_path))
    assert (plain.objective, plain.estimator, plain.prompt_mask_prob, plain.dps) == ("grpo", "one_step", 0.0, False)
    assert tiny_config(str(tmp_path), preset="diffu-grpo").prompt_mask_prob == 0.15


@pytest.mark.parametrize("kv_cache", [None, "prefix"])
def test_the_sampling_correction_weights_the_tokens_and_is_logged(tmp_path, kv_cache):
    # Blocks of 2 over 6 steps: the prefix cache serves the second step of each block. Two layers: with
    # one, the cached keys of the prefix do not depend on the block being decoded (no gap).
    path = tmp_path / "policy"
    build_model(dataclasses.replace(TINY, num_layers=2), 0).save_pretrained(path)
    args = tiny_config(str(tmp_path), sampling_kv_cache=kv_cache, block_length=2, diffusion_steps=6, max_steps=1,
                       sampling_importance_sampling_correction=True, sampling_importance_sampling_cap=2.0)
    trainer = DiffusionGRPOTrainer(model=str(path), reward_funcs=[sort_reward], args=args,
                                   train_dataset=sort_dataset(4), processing_class=sort_tokenizer())
    batch = first_batch(trainer)
    weights, answer = batch["token_weights"], batch["loss_mask"]
    assert bool((weights <= 2.0).all()) and bool((weights[~answer] == 1.0).all())
    if kv_cache is None:  # exact rollouts: the sampled distribution is the scored one
        torch.testing.assert_close(weights, torch.ones_like(weights), rtol=0.0, atol=1e-5)
    else:
        assert float((weights[answer] - 1.0).abs().max()) > 1e-3
    trainer.train()
    logged = [log for log in trainer.state.log_history if "sampling/logp_gap_abs_mean" in log]
    assert logged and all(math.isfinite(log["sampling/truncated_fraction"]) for log in logged)
    assert (logged[0]["sampling/logp_gap_abs_mean"] > 1e-3) == (kv_cache is not None)


NAN = float("nan")


@pytest.mark.parametrize("options, name, error", [
    # The options this config adds.
    (dict(preset="grpo++"), "preset", ValueError),
    (dict(objective="ppo"), "objective", ValueError),
    (dict(estimator="exact"), "estimator", ValueError),
    (dict(objective="bgpo", estimator="one_step"), "estimator", ValueError),
    (dict(num_strata=0), "num_strata", ValueError),
    (dict(num_strata=2.5), "num_strata", TypeError),
    (dict(elbo_samples=0), "elbo_samples", ValueError),
    (dict(prompt_mask_prob=1.5), "prompt_mask_prob", ValueError),
    (dict(prompt_mask_prob=NAN), "prompt_mask_prob", ValueError),
    (dict(prompt_mask_prob="0.1"), "prompt_mask_prob", TypeError),
    (dict(mask_block_length=0), "mask_block_length", ValueError),
    (dict(mask_block_choice="random"), "mask_block_choice", ValueError),
    (dict(dps="yes"), "dps", TypeError),
    (dict(dps_variant="future"), "dps_variant", ValueError),
    (dict(dps_scale=-1.0), "dps_scale", ValueError),
    (dict(dps_scale=NAN), "dps_scale", ValueError),
    (dict(dps_clip=[2.0, 1.0]), "dps_clip", ValueError),
    (dict(dps_clip=[0.0, 1.0]), "dps_clip", ValueError),
    (dict(dps_clip=["a", "b"]), "dps_clip", TypeError),
    (dict(dps_clip=[1.0]), "dps_clip", TypeError),
    (dict(spg_bound="kl"), "spg_bound", ValueError),
    (dict(spg_beta=0.5), "spg_beta", ValueError),
    (dict(spg_mix_weight=1.5), "spg_mix_weight", ValueError),
    (dict(dispo_fillings=1), "dispo_fillings", ValueError),
    (dict(dispo_alpha=-0.5), "dispo_alpha", ValueError),
    (dict(dispo_branch_fraction=1.0), "dispo_branch_fraction", ValueError),
    (dict(diffusion_steps=0), "diffusion_steps", ValueError),
    (dict(block_length=0), "block_length", ValueError),
    (dict(block_length=4, max_completion_length=6), "max_completion_length", ValueError),
    (dict(diffusion_steps=3, block_length=2, max_completion_length=4), "diffusion_steps", ValueError),
    (dict(remasking="top_k"), "remasking", ValueError),
    (dict(sampling_rule="maskgit"), "sampling_rule", ValueError),
    (dict(mask_candidate="dream"), "mask_candidate", ValueError),
    (dict(sampling_alg="entropy"), "sampling_alg", ValueError),
    (dict(sampling_eps=0.01), "sampling_eps", ValueError),
    (dict(top_p=0.9), "top_p", ValueError),
    (dict(top_k=5), "top_k", ValueError),
    (dict(sampling_rule="dream", remasking="random"), "remasking", ValueError),
    (dict(sampling_rule="dream", block_length=2), "block_length", ValueError),
    (dict(sampling_rule="dream", sampling_alg="margin"), "sampling_alg", ValueError),
    (dict(sampling_rule="dream", sampling_alg_temp=-1.0), "sampling_alg_temp", ValueError),
    (dict(sampling_rule="dream", sampling_eps=1.0), "sampling_eps", ValueError),
    (dict(sampling_rule="dream", top_p=0.0), "top_p", ValueError),
    (dict(sampling_rule="dream", top_k=-1), "top_k", ValueError),
    (dict(sampling_threshold=1.5), "sampling_threshold", ValueError),
    (dict(sampling_rule="dream", sampling_threshold=0.9), "sampling_threshold", ValueError),
    (dict(sampling_kv_cache="suffix"), "sampling_kv_cache", ValueError),
    (dict(sampling_rule="dream", sampling_kv_cache="prefix"), "sampling_kv_cache", ValueError),
    (dict(sampling_importance_sampling_correction="yes"), "sampling_importance_sampling_correction", TypeError),
    (dict(sampling_importance_sampling_mode="sequence_mask"), "sampling_importance_sampling_mode", ValueError),
    (dict(sampling_importance_sampling_cap=-1.0), "sampling_importance_sampling_cap", ValueError),
    (dict(sampling_importance_sampling_correction=True, objective="bgpo", estimator="elbo"),
     "sampling_importance_sampling_correction", ValueError),
    (dict(mask_token_id=-1), "mask_token_id", ValueError),
    (dict(shift_logits="no"), "shift_logits", TypeError),
    (dict(use_bias_correction_kl=1), "use_bias_correction_kl", TypeError),
    (dict(leave_one_out="yes"), "leave_one_out", TypeError),
    # TRL's options this trainer reads and TRL does not check.
    (dict(temperature=-1.0), "temperature", ValueError),
    (dict(temperature=NAN), "temperature", ValueError),
    (dict(temperature="hot"), "temperature", TypeError),
    (dict(seed=-1), "seed", ValueError),
    (dict(num_iterations=0), "num_iterations", ValueError),
    (dict(steps_per_generation=0), "steps_per_generation", ValueError),
    (dict(shuffle_dataset="yes"), "shuffle_dataset", TypeError),
    (dict(scale_rewards="std"), "scale_rewards", ValueError),
    (dict(num_generations_eval=1, leave_one_out=True), "num_generations_eval", ValueError),
    (dict(reward_weights=[1.0, NAN]), "reward_weights", ValueError),
    (dict(beta=-0.1), "beta", ValueError),
    (dict(beta=0.04, objective="spg", estimator="elbo"), "beta", ValueError),
    (dict(loss_type="ppo"), "loss_type", ValueError),
    (dict(importance_sampling_level="seq"), "importance_sampling_level", ValueError),
    (dict(epsilon=1.0), "epsilon", ValueError),
    (dict(epsilon_high=-0.1), "epsilon_high", ValueError),
    (dict(loss_type="cispo"), "epsilon_high", ValueError),
    (dict(delta=1.1), "delta", ValueError),
    (dict(delta=2.0, loss_type="sapo"), "delta", ValueError),
    (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos", ValueError),
    (dict(vespo_k_neg=-1.0), "vespo_k_neg", ValueError),
    # TRL's options it does not implement.
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile", ValueError),
    (dict(mask_truncated_completions=True), "mask_truncated_completions", ValueError),
    (dict(min_p=0.1), "min_p", ValueError),
])
def test_bad_options(tmp_path, options, name, error):
    with pytest.raises(error, match="^" + re.escape(name)):
        tiny_config(str(tmp_path), **options)


def test_missing_mask_token_is_named(tmp_path):
    tokenizer = sort_tokenizer()
    tokenizer.mask_token = None
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionGRPOTrainer(model=build_model(TINY, 0), reward_funcs=sort_reward, args=tiny_config(str(tmp_path)),
                             train_dataset=sort_dataset(4), processing_class=tokenizer)


def _bidirectional_llama(vocab_size: int):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, is_causal=False,
                                        pad_token_id=vocab.pad_id, eos_token_id=vocab.eos_id, bos_token_id=vocab.bos_id))


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    # 52 tokenizer ids, 20 model ids: a prompt id >= 20 would index outside the embeddings.
    tokenizer = sort_tokenizer()
    assert len(tokenizer) == vocab.size == 52
    with pytest.raises(ValueError, match=r"^processing_class: the tokenizer has 52 ids \(len\(processing_class\)\) but "
                                         r"the model's head scores 20"):
        DiffusionGRPOTrainer(model=_bidirectional_llama(20), reward_funcs=sort_reward, args=tiny_config(str(tmp_path)),
                             train_dataset=sort_dataset(4), processing_class=tokenizer)


def test_a_mask_id_outside_the_tokenizer_is_refused(tmp_path):
    # A model larger than its tokenizer is fine (padded vocabularies); its mask id must still be a token.
    with pytest.raises(ValueError, match=r"^mask_token_id: the mask id 55 lies outside the tokenizer's 52 ids"):
        DiffusionGRPOTrainer(model=_bidirectional_llama(60), reward_funcs=sort_reward,
                             args=tiny_config(str(tmp_path), mask_token_id=55), train_dataset=sort_dataset(4),
                             processing_class=sort_tokenizer())
    trainer = DiffusionGRPOTrainer(model=_bidirectional_llama(60), reward_funcs=sort_reward,
                                   args=tiny_config(str(tmp_path)), train_dataset=sort_dataset(4),
                                   processing_class=sort_tokenizer())
    assert trainer.mask_id == vocab.mask_id


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path):
    # As in TRL (documented): the tokenizer's pad token becomes its EOS token; prompts are left padded with it.
    tokenizer = sort_tokenizer()
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    trainer = DiffusionGRPOTrainer(model=build_model(TINY, 0), reward_funcs=[sort_reward, digit_reward],
                                   args=tiny_config(str(tmp_path), max_steps=1), train_dataset=sort_dataset(4),
                                   processing_class=tokenizer)
    assert trainer.processing_class.pad_token_id == vocab.eos_id
    ids, mask = trainer._left_padded_prompts([vocab.BOS + "12", vocab.BOS + "1234"])
    assert ids[0, :2].tolist() == [vocab.eos_id] * 2 and mask[0].tolist() == [False] * 2 + [True] * 3
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_a_sequence_past_the_models_position_limit_is_refused(tmp_path, monkeypatch):
    # A model with learned absolute positions (lm.max_length; here the tiny policy given a limit as
    # MaskedLM.from_hf gives a BERT its position table's size).
    import daca_kernels.models.masked_lm as masked_lm

    monkeypatch.setattr(masked_lm, "_position_limit", lambda backbone: 3)
    with pytest.raises(ValueError, match=r"^max_completion_length: the completion length G = 4 positions, more than "
                                         r"the model accepts \(lm.max_length = 3"):
        tiny_trainer(str(tmp_path))
    monkeypatch.setattr(masked_lm, "_position_limit", lambda backbone: 6)
    trainer = tiny_trainer(str(tmp_path))
    assert trainer.max_length == 6
    with pytest.raises(ValueError, match=r"^max_completion_length: P \+ G with the batch's tokenized prompt width "
                                         r"P = [45] and max_completion_length G = 4 = [89] positions, more than the "
                                         r"model accepts \(lm.max_length = 6"):
        first_batch(trainer)


def test_no_args_builds_the_default_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = build_model(TINY, 0)
    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=sort_reward, train_dataset=sort_dataset(4),
                                   processing_class=sort_tokenizer())
    name = get_config_model_id(model.config).split("/")[-1] or type(model).__name__
    assert trainer.args.output_dir == f"{name}-DiffusionGRPO"
    assert trainer.args.use_cpu and not trainer.args.bf16  # no CUDA here
    assert (trainer.args.objective, trainer.args.estimator) == ("grpo", "one_step")


def test_args_must_be_a_diffusion_config(tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="args"):
        DiffusionGRPOTrainer(model=build_model(TINY, 0), reward_funcs=sort_reward,
                             args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[]), train_dataset=sort_dataset(4),
                             processing_class=sort_tokenizer())


OBJECTIVES = ("grpo", "bgpo", "dispo")


def _first_step_gradients(folder: Path, processes: int) -> dict:
    """Per objective of ``OBJECTIVES``: the gradients of the first step, from one run of the child
    script on ``processes`` processes."""
    folder.mkdir()
    script = str(ROOT / "tests" / "trl_two_process.py")
    if processes == 1:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command + [str(folder), *OBJECTIVES], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    grads = {}
    for objective in OBJECTIVES:
        saved = torch.load(folder / f"{objective}.pt")
        assert saved["world_size"] == processes, objective
        grads[objective] = saved["grads"]
    return grads


def test_two_processes_give_the_gradients_of_one(tmp_path):
    # Per objective, daca-grpo (SML K = 4, DPS, DAPO's global token count), BGPO (its K = 2 strata
    # back-propagated one at a time, each backward all-reduced by DDP), or DiSPO (its fillings sampled
    # and rewarded per process, the step loss's global filled-token count) on 4 rollouts: one process
    # holding them all, or two holding 2 each (their gradients averaged by DDP over gloo). Each
    # process count is one run of the child script over the three objectives.
    one = _first_step_gradients(tmp_path / "one", 1)
    two = _first_step_gradients(tmp_path / "two", 2)
    for objective in OBJECTIVES:
        assert any(g.abs().max() > 0 for g in one[objective].values()), objective
        for name in one[objective]:
            torch.testing.assert_close(two[objective][name], one[objective][name], rtol=1e-5, atol=1e-6,
                                       msg=f"{objective}: {name}")


def test_fsdp2_sharded_head_inside_the_forward(tmp_path):
    # Two gloo processes, FSDP2 on every layer and the root (embeddings and LM head sharded), each
    # estimating its 2 rows through run_as_forward: the estimates and full gradients equal one
    # unsharded process on the 4 rows. Outside a forward call the sharded head is refused.
    path = tmp_path / "fsdp2.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "trl_fsdp2.py"), str(path)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sharded = torch.load(path)
    assert sharded["world_size"] == 2 and sharded["outside"] != "ran"
    model = build_model(TINY, 0)
    ids, completion, answer = estimator_batch()
    lm = MaskedLM.from_hf(model, mask_id=vocab.mask_id, verify=False)
    logp = estimate_logprob(lm, ids, completion, answer, None, estimator="stratified", num_strata=2, seed=7)
    (logp.sum() / ROWS).backward()
    assert_close_reduced(sharded["logp"], logp, n=TINY.intermediate_size)
    for name, p in model.named_parameters():
        torch.testing.assert_close(sharded["grads"][name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
