"""Child of tests/trainer/test_trl_deepspeed.py: ``DiffusionGRPOTrainer`` on the released Dream (full
attention) and SDAR (block diffusion) files, as hub-style tiny checkpoints in ``argv[2]``
(tests/released/hub.py), on one process or under ``accelerate launch`` with an examples/ DeepSpeed
config on two. Process 0 writes ``argv[1]/results.pt``:

- ``params``: per ``(family, objective)``, the parameters after one step with the global batch of 4
  rollouts (``grpo``: preset daca-grpo, SML with DPS and ``beta > 0``; ``bgpo``), gathered whole;
- ``initial``: the parameters before training (the same seed's checkpoint);
- ``rollouts``: per family, per rollout of the policy (each a ``generate`` call), how many times
  DeepSpeed gathered parameters and how many forwards the sampler ran; ``per_forward_rollout``, the
  same for one rollout with ``ds3_gather_for_generation=False`` (ZeRO-3 only);
- ``head_partitioned``: whether each process held only part of the LM head during training;
- ``straight``: SDAR's parameters after 2 grpo steps with ``beta > 0`` (the second one pulled by the
  KL term to the reference model), and the logged KL; with ``--resume``, ``resumed`` and ``reloaded``:
  after 1 step, a checkpoint and a new trainer resuming from it, and the model saved at step 2
  loaded again from its files;
- ``llada``: the released LLaDA's parameters before and after one grpo step, or the error that
  stopped it;
- ``built_partitioned``: per ``(family, objective)``, whether the policy was partitioned when the
  trainer was built (Dream's grpo policy is loaded before the config exists, the others after);
- with ``--refuse``, ``refused``: the error of a trainer whose config offloads parameters to NVMe.
"""
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from released import hub  # noqa: E402

import daca_kernels.trl.trainer as trainer_module  # noqa: E402
from daca_kernels.models.model_loading import from_pretrained  # noqa: E402
from daca_kernels.trl import DiffusionGRPOTrainer, zero3  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from tests.trl_setup import sort_dataset, sort_tokenizer, tiny_config  # noqa: E402

FAMILIES = ("dream", "sdar")
OBJECTIVES = {"grpo": dict(preset="daca-grpo", beta=0.04),
              "bgpo": dict(objective="bgpo", estimator="stratified", num_strata=2, dps=True)}
# The released files with the task's vocabulary and special ids (the tokenizer of tests/trl_setup).
VOCAB = dict(vocab_size=vocab.size, mask_token_id=vocab.mask_id, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id)


def even_reward(completions, completion_ids, **kwargs) -> list[float]:
    """The share of even token ids in each completion: the rewards of a random policy's group differ."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def write_checkpoints(folder: Path) -> None:
    for family in FAMILIES:
        hub.write_checkpoint(family, folder / family, seed=1, **VOCAB)
    hub.write_checkpoint("llada", folder / "llada", seed=1, embedding_size=vocab.size, **VOCAB)


def whole(model) -> dict:
    """Every parameter of ``model``, whole (gathered on every process under ZeRO-3)."""
    with zero3.gathered(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


class Counts:
    """Counts the ZeRO-3 parameter gathers of ``trainer``'s policy (every call of a partitioned
    parameter's ``all_gather`` or ``all_gather_coalesced``, each one collective over a list of
    parameters) and its backbone's forwards, per rollout: from the rollout's prompts
    (``_left_padded_prompts``, just before it) to the end of the sampler's call
    (``daca_kernels.trl.trainer.generate``)."""

    def __init__(self, trainer):
        model = trainer.model
        self.gathers = self.forwards = 0
        self.start = (0, 0)
        self.rollouts = []
        model.base_model.register_forward_pre_hook(self._forward)
        prompts = trainer._left_padded_prompts

        def marked(*args, **kwargs):
            # A policy built whole is partitioned when training starts: its gathers are wrapped then.
            self._wrap(model)
            self.start = (self.gathers, self.forwards)
            return prompts(*args, **kwargs)

        trainer._left_padded_prompts = marked
        self.generate = trainer_module.generate
        trainer_module.generate = self._rollout

    def _wrap(self, model) -> None:
        for p in model.parameters():
            for name in ("all_gather", "all_gather_coalesced"):
                gather = getattr(p, name, None)
                if gather is not None and not getattr(gather, "counted", False):
                    setattr(p, name, self._counted(gather))

    def _counted(self, gather):
        def counted(*args, **kwargs):
            self.gathers += 1
            return gather(*args, **kwargs)
        counted.counted = True
        return counted

    def _forward(self, *args):
        self.forwards += 1

    def _rollout(self, *args, **kwargs):
        result = self.generate(*args, **kwargs)
        self.rollouts.append((self.gathers - self.start[0], self.forwards - self.start[1]))
        return result

    def close(self):
        trainer_module.generate = self.generate


def build(family: str, checkpoints: Path, output_dir: str, world: int, *, load_first: bool = False,
          **settings) -> DiffusionGRPOTrainer:
    """The trainer of ``family``. Dream's auto_map has no AutoModelForCausalLM (TRL's loader): it is
    passed as an object, loaded after the config exists (ZeRO-3 then builds it partitioned) or, with
    ``load_first``, before (whole until the engine partitions it). The other families' paths are
    loaded by TRL (partitioned as they load under ZeRO-3)."""
    settings = {"per_device_train_batch_size": 4 // world, "max_steps": 1, "trust_remote_code": True, "optim": "sgd",
                "learning_rate": 1.0, **settings}
    if family == "sdar":
        settings["block_length"] = None  # its own blocks
    model = hub.load(checkpoints / "dream", "dream") if family == "dream" and load_first else None
    args = tiny_config(output_dir, **settings)
    if family == "dream" and model is None:
        model = hub.load(checkpoints / "dream", "dream")
    model = str(checkpoints / family) if model is None else model
    return DiffusionGRPOTrainer(model=model, reward_funcs=[even_reward], args=args, train_dataset=sort_dataset(8),
                                processing_class=sort_tokenizer())


def main() -> None:
    out, checkpoints = Path(sys.argv[1]), Path(sys.argv[2])
    resume, refuse = "--resume" in sys.argv[3:], "--refuse" in sys.argv[3:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    results = {"world_size": world, "params": {}, "initial": {}, "rollouts": {}, "head_partitioned": {},
               "built_partitioned": {}}
    # One folder for every process (argv[1]): the checkpoints process 0 saves are read by all.
    scratch = out / "runs"
    for family in FAMILIES:
        for objective, settings in OBJECTIVES.items():
            # Dream's grpo run (the first: no DeepSpeed config exists yet) loads its model before the
            # config, so that both ways a reference copy is made under ZeRO-3 are run.
            trainer = build(family, checkpoints, os.path.join(scratch, f"{family}-{objective}"), world,
                            load_first=(family, objective) == ("dream", "grpo"), **settings)
            model = trainer.model
            results["built_partitioned"][(family, objective)] = zero3.is_partitioned(model)
            if objective == "grpo":
                results["initial"][family] = whole(model)
            counts = Counts(trainer)
            trainer.train()
            head = model.get_output_embeddings().weight
            results["head_partitioned"][family] = hasattr(head, "ds_tensor") and \
                head.ds_tensor.numel() < head.ds_numel
            results["params"][(family, objective)] = whole(model)
            if objective == "grpo":
                results["rollouts"][family] = list(counts.rollouts)
                if family == "sdar" and zero3.is_partitioned(model):
                    trainer.args.ds3_gather_for_generation = False
                    counts.rollouts.clear()
                    model.eval()
                    trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
                    results["per_forward_rollout"] = list(counts.rollouts)
            counts.close()
    results["llada"] = llada_step(checkpoints, scratch, world)
    results.update(two_steps(checkpoints, scratch, world, resume))
    if refuse:
        results["refused"] = refused(checkpoints, scratch, world)
    if rank == 0:
        torch.save(results, out / "results.pt")


def llada_step(checkpoints: Path, scratch: Path, world: int) -> dict:
    """The released LLaDA (hub code) from its path, one grpo step: ``initial`` and ``params``, or the
    ``error`` that stopped it (every process stops at the same check, so none waits on another)."""
    try:
        trainer = build("llada", checkpoints, str(scratch / "llada"), world, **OBJECTIVES["grpo"])
        initial = whole(trainer.model)
        trainer.train()
    except (ValueError, TypeError, AttributeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"initial": initial, "params": whole(trainer.model)}


def refused(checkpoints: Path, scratch: Path, world: int) -> str:
    """The error of a trainer built as ``offload_param_device: nvme`` in the accelerate config would
    build it (the variables ``accelerate launch`` sets for it), with ``beta > 0``; ``"built"`` if none."""
    nvme = {"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme",
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": str(scratch)}
    saved = {key: os.environ.get(key) for key in nvme}
    os.environ.update(nvme)
    try:
        build("sdar", checkpoints, str(scratch / "nvme"), world, **OBJECTIVES["grpo"])
    except ValueError as error:
        return str(error)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    return "built"


def two_steps(checkpoints: Path, scratch: Path, world: int, resume: bool) -> dict:
    """SDAR, grpo with ``beta > 0``, 2 steps straight through (``straight``: at step 2 the policy has
    moved from the reference, so the KL term pulls); with ``resume``, also 1 step, a checkpoint and a
    new trainer resuming from it (``resumed``, ``resumed_step``), and the model saved at step 2 loaded
    from its files (``reloaded``)."""
    settings = dict(OBJECTIVES["grpo"], max_steps=2, save_strategy="steps" if resume else "no", save_steps=1)
    straight = build("sdar", checkpoints, str(scratch / "straight"), world, **settings)
    straight.train()
    results = {"straight": whole(straight.model), "straight_kl": [log["kl_mean"] for log in straight.state.log_history
                                                                   if "kl_mean" in log]}
    if resume:
        resumed = build("sdar", checkpoints, str(scratch / "resumed"), world, **settings)
        resumed.train(resume_from_checkpoint=str(scratch / "straight" / "checkpoint-1"))
        reloaded = from_pretrained(transformers.AutoModelForCausalLM, str(scratch / "straight" / "checkpoint-2"),
                                   trust_remote_code=True, dtype=torch.float32)
        results.update(resumed=whole(resumed.model), resumed_step=resumed.state.global_step, reloaded=whole(reloaded))
    return results


def skip_shared_memory_op() -> None:
    """At its first process-group start on a CPU, DeepSpeed compiles a shared-memory all-reduce op (C++,
    with ninja; a minute or more, once per machine) that only its inference all-reduce uses; training
    here goes through gloo's collectives. The op is marked unavailable, so a machine without a C++
    compiler runs these tests too and none waits for the build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


if __name__ == "__main__":
    os.environ.setdefault("DACA_BACKEND", "torch")
    skip_shared_memory_op()
    if sys.argv[1] == "--write-checkpoints":
        write_checkpoints(Path(sys.argv[2]))
    else:
        main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
