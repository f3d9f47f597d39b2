"""``DiffusionGRPOTrainer`` on hub-style checkpoints of the full-attention families, given as a path the way a
TRL user gives a hub id (``trust_remote_code=True``), with TRL's defaults otherwise (activation checkpointing
on) and a reference model (``beta > 0``): 2 steps of ``train()``, ``save_model``, a reload through the
family's Auto class that gives the trained model, and a run resumed from a checkpoint equal to an
uninterrupted one.

TRL loads a path with ``AutoModelForCausalLM`` unless the checkpoint's ``auto_map`` names a class it looks
for; Dream and DiffuCoder map ``AutoModel`` only, which the trainer's loader uses for them. The reference
model is the trainer's copy of the policy (TRL would reload the path).

The checkpoints hold the task vocabulary of tests/trl_setup.py (the character tokenizer drives them).
"""
from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from daca_kernels.models.activation_checkpointing import checkpointed_layers  # noqa: E402
from daca_kernels.trl import DiffusionGRPOTrainer  # noqa: E402
from released import hub  # noqa: E402
from released.task_checkpoints import task_checkpoint  # noqa: E402
from tests.trl_setup import (  # noqa: E402
    digit_reward,
    sort_dataset,
    sort_reward,
    sort_tokenizer,
    straight_and_resumed,
    tiny_config,
)

FOLDERS = ("llada", "llada_dllm", "lladamoe", "dream", "dream_dllm")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


def trainer_of(name: str, path, output_dir, *, num_prompts: int = 4, **overrides) -> DiffusionGRPOTrainer:
    """The trainer of the checkpoint at ``path``, as a user builds it: the path, ``trust_remote_code``,
    a reference model (``beta``), TRL's defaults otherwise with the CPU settings of ``tiny_config``; Dream's
    folders roll out with Dream's own sampler."""
    if name.startswith("dream"):
        overrides = {"sampling_rule": "dream", **overrides}
    args = tiny_config(str(output_dir), trust_remote_code=True, beta=0.04, **overrides)
    # cuda_on_cpu: dllm's LLaDA builds its backbone on "cuda" whatever the machine.
    with warnings.catch_warnings(), hub.cuda_on_cpu():
        warnings.simplefilter("ignore")  # the released files' own warnings, and the buffer repair's
        return DiffusionGRPOTrainer(model=str(path), reward_funcs=[sort_reward, digit_reward], args=args,
                                    train_dataset=sort_dataset(num_prompts), processing_class=sort_tokenizer())


@pytest.mark.parametrize("name", FOLDERS)
def test_trains_saves_and_reloads(tmp_path, name):
    path = task_checkpoint(name, tmp_path / name)
    trainer = trainer_of(name, path, tmp_path / "run", max_steps=2)
    policy, reference = trainer.model, trainer.ref_model
    assert trainer.args.activation_checkpointing  # TRL's default (transformers 4 names it gradient_checkpointing)
    assert trainer.shift == name.startswith("dream")
    assert type(policy).__name__ == hub.FAMILIES[name].architectures[0]
    assert reference is not None and reference is not policy and not reference.training
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters()), "the policy did not move"
    for n, p in reference.named_parameters():
        assert torch.equal(p, before[n]), f"the reference model moved: {n}"
    assert any("kl_mean" in log for log in trainer.state.log_history)
    if name == "llada":  # no checkpointing of its own: the library's, applied by train()
        assert checkpointed_layers(policy)
    else:
        assert policy.is_gradient_checkpointing

    trainer.save_model(str(tmp_path / f"final-{name}"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = hub.load(tmp_path / f"final-{name}", name)
    saved, got = policy.state_dict(), reloaded.state_dict()
    assert got.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(got[key], tensor), key
    ids = torch.randint(4, 14, (2, 9), generator=torch.Generator().manual_seed(1))
    policy.eval()
    kwargs = {"use_cache": False} if name.startswith("llada") and name != "lladamoe" else {}
    kwargs = {"attention_mask": "full"} if name == "dream_dllm" else kwargs
    with torch.no_grad():
        # The same weights and code: equal logits (exact, but for the trained policy's checkpointing
        # wrappers, which change no arithmetic).
        assert torch.equal(reloaded(input_ids=ids, **kwargs).logits, policy(input_ids=ids, **kwargs).logits)


@pytest.mark.parametrize("name", FOLDERS)
def test_resumed_run_equals_uninterrupted(tmp_path, name):
    # 4 steps (2 generations of 2 inner iterations) straight, or 2 steps, a checkpoint, and a new trainer
    # resuming from it: the same parameters.
    path = task_checkpoint(name, tmp_path / name)
    settings = dict(num_iterations=2, max_steps=4, num_prompts=8, save_strategy="steps", save_steps=2)
    straight, resumed, start = straight_and_resumed(lambda folder: trainer_of(name, path, folder, **settings),
                                                    tmp_path)
    moved = False
    for (key, want), got in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=key)
        moved |= not torch.equal(want, start[key])
    assert moved, "the runs must train for the comparison to mean anything"


def test_dllm_llada_keeps_its_own_checkpointing(tmp_path):
    """dllm's LLaDA declares activation checkpointing through transformers 4's hook, which takes no
    ``every_n_layers``: the loaded model's hook is called without it, and a value it cannot honour is
    refused."""
    path = task_checkpoint("llada_dllm", tmp_path / "llada_dllm")
    with warnings.catch_warnings(), hub.cuda_on_cpu():
        warnings.simplefilter("ignore")
        model = hub.load(path, "llada_dllm").train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert model.is_gradient_checkpointing and not checkpointed_layers(model)  # its own, not the library's
    if "every_n_layers" in inspect.signature(enable).parameters:  # transformers 5
        with pytest.raises(ValueError, match="every_n_layers"):
            enable(every_n_layers=2)
