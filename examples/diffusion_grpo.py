"""DACA-GRPO on GSM8K with TRL: ``accelerate launch ... examples/diffusion_grpo.py --config examples/llada_gsm8k.yaml``.

Arguments are TRL's (:class:`trl.TrlParser` over ``ScriptArguments``, :class:`DiffusionGRPOConfig`
and ``ModelConfig``): a recipe file (``--config``, flat YAML of their fields) and command-line
options, which win over the file. The model is the hub id or path ``model_name_or_path``, loaded
with ``AutoModel`` and ``trust_remote_code`` (the released diffusion LMs ship their own modeling
code) through the library's loader; ``dtype`` as in ``ModelConfig``. Prompts are GSM8K questions (``dataset_name``,
``dataset_config``, ``dataset_train_split``) with a format instruction; two TRL reward functions
score the completions: the final answer (2.0 when it equals GSM8K's) and the format (0.5 for
``<reasoning>...</reasoning><answer>...</answer>``).
"""
from __future__ import annotations

import re

from trl import ModelConfig, ScriptArguments, TrlParser

from daca_kernels.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer

INSTRUCTION = ("Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
               "Put only the final number inside <answer>.")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT = re.compile(r"^\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>\s*$", re.DOTALL)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_arguments(argv: list[str] | None = None) -> tuple[ScriptArguments, DiffusionGRPOConfig, ModelConfig]:
    """``(script, trainer, model)`` arguments from ``argv`` (default: the command line), e.g.
    ``["--config", "examples/llada_gsm8k.yaml", "--max_steps", "10"]``."""
    parser = TrlParser((ScriptArguments, DiffusionGRPOConfig, ModelConfig))
    return parser.parse_args_and_config(argv)


def load_model(model_args: ModelConfig, training_args: DiffusionGRPOConfig):
    """The policy and its tokenizer from ``model_name_or_path`` (remote code allowed when the
    recipe sets ``trust_remote_code``). The policy is loaded with ``AutoModel`` through
    :func:`daca_kernels.models.from_pretrained`, which helps the released modeling code
    (written for transformers 4) under the installed transformers."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from daca_kernels.models import from_pretrained

    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    options = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code)
    model = from_pretrained(AutoModel, model_args.model_name_or_path, dtype=dtype,
                            attn_implementation=model_args.attn_implementation, **options)
    return model, AutoTokenizer.from_pretrained(model_args.model_name_or_path, **options)


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


REWARD_FUNCS = [correctness_reward, format_reward]


def main(argv: list[str] | None = None) -> None:
    from datasets import load_dataset

    script_args, training_args, model_args = parse_arguments(argv)
    model, tokenizer = load_model(model_args, training_args)
    dataset = load_dataset(script_args.dataset_name, script_args.dataset_config,
                           split=script_args.dataset_train_split).map(to_prompt, remove_columns=["question"])
    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=REWARD_FUNCS, args=training_args,
                                   train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main()
