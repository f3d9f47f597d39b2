"""The recipe path of examples/diffusion_grpo.py on hub-style checkpoints of the full-attention families:
each recipe file parsed by the script's parser with ``model_name_or_path`` pointing at a checkpoint of the
released code it names (its sizes shrunk for a CPU), the model and tokenizer loaded by the script's own
``load_model`` (``AutoModel``, ``trust_remote_code``, the recipe's bfloat16), one step of training with the
recipe's settings, and ``save_model``, which reloads to the trained weights. GSM8K itself is not downloaded:
the task prompts and rewards of tests/trl_setup.py stand in for it.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from daca_kernels.trl import DiffusionGRPOTrainer  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from released import hub  # noqa: E402
from released.task_checkpoints import task_checkpoint  # noqa: E402
from tests.trl_setup import TASK, digit_reward, import_example, sort_dataset, sort_reward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# (recipe, folder of the released code it names): DiffuCoder ships Dream's code; dllm's copies are the
# variants users also load under the same recipes.
CASES = [("llada_gsm8k.yaml", "llada"), ("llada_gsm8k.yaml", "llada_dllm"), ("llada_moe_gsm8k.yaml", "lladamoe"),
         ("dream_gsm8k.yaml", "dream"), ("dream_gsm8k.yaml", "dream_dllm"), ("diffucoder_gsm8k.yaml", "dream")]
# CPU, one step, the task's completion length; no warm-up (the recipes' first step has a learning rate of 0)
# and a learning rate at which one step moves bfloat16 weights (the recipes' 3e-6 moves none: the script's
# bfloat16 model trains in bfloat16 without a GPU's mixed precision).
SHRUNK = ["--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--max_steps", "1", "--save_strategy", "no",
          "--max_completion_length", str(TASK.completion_length), "--block_length", str(TASK.completion_length),
          "--diffusion_steps", "2", "--disable_tqdm", "true", "--learning_rate", "1e-2",
          "--warmup_steps", "0"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


@pytest.fixture(scope="module")
def example():
    return import_example("diffusion_grpo")


@pytest.mark.parametrize("recipe, name", CASES)
def test_recipe_trains_a_released_checkpoint(tmp_path, example, recipe, name):
    path = task_checkpoint(name, tmp_path / name, tokenizer=True)
    argv = ["--config", str(ROOT / "examples" / recipe), "--output_dir", str(tmp_path / "run"),
            "--model_name_or_path", str(path), *SHRUNK]
    _, recipe_config, _ = example.parse_arguments(argv)
    if recipe_config.mask_token_id is not None:  # the released tokenizer's id: the tiny vocabulary's instead
        argv += ["--mask_token_id", str(vocab.mask_id)]
    _, config, model_args = example.parse_arguments(argv)
    assert model_args.dtype == "bfloat16" and config.trust_remote_code and config.activation_checkpointing
    with warnings.catch_warnings(), hub.cuda_on_cpu():  # dllm's LLaDA builds its backbone on "cuda"
        warnings.simplefilter("ignore")
        model, tokenizer = example.load_model(model_args, config)
        assert type(model).__name__ == hub.FAMILIES[name].architectures[0] and model.dtype == torch.bfloat16
        trainer = DiffusionGRPOTrainer(model=model, reward_funcs=[sort_reward, digit_reward], args=config,
                                       train_dataset=sort_dataset(4), processing_class=tokenizer)
    assert trainer.shift == name.startswith("dream") and trainer.ref_model is not None
    before = {key: p.detach().clone() for key, p in model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[key]) for key, p in model.named_parameters()), "the policy did not move"
    trainer.save_model(config.output_dir)  # what the script does after training
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = hub.load(config.output_dir, name, dtype=torch.bfloat16)
    saved, got = model.state_dict(), reloaded.state_dict()
    assert got.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(got[key], tensor), key
