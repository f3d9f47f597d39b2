"""Run the reference GRPO loop from the command line (one process, or several under torchrun).

    python -m integration.train --task sort --method daca-grpo --run-dir runs/daca
    python -m integration.train --task sudoku4 --objective spg --estimator elbo --dps --run-dir runs/spg
    python -m integration.train --run-dir runs/daca --resume          # continue after an interruption
    torchrun --nproc-per-node 2 -m integration.train --task sort ...  # gloo on CPU

Every field of ``integration.config.RunConfig`` is an option (``--num-strata 4``, ``--dps`` /
``--no-dps``, ``--advantage-scale none``, ``--leave-one-out``, ...); a task starts from its defaults
(``TASK_DEFAULTS``: model size, SFT steps), a ``--method`` preset sets the objective, estimator,
token-weight and advantage settings (``config.preset_settings``), and explicit options override both. With
``--resume`` the configuration is read from the run's checkpoint (options given must agree with it).
Writes ``metrics.jsonl`` (one record per step) and ``checkpoint.pt`` under ``--run-dir``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from pathlib import Path

import torch

from daca_kernels.diffusion_options import DiffusionOptions
from daca_kernels.likelihood import ESTIMATORS
from daca_kernels.losses.advantages import ADVANTAGE_SCALES
from daca_kernels.losses.grpo import LOSS_TYPES
from daca_kernels.losses.spg import NEGATIVE_BOUNDS
from daca_kernels.objectives import OBJECTIVES
from daca_kernels.presets import PRESETS
from integration.checkpoint import load_checkpoint
from integration.config import BACKENDS, TASK_DEFAULTS, RunConfig, preset_settings, task_config
from integration.distributed import close_world, init_world
from integration.trainer import Trainer

CHOICES = {"task": list(TASK_DEFAULTS), "objective": list(OBJECTIVES), "estimator": ESTIMATORS, "backend": BACKENDS,
           "spg_bound": NEGATIVE_BOUNDS, "loss_type": LOSS_TYPES, "advantage_scale": ADVANTAGE_SCALES}
NESTED = ("diffusion", "model", "sft")  # diffusion's options are flat options; model, sft: the task's defaults


def _options() -> list[tuple[str, object]]:
    """Every command-line option's field name and type hint: DiffusionOptions', then RunConfig's."""
    options = []
    for cls in (DiffusionOptions, RunConfig):
        hints = typing.get_type_hints(cls)
        options += [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.name not in NESTED]
    return options


def _option_type(hint):
    """``int`` for ``int`` and ``int | None``, and so on."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run configuration (default: the task's defaults, see RunConfig)")
    for name, hint in _options():
        option = "--" + name.replace("_", "-")
        kind = _option_type(hint)
        if kind is bool:
            group.add_argument(option, action=argparse.BooleanOptionalAction, default=None)
        elif typing.get_origin(kind) is list:  # dps_clip: LOW HIGH
            group.add_argument(option, type=typing.get_args(kind)[0], nargs=2, default=None)
        else:
            group.add_argument(option, type=kind, default=None, choices=CHOICES.get(name))


def parse_config(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=Path("runs/cache"), help="SFT checkpoint cache")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint.pt")
    parser.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")
    parser.add_argument("--method", choices=list(PRESETS), default=None,
                        help="a preset of the objective, estimator, token-weight and advantage settings")
    parser.add_argument("--no-progress", action="store_true")
    _add_config_options(parser)
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name, _ in _options() if getattr(args, name) is not None}
    if args.method is not None:
        given = {**preset_settings(args.method), **given}
    if args.resume:
        saved = load_checkpoint(args.run_dir / "checkpoint.pt", required=("config",))["config"]
        config = RunConfig.from_dict(saved).replace(**given)
    else:
        config = task_config(given.pop("task", RunConfig.task), **given)
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
