"""The reference GRPO loop: rollouts, rewards, group advantages, estimator, GRPO update.

One training step:

1. draw ``prompts_per_step`` prompts (a pure function of ``(seed, step)``), each repeated
   ``group_size`` times; under ``torchrun`` every process takes a slice of whole groups;
2. sample completions with :func:`daca_kernels.rollout.generate` (which also records what DPS
   needs), score them with the task's verifiable reward, compute group advantages;
3. for each of ``inner_iterations`` updates ``j``, estimate per-token log-probabilities with the
   configured estimator under mask seed ``s_j``; the old-policy values for ``s_j`` are computed
   before the first update (for ``j = 0`` they equal the current values, so ratio 1);
4. ``grpo_loss`` with the DPS token weights (if on), backward, gradients summed across
   processes, clipped, AdamW step.

All randomness is counter-based in ``(seed, step, ...)``, so a run resumed from a checkpoint
reproduces the uninterrupted run exactly, and a run on several processes the single-process one.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from daca_kernels import group_advantages, grpo_loss
from daca_kernels import reference
from daca_kernels.reference.hashing import murmur3_32_words, seed32
from daca_kernels.rollout import Rollout, generate
from integration.checkpoint import load_checkpoint, save_checkpoint
from integration.config import RunConfig
from integration.distributed import World
from integration.estimators import estimate_logprob, token_weights
from integration.model import as_masked_lm
from integration.sft import warm_start
from integration.tasks import get_task, vocab

EVAL_SEED = 10**9 + 7
PURPOSE_PROMPTS, PURPOSE_ROLLOUT, PURPOSE_MASKS = 1, 2, 3


def derived_seed(seed: int, step: int, purpose: int, index: int = 0) -> int:
    """A 32-bit seed for one use at one step, from the run's seed."""
    return murmur3_32_words(seed32(seed), [purpose, step, index])


def completion_mask(rollout: Rollout, prompt_length: int) -> torch.Tensor:
    """bool ``[B, L]``: the completion tokens up to and including the first ``[EOS]`` (all of the
    completion when it has none): the tokens the reward read and that the loss trains."""
    completion = rollout.sequences[:, prompt_length:]
    is_eos = completion == vocab.eos_id
    before_first_eos = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) == 0
    mask = torch.zeros_like(rollout.sequences, dtype=torch.bool)
    mask[:, prompt_length:] = before_first_eos
    return mask


@dataclass
class RolloutBatch:
    """What one step trains on (this process's share of the global batch)."""

    rollout: Rollout
    rewards: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor | None
    global_tokens: torch.Tensor
    seeds: list[int]
    row_offset: int
    old: list[torch.Tensor | None]


class Trainer:
    """A GRPO run of ``config`` writing ``metrics.jsonl`` and ``checkpoint.pt`` under ``run_dir``."""

    def __init__(self, config: RunConfig, run_dir: str | Path, *, cache_dir: str | Path, world: World = World(),
                 progress: bool = True):
        if config.prompts_per_step % world.size:
            raise ValueError(f"prompts_per_step ({config.prompts_per_step}) must be divisible by the number of processes ({world.size})")
        self.config, self.world, self.progress = config, world, progress and world.is_main
        self.run_dir = Path(run_dir)
        self.task = get_task(config.task)
        if world.is_main:
            warm_start(self.task, config.model, config.sft, seed=config.sft_seed, cache_dir=cache_dir, progress=self.progress)
        world.barrier()
        self.model = warm_start(self.task, config.model, config.sft, seed=config.sft_seed, cache_dir=cache_dir, progress=False)
        self.lm = as_masked_lm(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        self.step = 0
        self.generation = dict(
            gen_length=self.task.completion_length,
            steps=config.gen_steps or self.task.completion_length,
            block_length=config.block_length or self.task.completion_length,
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
        if state["config"] != self.config.to_dict():
            changed = sorted(k for k in self.config.to_dict() if state["config"].get(k) != self.config.to_dict()[k])
            raise ValueError(f"checkpoint {self.checkpoint_path} was written by a run with a different configuration ({', '.join(changed)})")
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
        """Rollouts of this process's share of step ``step``, scored, with advantages, DPS weights
        and the old-policy estimates of every inner iteration's mask seed."""
        config = self.config
        prompts, examples, row_offset = self.local_batch(step)
        prompt_length = prompts.shape[1]
        self.model.eval()
        rollout = generate(
            self.lm, prompts, temperature=config.temperature, seed=derived_seed(config.seed, step, PURPOSE_ROLLOUT),
            prompt_mask=prompts != vocab.pad_id, row_offset=row_offset, **self.generation,
        )
        rewards = self.task.rewards(rollout.sequences[:, prompt_length:], examples)
        mask = completion_mask(rollout, prompt_length)
        batch = RolloutBatch(
            rollout=rollout, rewards=rewards, advantages=group_advantages(rewards, config.group_size), mask=mask,
            weights=token_weights(rollout, config, mask), global_tokens=self.world.all_sum(mask.sum()),
            seeds=[derived_seed(config.seed, step, PURPOSE_MASKS, j) for j in range(config.inner_iterations)],
            row_offset=row_offset, old=[],
        )
        with torch.no_grad():
            batch.old.extend([None] + [self.estimate(batch, seed) for seed in batch.seeds[1:]])
        return batch

    def estimate(self, batch: RolloutBatch, seed: int) -> torch.Tensor:
        return estimate_logprob(self.lm, self.config, batch.rollout.sequences, batch.mask, batch.rollout.attention_mask,
                                seed=seed, row_offset=batch.row_offset)

    def loss_gradients(self, batch: RolloutBatch, iteration: int) -> tuple[float, float]:
        """Loss of inner iteration ``iteration``; leaves the gradients of the global batch's loss
        (summed over processes) in the parameters' ``.grad``. Returns ``(loss, clip fraction)``."""
        config = self.config
        self.model.train()
        logp = self.estimate(batch, batch.seeds[iteration])
        loss_fn = reference.losses.grpo_loss if config.backend == "reference" else grpo_loss
        loss, metrics = loss_fn(
            logp, batch.old[iteration], batch.advantages, batch.mask, token_weights=batch.weights, beta=config.beta,
            eps_low=config.eps_low, eps_high=config.eps_high, loss_type=config.loss_type,
            **self._normaliser(batch.global_tokens),
        )
        self.optimizer.zero_grad(set_to_none=True)
        (loss * self._loss_share(batch.mask, batch.global_tokens)).backward()
        self.world.sum_gradients(self.model.parameters())
        return loss.item(), float(metrics["clip_fraction"])

    def train_step(self, step: int) -> dict:
        """One GRPO step: collect, then ``inner_iterations`` clipped updates."""
        config = self.config
        batch = self.collect(step)
        losses, clip_fractions = [], []
        for j in range(config.inner_iterations):
            loss, clip_fraction = self.loss_gradients(batch, j)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            losses.append(loss)
            clip_fractions.append(clip_fraction)
        total_reward = self.world.all_sum(batch.rewards.sum()) / (config.prompts_per_step * config.group_size)
        return {
            "reward": float(total_reward),
            "loss": sum(losses) / len(losses),
            "clip_fraction": sum(clip_fractions) / len(clip_fractions),
            "tokens": int(batch.global_tokens),
            "nfe": batch.rollout.nfe,
        }

    def _normaliser(self, global_tokens: torch.Tensor) -> dict:
        # dapo divides by the global token count directly; the others are rescaled by _loss_share.
        return {"num_items_in_batch": global_tokens} if self.config.loss_type == "dapo" else {}

    def _loss_share(self, mask: torch.Tensor, global_tokens: torch.Tensor) -> float:
        """Factor making the sum over processes of the local losses the global batch's loss."""
        if self.world.size == 1 or self.config.loss_type == "dapo":
            return 1.0
        if self.config.loss_type == "bnpo":
            return float(mask.sum()) / float(global_tokens)
        return 1.0 / self.world.size

    # ------------------------------------------------------------------ evaluation and the run
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean reward of greedy (temperature 0) completions of a fixed set of prompts."""
        prompts, examples = self.task.batch(self.config.eval_prompts, seed=EVAL_SEED)
        self.model.eval()
        rollout = generate(self.lm, prompts, temperature=0.0, seed=0, prompt_mask=prompts != vocab.pad_id, **self.generation)
        return float(self.task.rewards(rollout.sequences[:, prompts.shape[1]:], examples).mean())

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
        bar = tqdm(range(self.step, end), desc=f"{config.task} {config.estimator}{' +DPS' if config.dps else ''}",
                   disable=None if self.progress else True, leave=False)
        for step in bar:
            start = time.perf_counter()
            record = {"step": step + 1, **self.train_step(step)}
            self.step = step + 1
            if self.step % config.eval_every == 0 or self.step == config.steps:
                record["eval_reward"] = self.evaluate() if self.world.is_main else None
            record["seconds"] = round(time.perf_counter() - start, 3)
            records.append(record)
            self._log(record)
            bar.set_postfix(reward=f"{record['reward']:.3f}")
            if self.step % config.checkpoint_every == 0 or self.step == end:
                self.save()
        return records
