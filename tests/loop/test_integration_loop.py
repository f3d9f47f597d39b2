"""The reference GRPO loop: parity of the backends, d1's masks, the presets' advantages, resume,
multi-process gradients, checkpoints, bad rewards."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_gradients import first_update_gradients, tiny_config
from support import assert_model_gradients_close

from daca_kernels import group_advantages, grpo_loss
from daca_kernels.presets import ADVANTAGES
from daca_kernels.rl_step import normalised_grpo_loss, token_logprob
from integration.checkpoint import load_checkpoint, save_checkpoint
from integration.config import RunConfig, preset_settings
from integration.objectives import normaliser, step_batch, step_options
from integration.parity import parity_check
from integration.tasks import vocab
from integration.trainer import Trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def torch_backend(monkeypatch):
    """The chunked PyTorch path: the loop's logic is under test here, not the kernels."""
    monkeypatch.setenv("DACA_BACKEND", "torch")


def test_parity_of_fused_and_reference_backends(torch_backend, tmp_path):
    rows = parity_check(tiny_config(), tmp_path, prompts=2)
    assert {r.objective for r in rows} == {"grpo", "bgpo", "spg", "dispo"}
    assert {(r.estimator, r.dps) for r in rows if r.objective == "grpo"} == {
        (e, d) for e in ("one_step", "coupled", "stratified", "elbo") for d in (False, True)
    }
    for r in rows:
        assert r.ok, r
        assert r.loss_fused != 0.0


def test_parity_on_the_triton_kernels(tmp_path):
    # Rollouts of 2 denoising steps: the sampling kernel runs under the interpreter at every step,
    # and parity is a property of the loss on whatever batch was collected.
    rows = parity_check(tiny_config(gen_steps=2), tmp_path, prompts=1,
                        cases=[("grpo", "stratified", {}), ("spg", "elbo", {})])
    assert len(rows) == 4 and all(r.ok for r in rows), rows


def test_the_loop_masks_the_generated_region_and_scores_the_answer(torch_backend, tmp_path):
    """The loop's diffu-GRPO is d1's estimator: the prompt as given, every generated position masked
    (the padding after the first [EOS] too), log-probabilities read up to and including that EOS."""
    trainer = Trainer(tiny_config(estimator="one_step", dps=False), tmp_path / "run", cache_dir=tmp_path / "cache",
                      progress=False)
    batch = trainer.collect(0)
    rollout = batch.rollout
    assert torch.equal(batch.mask, rollout.answer_mask(vocab.eos_id))
    sequences = rollout.sequences.clone()
    start = rollout.prompt_length
    sequences[:, start:] = torch.where(sequences[:, start:] == vocab.eos_id, vocab.eos_id + 1, sequences[:, start:])
    sequences[0, start + 2] = sequences[1, start] = vocab.eos_id  # rows 0 and 1 end early; the others never
    rollout = dataclasses.replace(rollout, sequences=sequences)
    batch.rollout, batch.mask = rollout, rollout.answer_mask(vocab.eos_id)
    assert batch.mask[0].sum() == 3 and batch.mask[1].sum() == 1 and (batch.mask[2:] == rollout.completion_mask[2:]).all()
    with torch.no_grad():
        got = token_logprob(trainer.lm, step_options(trainer.config), step_batch(trainer.config, batch), seed=0)
        d1_input = sequences.masked_fill(rollout.completion_mask, vocab.mask_id)
        logits = trainer.model(input_ids=d1_input, attention_mask=rollout.attention_mask).logits
        want = torch.log_softmax(logits.float(), dim=-1).gather(-1, sequences[..., None]).squeeze(-1)
    torch.testing.assert_close(got, torch.where(batch.mask, want, 0.0), rtol=1e-5, atol=1e-5)
    # The loop sums the processes' gradients: dr_grpo divides by B * G (G the generation length, as
    # TRL's max_completion_length), cispo and vespo by the global token count, the others by the
    # number of processes too.
    batch.world_size, batch.global_tokens = 2, batch.mask.sum() * 2
    generation_length = trainer.task.completion_length
    cases = {"dr_grpo": ({"max_completion_length": generation_length}, 2), "cispo": ({"num_items_in_batch": batch.global_tokens}, 1),
             "vespo": ({"num_items_in_batch": batch.global_tokens}, 1), "sapo": ({}, 2), "luspo": ({}, 2)}
    for loss_type, (kwargs, divisor) in cases.items():
        config = trainer.config.replace(loss_type=loss_type, epsilon_high=5.0)
        loss, _ = normalised_grpo_loss(step_options(config), step_batch(config, batch), got, None, None, normaliser(batch))
        expected, _ = grpo_loss(got, None, batch.advantages, batch.mask, loss_type=loss_type, epsilon_high=5.0, **kwargs)
        torch.testing.assert_close(loss, expected / divisor, rtol=1e-6, atol=0, msg=loss_type)


class TaskWithABadReward:
    """The task with ``bad`` as the reward of completion ``index``."""

    def __init__(self, task, bad: float, index: int):
        self.task, self.bad, self.index = task, bad, index

    def __getattr__(self, name):
        return getattr(self.task, name)

    def rewards(self, completions, examples):
        values = self.task.rewards(completions, examples)
        values[self.index] = self.bad
        return values


class TaskWithGivenRewards:
    """The task with ``values`` (float32 ``[B]``) as the rewards of any ``B`` completions."""

    def __init__(self, task, values: torch.Tensor):
        self.task, self.values = task, values

    def __getattr__(self, name):
        return getattr(self.task, name)

    def rewards(self, completions, examples):
        return self.values.clone()


def test_the_loop_uses_each_presets_advantages(torch_backend, tmp_path):
    """A preset's run computes its peer's advantages (``presets.ADVANTAGES``): d1's ``r - mean``,
    DiffuCoder's leave-one-out ``r - mean of the others``, TRL's ``(r - mean) / (std + 1e-4)``."""
    # Four groups of four: distinct values, a tie, a constant group (advantage 0 under every rule).
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.2, 0.2, 0.2, 0.2, 0.0, 1.0, 1.0, 0.5, 0.9, 0.1, 0.4, 0.3])
    grouped = rewards.reshape(4, 4)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    expected = {
        "diffu-grpo": centred,
        "coupled": grouped - (grouped.sum(dim=1, keepdim=True) - grouped) / 3,
        "bgpo": centred / (grouped.std(dim=1, keepdim=True) + 1e-4),
    }
    got = {}
    for preset, want in expected.items():
        trainer = Trainer(tiny_config(**preset_settings(preset)), tmp_path / preset, cache_dir=tmp_path / "cache",
                          progress=False)
        assert trainer.config.group_size == 4
        trainer.task = TaskWithGivenRewards(trainer.task, rewards)
        got[preset] = trainer.collect(0).advantages
        torch.testing.assert_close(got[preset], group_advantages(rewards, 4, **ADVANTAGES[preset]), rtol=0, atol=0)
        torch.testing.assert_close(got[preset], want.reshape(-1), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got["diffu-grpo"], got["coupled"]) and not torch.allclose(got["diffu-grpo"], got["bgpo"])


def test_a_non_finite_reward_is_an_error_naming_the_task(torch_backend, tmp_path):
    trainer = Trainer(tiny_config(), tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    task = trainer.task
    for bad, index in ((float("nan"), 5), (float("inf"), 2)):
        trainer.task = TaskWithABadReward(task, bad, index)
        with pytest.raises(ValueError, match=rf"task 'sort' returned a non-finite reward {bad} for completion {index} \(of 16\)"):
            trainer.collect(0)
        with pytest.raises(ValueError, match=rf"task 'sort' returned a non-finite reward {bad} for evaluation completion"):
            trainer.evaluate()


def test_resumed_run_equals_uninterrupted_run(torch_backend, tmp_path):
    config = tiny_config(steps=3, eval_every=2, checkpoint_every=1)
    whole = Trainer(config, tmp_path / "whole", cache_dir=tmp_path / "cache", progress=False)
    whole_records = whole.run()

    first = Trainer(config, tmp_path / "split", cache_dir=tmp_path / "cache", progress=False)
    first.run(stop_after=1)
    resumed = Trainer(config, tmp_path / "split", cache_dir=tmp_path / "cache", progress=False)
    resumed.resume()
    assert resumed.step == 1
    resumed.run()
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    logged = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    strip = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    assert [strip(r) for r in logged] == [strip(r) for r in whole_records]


def test_resume_refuses_a_different_configuration(torch_backend, tmp_path):
    config = tiny_config(steps=1)
    Trainer(config, tmp_path / "run", cache_dir=tmp_path / "cache", progress=False).run()
    other = Trainer(config.replace(lr=1e-3), tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match=r"different configuration \(lr\)"):
        other.resume()
    # A checkpoint written before the advantage settings existed: that run used the defaults.
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    for name in ("advantage_scale", "leave_one_out"):
        del state["config"][name]
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", state)
    Trainer(config, tmp_path / "run", cache_dir=tmp_path / "cache", progress=False).resume()
    other = Trainer(config.replace(advantage_scale="none"), tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match=r"different configuration \(advantage_scale\)"):
        other.resume()


def test_two_processes_give_the_single_process_gradients(torch_backend, tmp_path):
    out = tmp_path / "grads.pt"
    env = {**os.environ, "DACA_BACKEND": "torch", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
         str(ROOT / "tests" / "distributed_gradients.py"), "--out", str(out), "--cache", str(tmp_path / "cache")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    distributed = torch.load(out)
    single = first_update_gradients(Trainer(tiny_config(), tmp_path / "single", cache_dir=tmp_path / "cache", progress=False))
    assert all(single[name].abs().max() > 0 for name in single), "every parameter gets a gradient"
    assert_model_gradients_close(distributed, single)  # the all-reduce sums in another order


def test_missing_and_corrupted_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="corrupted or unreadable"):
        load_checkpoint(bad)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(ValueError, match="is not a daca-kernels-checkpoint"):
        load_checkpoint(foreign)
    good = save_checkpoint(tmp_path / "good.pt", {"step": 3})
    with pytest.raises(ValueError, match="lacks model"):
        load_checkpoint(good, required=("step", "model"))


def test_a_failed_write_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "ckpt.pt", {"step": 1})

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"estimator": "exact"}, "estimator must be one of"),
        ({"backend": "gpu"}, "backend must be one of"),
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"steps": 0}, "steps must be an int >= 1"),
        ({"advantage_scale": "std"}, "advantage_scale must be one of"),
        ({"leave_one_out": 1}, "leave_one_out must be a bool"),
    ],
)
def test_bad_configuration_is_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_flat(**changes)


def test_unknown_loss_type_is_named(torch_backend, tmp_path):
    trainer = Trainer(tiny_config(loss_type="ppo"), tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match="loss_type"):
        trainer.train_step(0)


def test_command_line_applies_task_defaults_presets_and_overrides():
    from daca_kernels.presets import OBJECTIVE_VARIANTS
    from integration.config import task_config
    from integration.train import parse_config

    config, _ = parse_config(["--run-dir", "r", "--task", "json_schema", "--method", "spg+DACA", "--num-strata", "2",
                              "--no-dps", "--epsilon-high", "0.28"])
    assert config == task_config("json_schema", **{**OBJECTIVE_VARIANTS["spg"][1], "num_strata": 2, "dps": False,
                                                   "epsilon_high": 0.28, "advantage_scale": "none", "leave_one_out": False})
    assert config.model.hidden_size == 128
    for preset in ("diffu-grpo", "coupled", "bgpo"):
        config, _ = parse_config(["--run-dir", "r", "--method", preset])
        assert config.advantage_options() == ADVANTAGES[preset]
    config, _ = parse_config(["--run-dir", "r", "--method", "coupled", "--advantage-scale", "batch", "--no-leave-one-out"])
    assert config.advantage_options() == {"scale": "batch", "leave_one_out": False}
    assert parse_config(["--run-dir", "r"])[0].advantage_options() == {"scale": "group", "leave_one_out": False}
    with pytest.raises(SystemExit):
        parse_config(["--run-dir", "r", "--objective", "ppo"])


def test_command_line_resume_reads_the_configuration_of_the_run(tmp_path):
    from integration.train import parse_config

    saved = tiny_config(objective="bgpo", estimator="elbo", lr=3e-4)
    save_checkpoint(tmp_path / "checkpoint.pt", {"config": saved.to_dict()})
    config, args = parse_config(["--run-dir", str(tmp_path), "--resume"])
    assert config == saved and args.resume
    changed, _ = parse_config(["--run-dir", str(tmp_path), "--resume", "--lr", "1e-3"])
    assert changed == saved.replace(lr=1e-3)  # Trainer.resume then refuses the mismatch
