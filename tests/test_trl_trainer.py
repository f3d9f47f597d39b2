"""``daca_kernels.trl``: the TRL trainer trains, equals the library's estimators and losses on one
batch, reproduces its masks, splits over two processes, and refuses bad options.

The tiny setup (tests/trl_setup.py) runs the library's chunked PyTorch path (``DACA_BACKEND=torch``):
what is checked here is the trainer's plumbing; the kernels are checked against the same path
elsewhere.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

pytest.importorskip("trl")

from daca_kernels import bgpo_loss, branch_logprob, dispo_step_loss, elbo_sample_scores, grpo_loss, spg_loss  # noqa: E402
from daca_kernels.likelihood import estimate_logprob, masked_logprob, monte_carlo_masks  # noqa: E402
from daca_kernels.masked_lm import MaskedLM  # noqa: E402
from daca_kernels.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer  # noqa: E402
from integration.model import build_model  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from tests.trl_setup import (  # noqa: E402
    ROWS,
    TINY,
    digit_reward,
    estimator_batch,
    sort_dataset,
    sort_reward,
    sort_tokenizer,
    tiny_config,
    tiny_trainer,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    # One thread: the tiny model's matrices are far too small to share, and on a loaded 2-core
    # machine two threads contend (a 32-wide linear goes from microseconds to milliseconds).
    monkeypatch.setenv("DACA_BACKEND", "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    torch.testing.assert_close(inputs["branch_old"].flatten(0, 1), step_logp.detach(), rtol=0, atol=1e-6)
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


class StopAfter(TrainerCallback):
    """Ends training after ``steps`` optimiser steps (as an interruption would, after the checkpoint)."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.steps:
            control.should_training_stop = True


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
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


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
    torch.testing.assert_close(second["old"][:, 1], current, rtol=0, atol=1e-6)
    torch.testing.assert_close(second["ref"][:, 1], current, rtol=0, atol=1e-6)
    assert len(set(second["mask_seeds"])) == 2


def test_rows_of_a_shard_get_the_masks_of_the_whole_batch(tmp_path):
    trainer = tiny_trainer(str(tmp_path), estimator="elbo", elbo_samples=2)
    inputs = first_batch(trainer)
    seed = inputs["mask_seeds"][0]
    whole = trainer.per_token_logps(trainer.model, inputs, seed)
    shard = {k: v[2:] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()}
    torch.testing.assert_close(trainer.per_token_logps(trainer.model, shard, seed), whole[2:], rtol=0, atol=1e-6)


def test_preset_fills_what_is_not_given(tmp_path):
    config = tiny_config(str(tmp_path), preset="daca-grpo", num_strata=2)
    assert (config.objective, config.estimator, config.num_strata, config.dps) == ("grpo", "stratified", 2, True)
    plain = tiny_config(str(tmp_path))
    assert (plain.objective, plain.estimator, plain.prompt_mask_prob, plain.dps) == ("grpo", "one_step", 0.0, False)
    assert tiny_config(str(tmp_path), preset="diffu-grpo").prompt_mask_prob == 0.15


@pytest.mark.parametrize("options, name", [
    (dict(estimator="exact"), "estimator"),
    (dict(objective="ppo"), "objective"),
    (dict(dispo_fillings=1), "dispo_fillings"),
    (dict(dispo_alpha=-0.5), "dispo_alpha"),
    (dict(dispo_branch_fraction=1.0), "dispo_branch_fraction"),
    (dict(preset="grpo++"), "preset"),
    (dict(objective="bgpo", estimator="one_step"), "estimator"),
    (dict(block_length=4, max_completion_length=6), "max_completion_length"),
    (dict(diffusion_steps=3, block_length=2, max_completion_length=4), "diffusion_steps"),
    (dict(num_strata=0), "num_strata"),
    (dict(prompt_mask_prob=1.5), "prompt_mask_prob"),
    (dict(dps_variant="future"), "dps_variant"),
    (dict(dps_clip=[2.0, 1.0]), "dps_clip"),
    (dict(remasking="top_k"), "remasking"),
    (dict(spg_bound="kl"), "spg_bound"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(mask_truncated_completions=True), "mask_truncated_completions"),
])
def test_bad_options(tmp_path, options, name):
    with pytest.raises(ValueError, match=name):
        tiny_config(str(tmp_path), **options)


def test_missing_mask_token_is_named(tmp_path):
    tokenizer = sort_tokenizer()
    tokenizer.mask_token = None
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionGRPOTrainer(model=build_model(TINY, 0), reward_funcs=sort_reward, args=tiny_config(str(tmp_path)),
                             train_dataset=sort_dataset(4), processing_class=tokenizer)


def test_args_must_be_a_diffusion_config(tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="args"):
        DiffusionGRPOTrainer(model=build_model(TINY, 0), reward_funcs=sort_reward,
                             args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[]), train_dataset=sort_dataset(4),
                             processing_class=sort_tokenizer())


def _first_step_gradients(tmp_path, processes: int, objective: str) -> dict:
    path = tmp_path / f"grads{processes}.pt"
    script = str(ROOT / "tests" / "trl_two_process.py")
    if processes == 1:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command + [str(path), objective], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = torch.load(path)
    assert saved["world_size"] == processes
    return saved["grads"]


@pytest.mark.parametrize("objective", ["grpo", "bgpo", "dispo"])
def test_two_processes_give_the_gradients_of_one(tmp_path, objective):
    # daca-grpo (SML K = 4, DPS, DAPO's global token count), BGPO (its K = 2 strata back-propagated
    # one at a time, each backward all-reduced by DDP), or DiSPO (its fillings sampled and rewarded
    # per process, the step loss's global filled-token count) on 4 rollouts: one process holding
    # them all, or two holding 2 each (their gradients averaged by DDP over gloo).
    one = _first_step_gradients(tmp_path, 1, objective)
    two = _first_step_gradients(tmp_path, 2, objective)
    assert any(g.abs().max() > 0 for g in one.values())
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


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
    logp = estimate_logprob(lm, ids, completion, answer, estimator="stratified", num_strata=2, seed=7)
    (logp.sum() / ROWS).backward()
    torch.testing.assert_close(sharded["logp"], logp.detach(), rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(sharded["grads"][name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_example_recipes_and_rewards(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import diffusion_grpo as example
    finally:
        sys.path.pop(0)
    for name in ("llada_gsm8k.yaml", "dream_gsm8k.yaml"):
        recipe = example.load_recipe(str(ROOT / "examples" / name))
        recipe["trainer"].update(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[])
        config = example.build_config(recipe)
        assert (config.estimator, config.num_strata, config.dps) == ("stratified", 4, True)
    row = example.to_prompt({"question": "How many?", "answer": "6 * 2 = 12\n#### 1,012"})
    assert row["answer"] == "1012" and row["prompt"][0]["content"].startswith("How many?")
    good = [{"role": "assistant", "content": "<reasoning>\n6 + 6\n</reasoning>\n<answer>\n1,012\n</answer>"}]
    bad = [{"role": "assistant", "content": "the answer is 12"}]
    assert example.correctness_reward(None, [good, bad], ["1012", "1012"]) == [2.0, 0.0]
    assert example.format_reward(None, [good, bad]) == [0.5, 0.0]
