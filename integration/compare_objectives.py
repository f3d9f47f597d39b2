"""Every base objective against the same objective with DACA, on every task.

    python -m integration.compare_objectives --quick    # a short budget (sort, sudoku4, constraints)
    python -m integration.compare_objectives            # the full budget, every task

For each task and each base of ``daca_kernels.presets.OBJECTIVE_VARIANTS`` (GRPO as d1's
diffu-GRPO, coupled-GRPO, BGPO, SPG, DiSPO) two variants are trained from the task's SFT
checkpoint with the same rollout budget and optimiser steps over the seeds: the base, and the base
with DACA (SML masks + DPS token weights), both with the base's advantages (its peer's,
``presets.ADVANTAGES``). SPG's samples use block-wise masks whenever the task's rollouts decode in
several blocks. The report (``integration/results/objectives*.md``) has one table (the advantages,
final greedy eval reward, mean and spread over seeds, and the paired DACA - base difference) and
one PNG per task. Runs are cached under ``--runs`` and resumed (a finished one is read back), so an
interrupted command continues, and commands over disjoint ``--seeds`` can run side by side before
the full command assembles the report.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from daca_kernels.presets import OBJECTIVE_VARIANTS  # noqa: E402
from integration.compare import eval_curve, final_rewards, plot_eval_band, run_comparison  # noqa: E402
from integration.config import RunConfig, describe_advantages, preset_settings, task_config  # noqa: E402
from integration.provenance import stamp_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ("sort", "sudoku4", "constraints", "json_schema")
# --quick leaves json_schema out unless --tasks names it: its SFT warm-up alone takes ~10 min on 2 cores.
QUICK_TASKS = ("sort", "sudoku4", "constraints")
QUICK = dict(steps=12, prompts_per_step=8, eval_every=6, eval_prompts=64)
FULL = dict(steps=40, eval_every=10)


def variants_for(config: RunConfig) -> dict[str, dict]:
    """``{name: settings}`` of every base and its DACA variant for one task's configuration."""
    variants = {}
    for base in OBJECTIVE_VARIANTS:
        plain = preset_settings(base)
        if base == "spg" and config.block_length is not None:
            plain = {**plain, "mask_block_length": config.block_length}
        variants[base] = plain
        variants[f"{base}+DACA"] = preset_settings(f"{base}+DACA")
    return variants


def _mean_spread(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def objectives_table(results: dict[str, dict[str, dict[int, list[dict]]]]) -> str:
    lines = ["| task | base | advantages | eval at start | base: final eval | +DACA: final eval | DACA - base (paired by seed) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for task, runs in results.items():
        for base in OBJECTIVE_VARIANTS:
            plain, daca = runs[base], runs[f"{base}+DACA"]
            start = statistics.mean(eval_curve(r)[1][0] for r in plain.values())
            diffs = [b - a for a, b in zip(final_rewards(plain), final_rewards(daca))]
            lines.append(f"| {task} | {base} | {describe_advantages(preset_settings(base))} | {start:.3f} | "
                         f"{_mean_spread(final_rewards(plain))} | {_mean_spread(final_rewards(daca))} | {_mean_spread(diffs)} |")
    return "\n".join(lines)


def plot_task(task: str, runs: dict[str, dict[int, list[dict]]], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(OBJECTIVE_VARIANTS), figsize=(3.2 * len(OBJECTIVE_VARIANTS), 3.2), sharey=True)
    for ax, base in zip(axes, OBJECTIVE_VARIANTS):
        for name, color in ((base, "tab:blue"), (f"{base}+DACA", "tab:orange")):
            plot_eval_band(ax, runs[name], color, name)
        ax.set_title(base, fontsize=9)
        ax.set_xlabel("GRPO step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("greedy eval reward")
    fig.suptitle(f"{task}: base vs base + DACA (mean, min-max over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short budget (minutes on CPU)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS),
                        help="default: every task (sort, sudoku4, constraints with --quick)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 (quick) or 0 1 2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("runs/objectives"))
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"))
    args = parser.parse_args()
    seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
    tasks = args.tasks or list(QUICK_TASKS if args.quick else TASKS)
    budget = QUICK if args.quick else FULL
    suffix = "-quick" if args.quick else ""
    start = time.perf_counter()
    results, plots = {}, []
    args.out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        config = task_config(task, **budget)
        results[task] = run_comparison(config, variants_for(config), seeds, args.runs / task, args.cache, resume=True)
        plots.append(plot_task(task, results[task], args.out / f"objectives{suffix}-{task}.png"))
    table = objectives_table(results)
    base = task_config(tasks[0], **budget)
    command = "python -m integration.compare_objectives" + (" --quick" if args.quick else "")
    if args.tasks:
        command += " --tasks " + " ".join(tasks)
    if args.seeds:
        command += " --seeds " + " ".join(map(str, seeds))
    report = "\n".join([
        f"# Base objectives vs base + DACA{' (quick budget)' if args.quick else ''}",
        "",
        stamp_line(command),
        "",
        f"`{command}`: {len(seeds)} seeds, {base.steps} GRPO steps x {base.prompts_per_step} prompts x "
        f"{base.group_size} completions per run, {base.inner_iterations} updates per batch, lr {base.lr}; "
        f"greedy eval reward on {base.eval_prompts} held-out prompts. {(time.perf_counter() - start) / 60:.0f} min in all.",
        "",
        table,
        "",
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
    ])
    (args.out / f"objectives{suffix}.md").write_text(report)
    print(table)
    print(f"\nreport: {args.out / f'objectives{suffix}.md'}")


if __name__ == "__main__":
    main()
