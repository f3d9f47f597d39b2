"""Run by the torchrun test: one process of a 2-process run computes the first update's
gradients of step 0 and rank 0 saves them (summed over processes) to ``--out``."""
import argparse
import os

import torch

from integration.config import RunConfig
from integration.distributed import close_world, init_world
from integration.model import ModelConfig
from integration.sft import SFTConfig
from integration.trainer import Trainer


def tiny_config(**changes) -> RunConfig:
    """The configuration the distributed test and its single-process twin share."""
    values = dict(
        task="sort", estimator="stratified", dps=True, steps=1, prompts_per_step=4, group_size=4, inner_iterations=2,
        eval_prompts=8, model=ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        sft=SFTConfig(steps=5, batch_size=16),
    )
    return RunConfig.from_flat(**{**values, **changes})


def first_update_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    batch = trainer.collect(0)
    trainer.loss_gradients(batch, 1)
    return {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = init_world()
    try:
        trainer = Trainer(tiny_config(), os.path.join(os.path.dirname(args.out), "run"), cache_dir=args.cache,
                          world=world, progress=False)
        grads = first_update_gradients(trainer)
        if world.is_main:
            torch.save(grads, args.out)
    finally:
        close_world(world)


if __name__ == "__main__":
    main()
