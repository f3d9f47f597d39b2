"""The example (examples/diffusion_grpo.py) and its recipes: each recipe file parses with TRL's
``TrlParser`` as the script reads it, and its trainer settings, sizes shrunk, train one step on the
double of the family it names (tests/families); the GSM8K prompt format and rewards on hand-made
completions. The models and GSM8K themselves are not downloaded."""
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")

from daca_kernels.trl import DiffusionGRPOTrainer  # noqa: E402
from integration.tasks import vocab  # noqa: E402
from tests.trl_setup import (  # noqa: E402
    TASK,
    digit_reward,
    family_model,
    import_example,
    sort_dataset,
    sort_reward,
    sort_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
# Recipe file -> (family double, what the recipe must keep).
RECIPES = {
    "llada_gsm8k.yaml": ("llada", dict(preset="daca-grpo", estimator="stratified", mask_token_id=126336)),
    "llada_moe_gsm8k.yaml": ("llada_moe", dict(preset="daca-grpo", estimator="stratified", mask_token_id=156895)),
    "dream_gsm8k.yaml": ("dream", dict(preset="daca-grpo", estimator="stratified", shift_logits=True,
                                       sampling_rule="dream", sampling_alg="entropy", top_p=0.95)),
    "diffucoder_gsm8k.yaml": ("dream", dict(preset="coupled+DACA", estimator="coupled", leave_one_out=True,
                                            shift_logits=True, sampling_rule="dream", sampling_alg="entropy",
                                            top_p=0.95)),
}
# CPU, one step, the task's completion length; the double's mask id where the recipe names the
# released model's.
SHRUNK = ["--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--max_steps", "1", "--save_strategy", "no",
          "--max_completion_length", str(TASK.completion_length), "--block_length", str(TASK.completion_length),
          "--diffusion_steps", "2", "--disable_tqdm", "true"]


@pytest.fixture(scope="module")
def example():
    return import_example("diffusion_grpo")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_path_one_thread")]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_trains_one_step_on_its_family(tmp_path, example, recipe):
    family, expected = RECIPES[recipe]
    argv = ["--config", str(ROOT / "examples" / recipe), "--output_dir", str(tmp_path), "--use_cpu", "true"]
    script_args, config, model_args = example.parse_arguments(argv)
    assert (script_args.dataset_name, script_args.dataset_config) == ("openai/gsm8k", "main")
    assert model_args.model_name_or_path and model_args.dtype == "bfloat16" and config.trust_remote_code
    assert config.gradient_checkpointing and config.bf16 and config.beta > 0
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    mask = ["--mask_token_id", str(vocab.mask_id)] if "mask_token_id" in expected else []
    _, config, _ = example.parse_arguments(argv + SHRUNK + mask)
    assert config.num_generations == 6 and config.num_iterations == 12  # the recipe's, kept
    trainer = DiffusionGRPOTrainer(model=family_model(family), reward_funcs=[sort_reward, digit_reward], args=config,
                                   train_dataset=sort_dataset(4), processing_class=sort_tokenizer())
    result = trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(result.training_loss)
    assert trainer.shift == expected.get("shift_logits", False)


def test_prompts_and_rewards(example):
    row = example.to_prompt({"question": "How many?", "answer": "6 * 2 = 12\n#### 1,012"})
    assert row["answer"] == "1012" and row["prompt"][0]["content"].startswith("How many?")
    good = [{"role": "assistant", "content": "<reasoning>\n6 + 6\n</reasoning>\n<answer>\n1,012\n</answer>"}]
    bad = [{"role": "assistant", "content": "the answer is 12"}]
    assert example.correctness_reward(None, [good, bad], ["1012", "1012"]) == [2.0, 0.0]
    assert example.format_reward(None, [good, bad]) == [0.5, 0.0]
