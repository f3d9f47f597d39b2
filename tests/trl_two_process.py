"""Child of tests/trainer/test_trl_trainer.py: for each objective in ``argv[2:]`` (default ``grpo``),
one optimiser step of a fresh tiny trainer (tests/trl_setup.py) with the global batch of 4 rollouts,
saving the gradients the optimiser gets (averaged over the processes) to ``argv[1]/<objective>.pt``
from process 0. Run alone or with ``accelerate launch --num_processes 2``; one run covers every
objective, so the interpreter and its imports start once."""
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
    # One output folder for every objective: the policy checkpoint the first trainer saves (before
    # the process group exists) is the one each later trainer loads, the same seed's weights; once
    # the group exists, transformers saves on rank 0 only, into rank 0's folder.
    with tempfile.TemporaryDirectory() as output_dir:
        for objective in sys.argv[2:] or ["grpo"]:
            settings = dict(preset="daca-grpo") if objective == "grpo" else dict(
                objective=objective, estimator="stratified", num_strata=2, dps=True)
            trainer = tiny_trainer(output_dir, per_device_train_batch_size=4 // world, max_steps=1, **settings)
            trainer.add_callback(SaveGradients(os.path.join(sys.argv[1], f"{objective}.pt")))
            trainer.train()


if __name__ == "__main__":
    main()
