"""The reference GRPO loop: rollouts, rewards, group advantages, estimator, GRPO update.

One training step:

1. draw ``prompts_per_step`` prompts (a pure function of ``(seed, step)``), each repeated
   ``group_size`` times; under ``torchrun`` every process takes a slice of whole groups;
2. sample completions with [`daca_kernels.rollout.generate`][daca_kernels.rollout.sampler.generate] (which also records what DPS
   needs), score them with the task's verifiable reward, compute group advantages
   (``advantage_scale``, ``leave_one_out``: a preset's are its peer's, ``presets.ADVANTAGES``);
3. for each of ``inner_iterations`` updates ``j``, the configured objective
   ([`integration.objectives`][integration.objectives]: GRPO family, BGPO, SPG or DiSPO) with the configured estimator
   under mask seed ``s_j``; the old-policy values for ``s_j`` are computed before the first update
   (for ``j = 0`` they equal the current values, so ratio 1);
4. backward (with the DPS token weights if on), gradients summed across processes, clipped,
   AdamW step.

All randomness is counter-based in ``(seed, step, ...)``, so a run resumed from a checkpoint
reproduces the uninterrupted run exactly, and a run on several processes the single-process one.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from daca_kernels import group_advantages
from daca_kernels.hashing import derive_seed
from daca_kernels.objectives import OBJECTIVES
from daca_kernels.rl_step import Fillings, sampling_importance_weights
from daca_kernels.rollout import Rollout, branch, generate, rescore_commits
from integration.checkpoint import load_checkpoint, save_checkpoint
from integration.config import RunConfig
from integration.distributed import World
from integration.estimators import token_weights
from integration.model import as_masked_lm
from integration.objectives import RolloutBatch, backward_objective, prepare_old, step_options
from integration.sft import warm_start
from integration.tasks import get_task, vocab

EVAL_SEED = 10**9 + 7
PURPOSE_PROMPTS, PURPOSE_ROLLOUT, PURPOSE_MASKS, PURPOSE_BRANCH = 1, 2, 3, 4


def derived_seed(seed: int, step: int, purpose: int, index: int = 0) -> int:
    """A 32-bit seed for one use at one step, from the run's seed."""
    return derive_seed(seed, purpose, step, index)


def check_rewards(rewards: torch.Tensor, task: str, what: str = "completion") -> None:
    """A NaN or infinite reward is an error naming the task, the row and the value (it would make
    the advantages, hence the loss, NaN)."""
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"task {task!r} returned a non-finite reward {float(rewards[index])} for {what} {index} "
                         f"(of {rewards.numel()}); rewards must be finite")


class Trainer:
    """A GRPO run of ``config`` writing ``metrics.jsonl`` and ``checkpoint.pt`` under ``run_dir``."""

    def __init__(self, config: RunConfig, run_dir: str | Path, *, cache_dir: str | Path, world: World = World(),
                 progress: bool = True):
        """Start from the SFT warm start of ``config`` (trained once and cached under ``cache_dir``).
        With ``beta > 0`` a frozen copy of it is the reference policy of the KL penalty."""
        if world.size > 1 and config.backend == "reference":
            raise ValueError("backend must be 'fused' under several processes (the reference backend is single-process)")
        if config.prompts_per_step % world.size:
            raise ValueError(f"prompts_per_step ({config.prompts_per_step}) must be divisible by the number of processes ({world.size})")
        self.config, self.world, self.progress = config, world, progress and world.is_main
        self.run_dir = Path(run_dir)
        self.task = get_task(config.task)
        # The main process trains (or loads) the SFT warm start; the others read it from the cache.
        if world.is_main:
            self.model = warm_start(self.task, config.model, config.sft, seed=config.sft_seed, cache_dir=cache_dir,
                                    progress=self.progress)
        world.barrier()
        if not world.is_main:
            self.model = warm_start(self.task, config.model, config.sft, seed=config.sft_seed, cache_dir=cache_dir,
                                    progress=False)
        self.lm = as_masked_lm(self.model)
        self.reference_lm = None
        if config.beta > 0:
            reference_model = copy.deepcopy(self.model).requires_grad_(False).eval()
            self.reference_lm = as_masked_lm(reference_model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        self.step = 0
        self.generation = dict(
            gen_length=self.task.completion_length,
            steps=config.gen_steps or self.task.completion_length,
            block_length=config.block_length or self.task.completion_length,
            kv_cache=config.kv_cache,
            threshold=config.threshold,
        )

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        if not self.world.is_main:
            return
        save_checkpoint(self.checkpoint_path, {
            "config": self.config.to_dict(),
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        })

    def resume(self) -> None:
        """Continue from ``run_dir/checkpoint.pt`` (same configuration required)."""
        state = load_checkpoint(self.checkpoint_path, required=("config", "step", "model", "optimizer", "torch_rng"))
        current = self.config.to_dict()
        # A field added since the checkpoint was written takes its default, which is what that run used.
        saved = RunConfig.from_dict(state["config"]).to_dict()
        if saved != current:
            changed = sorted(k for k in current if saved[k] != current[k])
            raise ValueError(f"checkpoint {self.checkpoint_path} was written by a run with a different "
                             f"configuration ({', '.join(changed)})")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])
        if self.world.is_main and self.metrics_path.exists():
            kept = [line for line in self.metrics_path.read_text().splitlines() if json.loads(line)["step"] <= self.step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))

    # ------------------------------------------------------------------ one step
    def local_batch(self, step: int):
        """This process's prompts ``[b, P]`` (each repeated ``group_size`` times), their examples
        and the global index of its first row."""
        config = self.config
        prompts, examples = self.task.batch(config.prompts_per_step, seed=derived_seed(config.seed, step, PURPOSE_PROMPTS))
        per_process = config.prompts_per_step // self.world.size
        lo = self.world.rank * per_process
        prompts = prompts[lo:lo + per_process].repeat_interleave(config.group_size, dim=0)
        examples = [e for e in examples[lo:lo + per_process] for _ in range(config.group_size)]
        return prompts, examples, lo * config.group_size

    def collect(self, step: int) -> RolloutBatch:
        """Rollouts of this process's share of step ``step``, scored, with advantages, DPS weights,
        DiSPO's branch fillings (objective ``dispo``) and the old-policy values."""
        config = self.config
        prompts, examples, row_offset = self.local_batch(step)
        prompt_length = prompts.shape[1]
        self.model.eval()
        fillings = OBJECTIVES[config.diffusion.objective].fillings
        branch_steps = [int(config.diffusion.dispo_branch_fraction * self.generation["steps"])] if fillings else None
        rollout = generate(
            self.lm, prompts, temperature=config.temperature, seed=derived_seed(config.seed, step, PURPOSE_ROLLOUT),
            prompt_mask=prompts != vocab.pad_id, row_offset=row_offset, branch_steps=branch_steps, **self.generation,
        )
        rewards = self.task.rewards(rollout.sequences[:, prompt_length:], examples)
        check_rewards(rewards, config.task)
        mask = rollout.answer_mask(vocab.eos_id)
        advantages = group_advantages(rewards, config.group_size, **config.advantage_options())
        weights, sampling = self._sampling_correction(rollout, mask, token_weights(rollout, config, mask))
        batch = RolloutBatch(
            rollout=rollout, rewards=rewards, advantages=advantages, mask=mask,
            weights=weights, global_tokens=self.world.all_sum(mask.sum()),
            seeds=[derived_seed(config.seed, step, PURPOSE_MASKS, j) for j in range(config.inner_iterations)],
            row_offset=row_offset, world_size=self.world.size, sampling=sampling,
        )
        if fillings:
            batch.branch = self._branch(rollout, examples, step, row_offset)
            batch.global_filled = self.world.all_sum(batch.branch.filled.sum())
        prepare_old(self.lm, config, batch, self.reference_lm)
        return batch

    @torch.no_grad()
    def _sampling_correction(self, rollout: Rollout, mask: torch.Tensor,
                             weights: torch.Tensor | None) -> tuple[torch.Tensor | None, dict]:
        """The token weights (``weights``, the DPS weights or None, times the sampling correction's
        when it is on) and the sampling/scoring gap of an approximate rollout (means over the
        processes), with ``gap_seconds``, the seconds the rescoring took when it only measures the gap
        (correction off: not the method's cost, left out of the step's ``seconds``)."""
        config = self.config
        correct = config.diffusion.sampling_importance_sampling_correction
        if not correct and config.kv_cache is None and config.threshold is None:
            return weights, {}
        start = time.perf_counter()
        correction, metrics = sampling_importance_weights(rescore_commits(self.lm, rollout), rollout.commit_logprob,
                                                          rollout.commit_step, mask, step_options(config))
        sampling = {name: float(self.world.all_sum(value)) / self.world.size for name, value in metrics.items()}
        if not correct:
            return weights, {**sampling, "gap_seconds": time.perf_counter() - start}
        return (correction if weights is None else correction * weights), sampling

    def _branch(self, rollout: Rollout, examples, step: int, row_offset: int) -> Fillings:
        """Z fillings of the cached state, laid out row by row (row ``b * Z + z``), with rewards."""
        config, z = self.config, self.config.diffusion.dispo_fillings
        fills = branch(rollout, 0, z, seed=derived_seed(config.seed, step, PURPOSE_BRANCH),
                       temperature=config.temperature, row_offset=row_offset)
        fillings = fills.sequences.transpose(0, 1).reshape(-1, fills.sequences.shape[-1])
        filled = fills.filled.repeat_interleave(z, dim=0)
        rewards = self.task.rewards(fillings[:, rollout.prompt_length:], [e for e in examples for _ in range(z)])
        check_rewards(rewards, config.task, "branch filling")
        return Fillings(state=fills.state, fillings=fillings, filled=filled, rewards=rewards, num_fillings=z)

    def loss_gradients(self, batch: RolloutBatch, iteration: int) -> tuple[float, dict]:
        """Loss of inner iteration ``iteration``; leaves the gradients of the global batch's loss
        (summed over processes) in the parameters' ``.grad``. Returns ``(loss, metrics)``."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, metrics = backward_objective(self.lm, self.config, batch, iteration)
        self.world.sum_gradients(self.model.parameters())
        return loss, metrics

    def train_step(self, step: int) -> dict:
        """One GRPO step: collect, then ``inner_iterations`` clipped updates."""
        config = self.config
        batch = self.collect(step)
        losses, metrics = [], {}
        for j in range(config.inner_iterations):
            loss, extra = self.loss_gradients(batch, j)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            losses.append(loss)
            for key, value in extra.items():
                metrics[key] = metrics.get(key, 0.0) + value / config.inner_iterations
        total_reward = self.world.all_sum(batch.rewards.sum()) / (config.prompts_per_step * config.group_size)
        record = {"reward": float(total_reward), "loss": sum(losses) / len(losses), **metrics, **batch.sampling,
                  "tokens": int(batch.global_tokens), "nfe": batch.rollout.nfe}
        if batch.branch is not None:
            record["branch_reward"] = float(self.world.all_sum(batch.branch.rewards.sum()) / (
                batch.branch.rewards.numel() * self.world.size))
        return record

    # ------------------------------------------------------------------ evaluation and the run
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean reward of greedy (temperature 0) completions of a fixed set of prompts."""
        prompts, examples = self.task.batch(self.config.eval_prompts, seed=EVAL_SEED)
        self.model.eval()
        # Evaluated with the exact sampler whatever the rollouts' cache or threshold, so runs compare.
        exact = {**self.generation, "kv_cache": None, "threshold": None}
        rollout = generate(self.lm, prompts, temperature=0.0, seed=0, prompt_mask=prompts != vocab.pad_id, **exact)
        rewards = self.task.rewards(rollout.sequences[:, prompts.shape[1]:], examples)
        check_rewards(rewards, self.config.task, "evaluation completion")
        return float(rewards.mean())

    def _log(self, record: dict) -> None:
        if self.world.is_main:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def run(self, stop_after: int | None = None) -> list[dict]:
        """Train until ``config.steps`` (or until step ``stop_after``); returns the logged records."""
        config = self.config
        end = config.steps if stop_after is None else min(config.steps, stop_after)
        records = []
        if self.step == 0:
            if self.metrics_path.exists() and self.world.is_main:
                self.metrics_path.unlink()
            records.append({"step": 0, "eval_reward": self.evaluate() if self.world.is_main else None})
            self._log(records[-1])
        bar = tqdm(range(self.step, end), desc=f"{config.task} {config.diffusion.estimator}{' +DPS' if config.diffusion.dps else ''}",
                   disable=None if self.progress else True, leave=False)
        for step in bar:
            start = time.perf_counter()
            record = {"step": step + 1, **self.train_step(step)}
            self.step = step + 1
            if self.step % config.eval_every == 0 or self.step == config.steps:
                record["eval_reward"] = self.evaluate() if self.world.is_main else None
            # The rescoring that only measures an uncorrected rollout's gap is not the method's cost.
            record["seconds"] = round(time.perf_counter() - start - record.get("gap_seconds", 0.0), 3)
            records.append(record)
            self._log(record)
            bar.set_postfix(reward=f"{record['reward']:.3f}")
            if self.step % config.checkpoint_every == 0 or self.step == end:
                self.save()
        return records
