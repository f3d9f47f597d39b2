"""The main job: parity of the fused and reference backends, then diffu-GRPO vs DACA-GRPO.

    python -m integration.demo            # what `make demo` runs (CPU, a few minutes)

1. Parity: on one batch, ``--backend fused`` and ``--backend reference`` give the same loss and
   parameter gradients for every estimator with DPS off and on (exits with status 1 otherwise).
2. The comparison: diffu-GRPO (one-step estimator, prompt masking 0.15) and DACA-GRPO (SML K = 4
   + DPS), each with its preset's advantages (``presets.ADVANTAGES``), trained from one SFT
   checkpoint with the same rollout budget over three seeds.
3. The report: ``integration/results/demo.md`` (tables) and ``demo_reward_curves.png``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from daca_kernels.presets import METHODS
from integration.compare import machine, plot_curves, run_comparison, summary_table
from integration.config import RunConfig, preset_settings, shared_advantages
from integration.parity import parity_check, parity_table
from integration.provenance import stamp_line

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="sort")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=RunConfig.steps)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("runs/demo"))
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    base = RunConfig(task=args.task, steps=args.steps)

    print("1/3 parity: fused vs reference backend, one batch, every objective and estimator, DPS off and on")
    rows = parity_check(base, args.cache)
    parity = parity_table(rows)
    print(parity)
    if not all(r.ok for r in rows):
        print("parity FAILED", file=sys.stderr)
        return 1

    variants = {m: preset_settings(m) for m in METHODS}
    print(f"\n2/3 training {' and '.join(METHODS)} on {args.task}, seeds {args.seeds}, {args.steps} steps each")
    results = run_comparison(base, variants, args.seeds, args.runs, args.cache)

    print("\n3/3 report")
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_curves(results, args.out / "demo_reward_curves.png",
                       f"{args.task}: diffu-GRPO vs DACA-GRPO, {len(args.seeds)} seeds, same SFT start and rollout budget")
    table = summary_table(results, variants)
    advantages = shared_advantages(variants)
    budget = base.steps * base.prompts_per_step * base.group_size
    elapsed = time.perf_counter() - start
    report = "\n".join([
        "# Reference loop demo",
        "",
        stamp_line(),
        "",
        f"`make demo` (`python -m integration.demo`) on {machine()}, {elapsed / 60:.1f} min in all.",
        "",
        "## Parity: fused vs reference backend (one batch, loss and parameter gradients)",
        "",
        parity,
        "",
        f"## diffu-GRPO vs DACA-GRPO on `{args.task}`",
        "",
        f"Each run: {base.steps} GRPO steps x {base.prompts_per_step} prompts x {base.group_size} completions "
        f"= {budget} rollouts, {base.inner_iterations} updates per batch, lr {base.lr}, rollout temperature "
        f"{base.temperature}"
        + (f", advantages {advantages}" if advantages else "")
        + f"; greedy eval reward on {base.eval_prompts} held-out prompts every {base.eval_every} steps.",
        "",
        table,
        "",
        f"![reward curves]({plot.name})",
        "",
    ])
    (args.out / "demo.md").write_text(report)
    print(table)
    print(f"\nreport: {args.out / 'demo.md'}\nplot:   {plot}\n({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
