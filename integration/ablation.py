"""What each part of DACA does: diffu-GRPO, + SML only, + DPS only, + both, ELBO-MC, over paired seeds.

    python -m integration.ablation --timing-rounds 20    # sort, 8 seeds x 6 variants x 60 steps
    python -m integration.ablation --quick               # 3 seeds x 10 steps (a few minutes)

The first takes about half an hour of run time on two CPU cores (48 runs); ``--task`` picks another
task, ``--seeds`` / ``--steps`` / ``--lr`` the budget.

Variants ([`daca_kernels.presets`][daca_kernels.presets]): ``diffu-grpo`` (the base), ``sml-only``, ``dps-only``,
``daca-grpo`` (both), ``elbo-mc`` (i.i.d. Monte-Carlo masks with the forward passes of SML K = 4)
and ``diffu-grpo-2x``: the base with twice the steps, about the compute of a DACA-GRPO run (whose
step costs about twice a diffu-GRPO step; the report gives the measured ratio), so the table also
answers "better per unit of compute?".

Pairing: for a seed, every variant starts from the same SFT checkpoint (``sft_seed``) and sees the
same prompts at every step (they are a function of the RL seed and the step only); the first
rollouts are identical too (same policy, same rollout seed), later ones differ as the policies do.
Per variant the report gives the final greedy eval reward, its difference to ``diffu-grpo`` per
seed summarised as the mean with a 95 % percentile bootstrap interval over seeds (10,000
resamples, generator seed 0) and the number of seeds where the variant ends above the base, plus
the curves. Runs are cached under ``--runs`` and resumed, so an interrupted command continues.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from integration.compare import final_rewards, machine, plot_curves, run_comparison
from integration.config import TASK_DEFAULTS, RunConfig, describe_variants, preset_settings, shared_advantages, task_config
from integration.provenance import stamp, stamp_line
from integration.statistics import bootstrap_ci
from integration.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
BASE = "diffu-grpo"
BOOTSTRAP_SEED = 0


def ablation_variants(steps: int) -> dict[str, dict]:
    """The six variants' settings for runs of ``steps`` steps (``diffu-grpo-2x`` gets twice as many)."""
    names = ("diffu-grpo", "sml-only", "dps-only", "daca-grpo", "elbo-mc")
    return {**{name: preset_settings(name) for name in names}, "diffu-grpo-2x": {**preset_settings(BASE), "steps": 2 * steps}}


def seconds_per_step(records: list[dict]) -> float:
    """The median time of a run's training steps, the steps that also evaluated left out (unless
    every step did)."""
    steps = [r for r in records if "seconds" in r]
    return statistics.median(r["seconds"] for r in [r for r in steps if r.get("eval_reward") is None] or steps)


def interleaved_step_seconds(base: RunConfig, variants: dict[str, dict], cache_dir: Path, rounds: int = 5) -> dict[str, float]:
    """The median time of one training step of each variant (seed ``base.seed``, steps ``0..rounds-1``),
    measured round-robin (one step of every variant per round) so that all see the same load on a
    shared machine."""
    trainers = {name: Trainer(base.replace(**settings), Path("unused"), cache_dir=cache_dir, progress=False)
                for name, settings in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(rounds):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step(step)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def ablation_rows(results: dict[str, dict[int, list[dict]]], step_seconds: dict[str, float] | None = None,
                  bootstrap_seed: int = BOOTSTRAP_SEED) -> list[dict]:
    """Per variant: seeds, start and final eval reward, the paired difference to [`BASE`][integration.ablation.BASE]
    (mean, 95 % bootstrap interval, wins), seconds per step in the runs and the ratio of
    ``step_seconds`` (an interleaved measurement, [`interleaved_step_seconds`][integration.ablation.interleaved_step_seconds]) to the
    base's."""
    if BASE not in results:
        raise ValueError(f"results must hold the base variant {BASE!r}")
    seeds = sorted(results[BASE])
    base_final = dict(zip(results[BASE], final_rewards(results[BASE])))
    base_seconds = statistics.mean(seconds_per_step(results[BASE][s]) for s in seeds)
    rows = []
    for name, runs in results.items():
        if sorted(runs) != seeds:
            raise ValueError(f"variant {name!r} has seeds {sorted(runs)}, the base {seeds}: runs must be paired")
        finals = dict(zip(runs, final_rewards(runs)))
        differences = [finals[s] - base_final[s] for s in seeds]
        per_step = statistics.mean(seconds_per_step(runs[s]) for s in seeds)
        row = {
            "variant": name, "seeds": seeds, "steps": runs[seeds[0]][-1]["step"],
            "start": statistics.mean(runs[s][0]["eval_reward"] for s in seeds),
            "final": [finals[s] for s in seeds],
            "final_mean": statistics.mean(finals.values()),
            "final_std": statistics.stdev(finals.values()) if len(seeds) > 1 else 0.0,
            "seconds_per_step": per_step, "run_time_ratio": per_step / base_seconds,
            "run_seconds": statistics.mean(sum(r.get("seconds", 0.0) for r in runs[s]) for s in seeds),
        }
        if step_seconds is not None:
            row["interleaved_seconds_per_step"] = step_seconds[name]
            row["time_ratio"] = step_seconds[name] / step_seconds[BASE]
        if name != BASE:
            low, high = bootstrap_ci(differences, seed=bootstrap_seed)
            row.update(difference=statistics.mean(differences), ci=[low, high],
                       wins=sum(d > 0 for d in differences), ties=sum(d == 0 for d in differences))
        rows.append(row)
    return rows


def ablation_table(rows: list[dict], variants: dict[str, dict]) -> str:
    lines = ["| variant | settings | steps | seeds | eval reward at start | final eval reward (mean ± std) | "
             "difference to diffu-grpo [95 % CI] | seeds above diffu-grpo | s / step in the runs | "
             "time / step vs diffu-grpo, interleaved | s / run |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    descriptions = describe_variants(variants)
    for row in rows:
        if row["variant"] == BASE:
            difference, wins = "(base)", "(base)"
        else:
            difference = f"{row['difference']:+.3f} [{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}]"
            wins = f"{row['wins']} / {len(row['seeds'])}" + (f" ({row['ties']} tied)" if row["ties"] else "")
        ratio = f"{row['time_ratio']:.2f}x" if "time_ratio" in row else "n/a"
        lines.append(
            f"| {row['variant']} | {descriptions[row['variant']]} | {row['steps']} | {len(row['seeds'])} | "
            f"{row['start']:.3f} | {row['final_mean']:.3f} ± {row['final_std']:.3f} | {difference} | {wins} | "
            f"{row['seconds_per_step']:.2f} | {ratio} | {row['run_seconds']:.0f} |")
    return "\n".join(lines)


def write_report(results: dict[str, dict[int, list[dict]]], variants: dict[str, dict], base: RunConfig, out: Path,
                 name: str, command: str, elapsed: float, step_seconds: dict[str, float] | None = None,
                 timing_rounds: int = 0) -> Path:
    """``out/name.md``, ``.json`` and ``.png``; returns the markdown's path. ``step_seconds``: the
    interleaved timing ([`interleaved_step_seconds`][integration.ablation.interleaved_step_seconds] over ``timing_rounds`` rounds), or
    None."""
    out.mkdir(parents=True, exist_ok=True)
    rows = ablation_rows(results, step_seconds)
    advantages = shared_advantages(variants)
    plot = plot_curves(results, out / f"{name}.png",
                       f"{base.task}: DACA ablation, {len(rows[0]['seeds'])} paired seeds, lr {base.lr}")
    settings = {"task": base.task, "steps": base.steps, "lr": base.lr, "prompts_per_step": base.prompts_per_step,
                "group_size": base.group_size, "inner_iterations": base.inner_iterations, "temperature": base.temperature,
                "eval_prompts": base.eval_prompts, "eval_every": base.eval_every, "sft_seed": base.sft_seed,
                "model": base.model.to_dict(), "sft": base.to_dict()["sft"], "bootstrap_seed": BOOTSTRAP_SEED,
                "timing_rounds": timing_rounds}
    (out / f"{name}.json").write_text(json.dumps(
        {**stamp(command), "machine": machine(), "seconds": round(elapsed, 1), "settings": settings,
         "variants": variants, "rows": rows,
         "curves": {v: {s: [(r["step"], r["eval_reward"]) for r in records if r.get("eval_reward") is not None]
                        for s, records in runs.items()} for v, runs in results.items()}}, indent=1))
    report = "\n".join([
        f"# DACA ablation on `{base.task}`",
        "",
        stamp_line(command),
        "",
        f"`{command}` on {machine()}: {elapsed / 60:.1f} min for this command (runs read back from the cache "
        f"count 0); the {sum(len(r['seeds']) for r in rows)} runs' own times add up to "
        f"{sum(r['run_seconds'] * len(r['seeds']) for r in rows) / 60:.1f} min.",
        "",
        f"Each run: {base.steps} GRPO steps (diffu-grpo-2x: {2 * base.steps}) x {base.prompts_per_step} prompts x "
        f"{base.group_size} completions, {base.inner_iterations} updates per batch, lr {base.lr}, rollout temperature "
        f"{base.temperature}{f', advantages {advantages}' if advantages else ''}; greedy eval reward on "
        f"{base.eval_prompts} held-out prompts every {base.eval_every} steps. "
        f"Seeds {rows[0]['seeds']}, all from SFT checkpoint sft_seed {base.sft_seed}; per seed the same prompts "
        f"in every variant. Difference: final eval reward minus diffu-grpo's, paired by seed; 95 % percentile "
        f"bootstrap over seeds (10,000 resamples, seed {BOOTSTRAP_SEED}). s / step in the runs: median over a "
        "run's steps (evaluation steps left out), mean over seeds; runs that shared the machine with other work "
        "are slower, so these are indicative. Time / step vs diffu-grpo: "
        + (f"the ratio of median step times measured round-robin, one step of every variant per round, "
           f"{timing_rounds} rounds (seed {base.seed}, steps 0 to {timing_rounds - 1}), so that every variant "
           "sees the same load." if step_seconds else "not measured (n/a)."),
        "",
        ablation_table(rows, variants),
        "",
        f"![curves]({plot.name})",
        "",
    ])
    path = out / f"{name}.md"
    path.write_text(report)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="sort", choices=list(TASK_DEFAULTS))
    parser.add_argument("--quick", action="store_true", help="3 seeds, 10 steps")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=RunConfig.lr)
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--timing-rounds", type=int, default=0,
                        help="measure the step time of every variant round-robin over this many rounds (0: skip)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("runs/ablation"))
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"))
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.runs = [0, 1, 2], 10, args.runs.with_name(args.runs.name + "-quick")
    start = time.perf_counter()
    base = task_config(args.task, steps=args.steps, lr=args.lr, eval_prompts=args.eval_prompts)
    variants = ablation_variants(args.steps)
    results = run_comparison(base, variants, args.seeds, args.runs, args.cache, resume=True)
    name = f"ablation-{args.task}" + ("-quick" if args.quick else "")
    command = f"python -m integration.ablation --task {args.task}" + (
        " --quick" if args.quick else
        f" --seeds {' '.join(map(str, args.seeds))} --steps {args.steps} --lr {args.lr} --eval-prompts {args.eval_prompts}")
    step_seconds = None
    if args.timing_rounds:
        step_seconds = interleaved_step_seconds(base, variants, args.cache, args.timing_rounds)
        command += f" --timing-rounds {args.timing_rounds}"
    path = write_report(results, variants, base, args.out, name, command, time.perf_counter() - start, step_seconds,
                        args.timing_rounds)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
