"""Credit audit of the Denoising Progress Scores: do right tokens get higher weight than wrong ones?

    python -m integration.credit_audit            # sort, sudoku4, constraints (a few minutes, CPU)
    python -m integration.credit_audit --quick    # a smaller version (about a minute)

On tasks whose reward decomposes over positions the truth of every generated token is known
([`integration.tasks.base.Task.token_credit`][integration.tasks.base.Task.token_credit]: 1 right, 0 wrong, not credited where the reward
does not depend on the token). For the rollouts of a policy (``prompts`` audit prompts, each
sampled ``group_size`` times at the training temperature with the loop's generation settings) this
compares, over the credited tokens of the answers (up to and including the first ``[EOS]``), the
truth with:

- the DPS weights of each variant (``progress``, ``self``, ``lookahead``; the loop's scale and clip);
- baselines: uniform weights, ``1 - commit confidence`` (the raw score of ``self``, before the
  per-row standardisation and clipping), the commit step (later = higher) and the entropy of the
  model's distribution at the commit step.

The rollout records the commit step and confidence but not the entropy: [`commit_statistics`][integration.credit_audit.commit_statistics]
replays every step's input (the sequence with the tokens committed at that step or later masked
again) and recomputes the probability of each committed token and the entropy of its position's
distribution (softmax of the raw logits with the mask id excluded, the confidence's definition);
the report gives the largest gap between the recomputed probability and the recorded confidence.

Measures (per score): Spearman's rank correlation with the truth and the AUC (probability that a
right token outranks a wrong one), both pooled over every credited token; and the
within-completion AUC (DPS redistributes weight inside a completion), averaged over the
completions holding both right and wrong tokens: all of them, those with a positive advantage
(where weight on the right tokens is the credit the update should give) and those with a negative
one (where weight on the wrong tokens is the blame it should give, i.e. an AUC below 0.5).

Two policies per task: the SFT warm start and that warm start after ``steps`` diffu-GRPO steps of
the reference loop (the run is cached under ``--runs`` and resumed).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from daca_kernels import group_advantages
from daca_kernels.credit import VARIANTS, dps_weights
from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import Rollout, generate
from integration.compare import machine
from integration.config import RunConfig, describe_advantages, preset_settings, task_config
from integration.provenance import stamp, stamp_line
from integration.statistics import auc, spearman
from integration.tasks import vocab
from integration.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
AUDIT_TASKS = ("sort", "sudoku4", "constraints")
AUDIT_SEED = 2**31 - 1
SCORES = tuple(f"DPS {v}" for v in VARIANTS) + ("uniform", "1 - commit confidence", "commit step", "entropy at commit")


@torch.no_grad()
def commit_statistics(lm: MaskedLM, rollout: Rollout) -> tuple[Tensor, Tensor]:
    """Replay a rollout: for each generated token, the probability the model gave it and the
    entropy of its position's distribution at the step that committed it (softmax of the raw
    logits, mask id excluded). Float64 ``[B, L]`` each, 0 where nothing was committed."""
    sequences, commit_step = rollout.sequences, rollout.commit_step
    probability = torch.zeros(sequences.shape, dtype=torch.float64, device=sequences.device)
    entropy = torch.zeros_like(probability)
    for step in range(rollout.num_steps):
        chosen = commit_step == step
        if not bool(chosen.any()):
            continue
        state = torch.where(commit_step >= step, rollout.mask_id, sequences)
        hidden = lm.hidden(state, rollout.attention_mask)
        rows, positions = chosen.nonzero(as_tuple=True)
        logits = (hidden[rows, positions - 1 if lm.shift else positions] @ lm.head_weight.T).double()
        if lm.head_bias is not None:
            logits = logits + lm.head_bias.double()
        logits[:, rollout.mask_id] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        probability[rows, positions] = p.gather(1, sequences[rows, positions][:, None]).squeeze(1)
        entropy[rows, positions] = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
    return probability, entropy


def token_scores(rollout: Rollout, answer_mask: Tensor, entropy: Tensor, dps_scale: float) -> dict[str, Tensor]:
    """Every audited score ``[B, L]`` (see [`SCORES`][integration.credit_audit.SCORES]) of a rollout's tokens."""
    scores = {f"DPS {v}": dps_weights(rollout, answer_mask, variant=v, scale=dps_scale).double() for v in VARIANTS}
    scores["uniform"] = answer_mask.double()
    scores["1 - commit confidence"] = 1.0 - rollout.commit_confidence.double()
    scores["commit step"] = rollout.commit_step.double()
    scores["entropy at commit"] = entropy
    return scores


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


def score_measures(score: Tensor, credit: Tensor, advantages: Tensor) -> dict[str, float]:
    """Spearman and AUC pooled over the credited tokens (``credit`` not NaN), and the mean
    within-completion AUC over all completions with right and wrong tokens, over those with a
    positive advantage and over those with a negative one (with the counts)."""
    credited = ~torch.isnan(credit)
    pooled_score, pooled_credit = score[credited].numpy(), credit[credited].double().numpy()
    within, positive, negative = [], [], []
    for row in range(score.shape[0]):
        keep = credited[row]
        value = auc(score[row, keep].numpy(), credit[row, keep].double().numpy())
        if math.isnan(value):
            continue
        within.append(value)
        if advantages[row] > 0:
            positive.append(value)
        elif advantages[row] < 0:
            negative.append(value)
    return {
        "spearman": spearman(pooled_score, pooled_credit),
        "auc": auc(pooled_score, pooled_credit),
        "within_auc": _mean(within),
        "within_auc_positive": _mean(positive),
        "within_auc_negative": _mean(negative),
        "mixed_completions": len(within),
        "positive_completions": len(positive),
        "negative_completions": len(negative),
    }


def audit_policy(trainer: Trainer, prompts: int, seed: int = AUDIT_SEED) -> dict:
    """Sample the audit rollouts of ``trainer``'s current policy and measure every score."""
    config, task = trainer.config, trainer.task
    prompt_ids, examples = task.batch(prompts, seed=seed)
    prompt_ids = prompt_ids.repeat_interleave(config.group_size, dim=0)
    examples = [e for e in examples for _ in range(config.group_size)]
    trainer.model.eval()
    rollout = generate(trainer.lm, prompt_ids, temperature=config.temperature, seed=seed,
                       prompt_mask=prompt_ids != vocab.pad_id, **trainer.generation)
    completions = rollout.sequences[:, rollout.prompt_length:]
    rewards = task.rewards(completions, examples)
    advantages = group_advantages(rewards, config.group_size, **config.advantage_options())
    credit = torch.full(rollout.sequences.shape, float("nan"))
    credit[:, rollout.prompt_length:] = task.credits(completions, examples)
    answer = rollout.answer_mask(vocab.eos_id)
    if bool((~torch.isnan(credit) & ~answer).any()):
        raise ValueError(f"task {task.name!r} credits a token outside the answer (after the first [EOS])")
    probability, entropy = commit_statistics(trainer.lm, rollout)
    generated = rollout.completion_mask
    replay_gap = float((probability - rollout.commit_confidence.double())[generated].abs().max())
    scores = token_scores(rollout, answer, entropy, config.diffusion.dps_scale)
    credited = credit[~torch.isnan(credit)]
    return {
        "completions": int(rollout.sequences.shape[0]),
        "mean_reward": float(rewards.mean()),
        "credited_tokens": int(credited.numel()),
        "right_fraction": float(credited.mean()),
        "replay_gap": replay_gap,
        "scores": {name: score_measures(scores[name], credit, advantages) for name in SCORES},
    }


def audit_task(base: RunConfig, prompts: int, runs_dir: Path, cache_dir: Path, progress: bool = True) -> dict:
    """Audit the SFT warm start of ``base`` and the same start after ``base.steps`` diffu-GRPO steps."""
    config = base.replace(**preset_settings("diffu-grpo"))
    trainer = Trainer(config, runs_dir / f"{config.task}-diffu-grpo-seed{config.seed}", cache_dir=cache_dir, progress=progress)
    policies = {"SFT": audit_policy(trainer, prompts)}
    if trainer.checkpoint_path.exists():
        trainer.resume()
    trainer.run()
    records = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
    evals = [r["eval_reward"] for r in records if r.get("eval_reward") is not None]
    policies[f"diffu-GRPO {config.steps} steps"] = audit_policy(trainer, prompts)
    return {"eval_reward_start": evals[0], "eval_reward_end": evals[-1], "policies": policies}


def _fmt(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def audit_table(audits: dict[str, dict]) -> str:
    """One markdown table: a row per (task, policy, score)."""
    lines = ["| task | policy | score | Spearman (pooled) | AUC (pooled) | AUC within completion "
             "| within, advantage > 0 | within, advantage < 0 |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for task, audit in audits.items():
        for policy, result in audit["policies"].items():
            for name, m in result["scores"].items():
                lines.append(f"| {task} | {policy} | {name} | {_fmt(m['spearman'])} | {_fmt(m['auc'])} | "
                             f"{_fmt(m['within_auc'])} | {_fmt(m['within_auc_positive'])} | {_fmt(m['within_auc_negative'])} |")
    return "\n".join(lines)


def rollouts_table(audits: dict[str, dict]) -> str:
    lines = ["| task | policy | greedy eval reward | completions | mean rollout reward | credited tokens | right | "
             "completions with right and wrong tokens (advantage > 0 / < 0) | replay gap |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for task, audit in audits.items():
        for (policy, result), eval_reward in zip(audit["policies"].items(), (audit["eval_reward_start"], audit["eval_reward_end"])):
            counts = result["scores"]["uniform"]
            mixed = f"{counts['mixed_completions']} ({counts['positive_completions']} / {counts['negative_completions']})"
            lines.append(f"| {task} | {policy} | {eval_reward:.3f} | {result['completions']} | {result['mean_reward']:.3f} | "
                         f"{result['credited_tokens']} | {result['right_fraction']:.3f} | {mixed} | {result['replay_gap']:.1e} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(AUDIT_TASKS), choices=list(AUDIT_TASKS))
    parser.add_argument("--quick", action="store_true", help="16 prompts, 10 steps")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=RunConfig.lr)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("runs/credit_audit"))
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"))
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.steps = 16, 10
    start = time.perf_counter()
    audits = {}
    for task in args.tasks:
        base = task_config(task, steps=args.steps, lr=args.lr)
        audits[task] = audit_task(base, args.prompts, args.runs, args.cache)
        print(f"{task}: done ({time.perf_counter() - start:.0f} s)")
    elapsed = time.perf_counter() - start
    name = "credit_audit-quick" if args.quick else "credit_audit"
    command = "python -m integration.credit_audit" + (" --quick" if args.quick else "") + (
        "" if args.quick else f" --prompts {args.prompts} --steps {args.steps} --lr {args.lr}")
    base = task_config(args.tasks[0])
    advantages = describe_advantages(preset_settings("diffu-grpo"))
    settings = {"prompts": args.prompts, "group_size": base.group_size, "temperature": base.temperature,
                "audit_seed": AUDIT_SEED, "trained_steps": args.steps, "lr": args.lr, "advantages": advantages,
                "rl_seed": base.seed, "sft_seed": base.sft_seed, "dps_scale": base.diffusion.dps_scale, "dps_clip": base.diffusion.dps_clip}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(
        {**stamp(command), "machine": machine(), "seconds": round(elapsed, 1), "settings": settings, "audits": audits},
        indent=1))
    report = "\n".join([
        "# DPS credit audit",
        "",
        stamp_line(command),
        "",
        f"`{command}` on {machine()}, {elapsed / 60:.1f} min (SFT warm starts and diffu-GRPO runs read back "
        f"from the cache under `--runs` / `--cache` take no time).",
        "",
        f"Rollouts: {args.prompts} prompts (seed {AUDIT_SEED}) x {base.group_size} samples at temperature "
        f"{base.temperature}, per task and policy; policies: the SFT warm start (sft_seed {base.sft_seed}) and it after "
        f"{args.steps} diffu-GRPO steps (lr {args.lr}, {advantages}, RL seed {base.seed}, "
        f"{base.prompts_per_step} prompts x {base.group_size} per step). DPS at the loop's scale "
        f"{base.diffusion.dps_scale} and clip {tuple(base.diffusion.dps_clip)}. "
        "Truth: 1 right, 0 wrong per credited token (each task's `token_credit` rule).",
        "",
        "## Rollouts",
        "",
        rollouts_table(audits),
        "",
        "Replay gap: the largest difference between the recomputed probability of a committed token and the "
        "confidence the sampler recorded (the replay's check).",
        "",
        "## Scores against the truth",
        "",
        "Spearman > 0 and AUC > 0.5: right tokens score higher than wrong ones. Within completion: the AUC "
        "inside each completion holding right and wrong tokens, averaged over all of them, over those whose "
        "advantage is positive (the update should credit the right tokens: AUC > 0.5 is right) and over those "
        "whose advantage is negative (it should blame the wrong tokens: AUC < 0.5 is right). n/a: undefined "
        "(a constant score has no rank correlation).",
        "",
        audit_table(audits),
        "",
    ])
    (args.out / f"{name}.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
