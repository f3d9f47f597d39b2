"""``DiffusionGRPOTrainer`` on the released SDAR / TraDo and LLaDA2 code, with TRL's defaults.

A hub-style checkpoint of each family's released files on the task vocabulary of tests/trl_setup.py (the
tokenizer there drives it) is loaded the way a user loads it and passed to the trainer as an object, with
TRL's defaults otherwise: a reference model (``beta > 0``), activation checkpointing on. Two steps of
``train()``, ``save_model``, a reload through the family's Auto class with ``trust_remote_code`` (the same
weights and logits), and a resumed run equal to an uninterrupted one.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("trl")

from daca_kernels.models.model_loading import from_pretrained  # noqa: E402
from daca_kernels.trl import DiffusionGRPOTrainer  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from released import hub  # noqa: E402
from tests.trl_setup import (  # noqa: E402
    digit_reward,
    sort_dataset,
    sort_reward,
    sort_tokenizer,
    straight_and_resumed,
    tiny_config,
)

NAMES = ("sdar", "llada2")
TASK_IDS = dict(vocab_size=vocab.size, mask_token_id=vocab.mask_id, eos_token_id=vocab.eos_id,
                pad_token_id=vocab.pad_id)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


def quiet_load(directory, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hub.load(directory, name)


def trainer_of(tmp_path, name, directory, *, num_prompts=4, **overrides):
    """The trainer of the checkpoint's model with TRL's defaults and the CPU settings of ``tiny_config``; the
    block families decode their own blocks (``block_length`` unset)."""
    model = quiet_load(directory, name).train()
    args = tiny_config(str(tmp_path), block_length=None, **overrides)
    return DiffusionGRPOTrainer(model=model, reward_funcs=[sort_reward, digit_reward], args=args,
                                train_dataset=sort_dataset(num_prompts), processing_class=sort_tokenizer())


def logits(model, ids):
    """``model(ids)``'s logits with a block-causal bool mask built here (SDAR takes it as is, LLaDA2 as an
    additive mask in its dtype)."""
    size = model.config.block_size
    block = torch.arange(ids.shape[1]) // size
    keep = (block[None, :] <= block[:, None])[None, None]
    if type(model).__name__.startswith("LLaDA2"):
        dtype = next(model.parameters()).dtype
        keep = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return model(input_ids=ids, attention_mask=keep, use_cache=False).logits


@pytest.mark.parametrize("name", NAMES)
def test_trains_saves_and_reloads_with_trls_defaults(tmp_path, name):
    directory = hub.write_checkpoint(name, tmp_path / "hub", seed=4, **TASK_IDS)
    trainer = trainer_of(tmp_path / "run", name, directory, max_steps=2, beta=0.04)
    assert trainer.args.gradient_checkpointing and trainer.ref_model is not None  # TRL's defaults, kept
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    trainer.save_model(str(tmp_path / "final"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = from_pretrained(AutoModelForCausalLM, str(tmp_path / "final"), trust_remote_code=True).eval()
    policy = trainer.model.eval()
    want = policy.state_dict()
    assert reloaded.state_dict().keys() == want.keys()
    for key, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, want[key]), key  # saved and read back: exact by construction
    ids = torch.randint(4, 14, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(logits(reloaded, ids), logits(policy, ids))


@pytest.mark.parametrize("name", NAMES)
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, name):
    # 4 steps (2 generations of 2 inner iterations) straight, or 2 steps, a checkpoint, and a new trainer
    # resuming from it: the same parameters, up to float32 rounding of the same computation.
    directory = hub.write_checkpoint(name, tmp_path / "hub", seed=5, **TASK_IDS)
    settings = dict(num_iterations=2, max_steps=4, num_prompts=8, save_strategy="steps", save_steps=2, beta=0.04)
    straight, resumed, start = straight_and_resumed(
        lambda folder: trainer_of(folder, name, directory, **settings), tmp_path)
    moved = False
    for (key, want), got in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=key)
        moved |= not torch.equal(want, start[key])
    assert moved
