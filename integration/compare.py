"""Train several variants over several seeds with the same budget and report the reward curves.

    python -m integration.compare --task sort --methods diffu-grpo daca-grpo --seeds 0 1 2

Every run starts from the same SFT checkpoint (``sft_seed``) and gets the same rollout budget
(``steps * prompts_per_step * group_size`` completions) and optimiser steps; only the settings of
the variant differ (for this command, the named recipes of ``daca_kernels.presets`` with their
advantages, ``config.preset_settings``; the task's defaults of ``TASK_DEFAULTS`` set the model and
SFT warm-up). The report is a markdown table of the final greedy eval reward (mean and spread over
seeds; the settings column names the advantages when they differ between the variants) and a PNG
of the reward curves.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from daca_kernels.presets import METHODS, PRESETS  # noqa: E402
from integration import provenance  # noqa: E402
from integration.config import TASK_DEFAULTS, RunConfig, describe_variants, preset_settings, task_config  # noqa: E402
from integration.trainer import Trainer  # noqa: E402

# The rollouts a comparison may decode (RunConfig settings): exact, an approximate KV cache, parallel
# decoding, and the prefix cache with the sampling correction.
ROLLOUTS = {"exact": {}, "prefix": {"kv_cache": "prefix"}, "dual": {"kv_cache": "dual"}, "threshold": {"threshold": 0.9},
            "prefix+correction": {"kv_cache": "prefix", "sampling_importance_sampling_correction": True}}


def machine() -> str:
    """The CPU model and core count (or the platform's processor name), and torch's version."""
    return f"{provenance.machine()}, torch {torch.__version__}"


def run_comparison(base: RunConfig, variants: dict[str, dict], seeds: list[int], runs_dir: Path, cache_dir: Path,
                   progress: bool = True, resume: bool = False) -> dict[str, dict[int, list[dict]]]:
    """``{variant: {seed: logged records}}`` for every (variant, seed) run; ``variants`` maps a
    name to the settings that replace those of ``base``. With ``resume`` a run whose checkpoint
    exists continues from it (a finished one is only read back)."""
    results: dict[str, dict[int, list[dict]]] = {}
    for method, settings in variants.items():
        for seed in seeds:
            config = base.replace(**settings, seed=seed)
            trainer = Trainer(config, runs_dir / f"{base.task}-{method}-seed{seed}", cache_dir=cache_dir, progress=progress)
            start = time.perf_counter()
            if resume and trainer.checkpoint_path.exists():
                trainer.resume()
            trainer.run()
            records = [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]
            results.setdefault(method, {})[seed] = records
            if progress:
                final = records[-1]["eval_reward"]
                print(f"  {base.task} {method:14s} seed {seed}: eval reward {records[0]['eval_reward']:.3f} -> {final:.3f} "
                      f"({time.perf_counter() - start:.0f} s)")
    return results


def eval_curve(records: list[dict]) -> tuple[list[int], list[float]]:
    points = [(r["step"], r["eval_reward"]) for r in records if r.get("eval_reward") is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def final_rewards(runs: dict[int, list[dict]]) -> list[float]:
    """The last eval reward of every seed's run."""
    return [eval_curve(r)[1][-1] for r in runs.values()]


def summary_table(results: dict[str, dict[int, list[dict]]], variants: dict[str, dict]) -> str:
    lines = [
        "| method | settings | seeds | eval reward at start | final eval reward (mean ± std) | min / max "
        "| mean train reward, last 5 steps | s / step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    descriptions = describe_variants(variants)
    for method, runs in results.items():
        finals = final_rewards(runs)
        starts = [eval_curve(r)[1][0] for r in runs.values()]
        train = [statistics.mean(x["reward"] for x in r if "reward" in x and x["step"] > r[-1]["step"] - 5) for r in runs.values()]
        seconds = [statistics.mean(x["seconds"] for x in r if "seconds" in x) for r in runs.values()]
        lines.append(
            f"| {method} | {descriptions[method]} | {len(finals)} | {statistics.mean(starts):.3f} | "
            f"{statistics.mean(finals):.3f} ± {_spread(finals):.3f} | {min(finals):.3f} / {max(finals):.3f} | "
            f"{statistics.mean(train):.3f} | {statistics.mean(seconds):.2f} |"
        )
    return "\n".join(lines)


def sampling_gap_table(results: dict[str, dict[int, list[dict]]]) -> str | None:
    """The sampling/scoring gap of the variants whose runs logged it (approximate rollouts: the
    loop's ``sampling/*`` records), means over the steps and seeds; None when none did."""
    names = ("sampling/logp_gap_abs_mean", "sampling/truncated_fraction", "sampling/importance_weight_mean")
    lines = ["| method | mean abs log-prob gap (full forward - sampling) | fraction of tokens truncated "
             "| mean importance weight |", "|---|---:|---:|---:|"]
    for method, runs in results.items():
        steps = [x for r in runs.values() for x in r if names[0] in x]
        if steps:
            lines.append(f"| {method} | " + " | ".join(f"{statistics.mean(x[n] for x in steps):.4f}" for n in names)
                         + " |")
    return "\n".join(lines) if len(lines) > 2 else None


COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
          "tab:olive", "tab:cyan")


def _moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def _band(ax, steps, curves, color, label):
    mean = [statistics.mean(c[i] for c in curves) for i in range(len(steps))]
    ax.plot(steps, mean, color=color, marker="o" if len(steps) < 20 else None, label=label)
    ax.fill_between(steps, [min(c[i] for c in curves) for i in range(len(steps))],
                    [max(c[i] for c in curves) for i in range(len(steps))], color=color, alpha=0.2)


def plot_eval_band(ax, runs: dict[int, list[dict]], color: str, label: str) -> None:
    """The greedy eval reward of one variant's runs on ``ax``: mean over seeds, min-max band."""
    curves = [eval_curve(r) for r in runs.values()]
    _band(ax, curves[0][0], [c[1] for c in curves], color, label)


def plot_curves(results: dict[str, dict[int, list[dict]]], path: Path, title: str, window: int = 5) -> Path:
    """Eval reward (mean over seeds, min-max band) and the training reward (moving average over
    ``window`` steps, mean over seeds, min-max band) of every method."""
    fig, (ax_eval, ax_train) = plt.subplots(1, 2, figsize=(11, 4))
    for color, (method, runs) in zip(COLORS, results.items()):
        plot_eval_band(ax_eval, runs, color, f"{method} ({len(runs)} seeds)")
        trains = [[x for x in r if "reward" in x] for r in runs.values()]
        steps = [x["step"] for x in trains[0]]
        _band(ax_train, steps, [_moving_average([x["reward"] for x in t], window) for t in trains], color, method)
    ax_eval.set(xlabel="GRPO step", ylabel="greedy eval reward", title="eval reward")
    ax_train.set(xlabel="GRPO step", ylabel="mean rollout reward",
                 title=f"training reward ({window}-step moving average)")
    for ax in (ax_eval, ax_train):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}\nmean over seeds, band = min to max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="sort", choices=list(TASK_DEFAULTS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(PRESETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=RunConfig.steps)
    parser.add_argument("--lr", type=float, default=RunConfig.lr)
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"))
    parser.add_argument("--rollouts", nargs="+", default=None, choices=list(ROLLOUTS),
                        help="compare each method's rollouts decoded these ways (exact, the prefix or dual KV cache, "
                             "parallel decoding at threshold 0.9; +correction: with the sampling correction) at "
                             "equal steps, seeds paired")
    parser.add_argument("--block-length", type=int, default=None,
                        help="the rollouts' semi-autoregressive block length (default: the whole completion, one "
                             "block, where a KV cache has no committed block to reuse)")
    parser.add_argument("--report", type=Path, default=None,
                        help="the report's path (its plot beside it, .png); default OUT/report.md")
    args = parser.parse_args()
    report = args.report or args.out / "report.md"
    variants = {m: preset_settings(m) for m in args.methods}
    if args.rollouts:
        variants = {f"{m} {r}": {**settings, **ROLLOUTS[r]} for m, settings in variants.items() for r in args.rollouts}
    base = task_config(args.task, steps=args.steps, lr=args.lr, block_length=args.block_length)
    start = time.perf_counter()
    results = run_comparison(base, variants, args.seeds, args.out, args.cache)
    minutes = (time.perf_counter() - start) / 60
    report.parent.mkdir(parents=True, exist_ok=True)
    table = summary_table(results, variants)
    gap = sampling_gap_table(results)
    plot = plot_curves(results, report.with_name("reward_curves.png" if args.report is None else report.stem + ".png"),
                       f"{args.task}: {' vs '.join(args.methods)}")
    report.write_text(
        f"# {args.task}\n\n{provenance.stamp_line()} The {len(variants) * len(args.seeds)} runs took "
        f"{minutes:.1f} min.\n\n{table}\n\n" + (f"{gap}\n\n" if gap else "") + f"![reward curves]({plot.name})\n")
    print(table + (f"\n\n{gap}" if gap else ""))


if __name__ == "__main__":
    main()
