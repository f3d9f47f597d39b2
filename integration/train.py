"""Run the reference GRPO loop from the command line (one process, or several under torchrun).

    python -m integration.train --task sort --estimator stratified --dps --run-dir runs/sml
    python -m integration.train --run-dir runs/sml --resume          # continue after an interruption
    torchrun --nproc-per-node 2 -m integration.train --task sort ...  # gloo on CPU

Writes ``metrics.jsonl`` (one record per step) and ``checkpoint.pt`` under ``--run-dir``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from integration.config import BACKENDS, ESTIMATORS, METHODS, RunConfig, method_config
from integration.distributed import close_world, init_world
from integration.trainer import Trainer


def parse_config(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"), help="SFT checkpoint cache")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint.pt")
    parser.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")
    parser.add_argument("--method", choices=list(METHODS), default=None, help="a preset of the estimator settings")
    parser.add_argument("--task", default=defaults.task)
    parser.add_argument("--estimator", choices=ESTIMATORS, default=defaults.estimator)
    parser.add_argument("--num-strata", type=int, default=defaults.num_strata)
    parser.add_argument("--elbo-samples", type=int, default=defaults.elbo_samples)
    parser.add_argument("--prompt-mask-prob", type=float, default=defaults.prompt_mask_prob)
    parser.add_argument("--dps", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default=defaults.backend)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--inner-iterations", type=int, default=defaults.inner_iterations)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--beta", type=float, default=defaults.beta)
    parser.add_argument("--loss-type", default=defaults.loss_type)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sft-seed", type=int, default=defaults.sft_seed)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    config = RunConfig(
        task=args.task, estimator=args.estimator, num_strata=args.num_strata, elbo_samples=args.elbo_samples,
        prompt_mask_prob=args.prompt_mask_prob, dps=args.dps, backend=args.backend, steps=args.steps,
        prompts_per_step=args.prompts_per_step, group_size=args.group_size, inner_iterations=args.inner_iterations,
        lr=args.lr, beta=args.beta, loss_type=args.loss_type, temperature=args.temperature, seed=args.seed,
        sft_seed=args.sft_seed,
    )
    if args.method is not None:
        config = method_config(args.method, config)
    return config, args


def main(argv=None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config, args = parse_config(argv)
    world = init_world()
    if world.size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.size))
    try:
        trainer = Trainer(config, args.run_dir, cache_dir=args.cache, world=world, progress=not args.no_progress)
        if args.resume:
            trainer.resume()
        records = trainer.run(stop_after=args.stop_after)
        if world.is_main and records:
            last = records[-1]
            print(f"step {last['step']}: eval reward {last.get('eval_reward')}, metrics in {trainer.metrics_path}")
    finally:
        close_world(world)


if __name__ == "__main__":
    main()
