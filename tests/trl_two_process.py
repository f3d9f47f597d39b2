"""Child of tests/trainer/test_trl_trainer.py: one optimiser step of the tiny trainer (tests/trl_setup.py)
with the global batch of 4 rollouts, saving the gradients the optimiser gets (averaged over the
processes) to ``argv[1]`` from process 0. Run alone or with ``accelerate launch --num_processes 2``.
``argv[2]`` (optional) is an objective."""
import os
import sys
import tempfile

import torch
from transformers import TrainerCallback

from tests.trl_setup import tiny_trainer


class SaveGradients(TrainerCallback):
    def __init__(self, path: str):
        self.path = path

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0 and args.process_index == 0:
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
            torch.save({"world_size": args.world_size, "grads": grads}, self.path)


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    objective = sys.argv[2] if len(sys.argv) > 2 else "grpo"
    settings = dict(preset="daca-grpo") if objective == "grpo" else dict(objective=objective, estimator="stratified",
                                                                          num_strata=2, dps=True)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = tiny_trainer(output_dir, per_device_train_batch_size=4 // world, max_steps=1, **settings)
        trainer.add_callback(SaveGradients(sys.argv[1]))
        trainer.train()


if __name__ == "__main__":
    main()
