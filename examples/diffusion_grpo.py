"""DACA-GRPO on GSM8K with TRL: ``accelerate launch ... examples/diffusion_grpo.py examples/llada_gsm8k.yaml``.

The recipe file (YAML) holds ``model`` (a hub id or a local path), ``dtype`` and ``trainer`` (the
keyword arguments of :class:`daca_kernels.trl.DiffusionGRPOConfig`). Prompts are GSM8K questions
with a format instruction; two TRL reward functions score the completions: the final answer (2.0
when it equals GSM8K's) and the format (0.5 for ``<reasoning>...</reasoning><answer>...</answer>``).
"""
from __future__ import annotations

import re
import sys

import torch
import yaml

from daca_kernels.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer

INSTRUCTION = ("Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
               "Put only the final number inside <answer>.")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT = re.compile(r"^\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>\s*$", re.DOTALL)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_recipe(path: str) -> dict:
    with open(path) as f:
        recipe = yaml.safe_load(f)
    missing = {"model", "trainer"} - set(recipe)
    if missing:
        raise ValueError(f"{path}: the recipe needs the keys {', '.join(sorted(missing))}")
    return recipe


def build_config(recipe: dict) -> DiffusionGRPOConfig:
    """The trainer configuration of a recipe (its ``trainer`` mapping)."""
    return DiffusionGRPOConfig(**recipe["trainer"])


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K's reference answer: what follows ``####`` in a solution, without thousands separators."""
    return solution.split("####")[-1].strip().replace(",", "")


def to_prompt(example: dict) -> dict:
    """One GSM8K row as a conversational prompt and its final answer."""
    return {"prompt": [{"role": "user", "content": f"{example['question']}\n{INSTRUCTION}"}],
            "answer": gsm8k_final_answer(example["answer"])}


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def extracted_answer(text: str) -> str | None:
    """The last number inside ``<answer>...</answer>`` (or in the whole text without the tags)."""
    match = ANSWER.findall(text)
    numbers = NUMBER.findall(match[-1] if match else text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """2.0 when the extracted answer equals the reference numerically, else 0."""
    rewards = []
    for completion, reference in zip(completions, answer):
        got = extracted_answer(_text(completion))
        try:
            rewards.append(2.0 if got is not None and float(got) == float(reference) else 0.0)
        except ValueError:
            rewards.append(0.0)
    return rewards


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 for a completion in the reasoning/answer format, else 0."""
    return [0.5 if FORMAT.match(_text(completion)) else 0.0 for completion in completions]


def main(path: str) -> None:
    from datasets import load_dataset
    from transformers import AutoModel, AutoTokenizer

    recipe = load_recipe(path)
    config = build_config(recipe)
    dtype = getattr(torch, recipe.get("dtype", "bfloat16"))
    model = AutoModel.from_pretrained(recipe["model"], trust_remote_code=True, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(recipe["model"], trust_remote_code=True)
    dataset = load_dataset("openai/gsm8k", "main", split="train").map(to_prompt, remove_columns=["question"])
    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=[correctness_reward, format_reward], args=config,
                                   train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(config.output_dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: examples/diffusion_grpo.py RECIPE.yaml")
    main(sys.argv[1])
