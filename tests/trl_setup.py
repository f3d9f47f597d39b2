"""A tiny ``DiffusionGRPOTrainer`` setup on the loop's ``sort`` task, built in code (no downloads):
a character tokenizer over the task vocabulary, a prompt dataset with the answers as a column, a
TRL-style reward function and a one-layer bidirectional Llama, or the family doubles of
tests/families on the same vocabulary; a run straight against the same run stopped and resumed
(``straight_and_resumed``) and the examples' modules (``import_example``). Shared by the trainer tests
(tests/trainer, tests/families, tests/released) and the two-process child scripts (run from the
repository root, which must be importable; the doubles need tests/ on the path, as under pytest)."""
from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback

from daca_kernels.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer
from integration.model import ModelConfig, build_model
from integration.tasks import vocab
from integration.tasks.base import Example
from integration.tasks.sorting import SortAnswer, SortDigitsTask

TASK = SortDigitsTask(min_length=3, max_length=4)
TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_length=16)


def sort_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of the task vocabulary; ``[PAD]``, ``[MASK]``, ``[EOS]``, ``[BOS]``
    with the vocabulary's ids."""
    model = models.WordLevel({symbol: i for i, symbol in enumerate(vocab.SYMBOLS)}, unk_token=vocab.PAD)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(vocab.SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=vocab.PAD, mask_token=vocab.MASK,
                                   eos_token=vocab.EOS, bos_token=vocab.BOS)


def sort_dataset(num: int, seed: int = 0) -> Dataset:
    """``num`` prompts (``[BOS]`` and the digits) with their sorted digits in column ``answer``."""
    rng = random.Random(seed)
    examples = [TASK.sample(rng) for _ in range(num)]
    return Dataset.from_dict({"prompt": [vocab.BOS + e.prompt for e in examples],
                              "answer": [e.answer.sorted_digits for e in examples]})


def sort_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward-function signature: the task's reward of each completion against its answer."""
    return [TASK.reward(text, Example(prompt="", answer=SortAnswer(target, target), reference_completion=target))
            for text, target in zip(completions, answer)]


def digit_reward(prompts, completions, **kwargs) -> list[float]:
    """A second reward (TRL sums them): the share of digits in each completion, so that a random
    policy's rewards already differ within a group."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


ROWS = 4


def estimator_batch() -> tuple:
    """``(input_ids [ROWS, 9], completion_mask, loss_mask)``: random digit prompts of 5 tokens and
    completions of 4 tokens, two of them ending early with ``[EOS]``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 14, (ROWS, 9), generator=generator)
    ids[0, 7:] = vocab.eos_id
    ids[2, 6:] = vocab.eos_id
    completion = torch.zeros(ids.shape, dtype=torch.bool)
    completion[:, 5:] = True
    is_eos = completion & (ids == vocab.eos_id)
    answer = completion & ((torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0)
    return ids, completion, answer


def tiny_config(output_dir: str, **overrides) -> DiffusionGRPOConfig:
    settings = dict(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=TASK.completion_length, block_length=TASK.completion_length,
                    diffusion_steps=2, learning_rate=1e-2, max_steps=3, logging_steps=1, save_strategy="no",
                    report_to=[], use_cpu=True, seed=0, temperature=1.0, max_grad_norm=0.0,
                    dataloader_num_workers=0, disable_tqdm=True, bf16=False)
    return DiffusionGRPOConfig(**{**settings, **overrides})


def tiny_trainer(output_dir: str, *, num_prompts: int = 4, model_seed: int = 0, **overrides) -> DiffusionGRPOTrainer:
    """The trainer of the tiny policy. The policy is passed as a saved checkpoint's path (as a hub
    model id would be), from which TRL also loads the reference model when ``beta > 0``."""
    path = Path(output_dir) / "policy"
    build_model(TINY, model_seed).save_pretrained(path)
    return DiffusionGRPOTrainer(model=str(path), reward_funcs=[sort_reward, digit_reward],
                                args=tiny_config(output_dir, **overrides), train_dataset=sort_dataset(num_prompts),
                                processing_class=sort_tokenizer())


# The family doubles (tests/families) on the task's vocabulary: the tokenizer above drives them.
FAMILY_VOCAB = dict(llada=dict(vocab_size=vocab.size, embedding_size=vocab.size, mask_token_id=vocab.mask_id,
                               eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id),
                    llada_moe=dict(vocab_size=vocab.size, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id),
                    dream=dict(vocab_size=vocab.size, mask_token_id=vocab.mask_id, eos_token_id=vocab.eos_id,
                               bos_token_id=vocab.bos_id, pad_token_id=vocab.pad_id),
                    sdar=dict(vocab_size=vocab.size, mask_token_id=vocab.mask_id, eos_token_id=vocab.eos_id,
                              pad_token_id=vocab.pad_id),
                    llada2=dict(vocab_size=vocab.size, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id,
                                block_size=4))
# The block-causal doubles decode their own blocks (block_length unset).
BLOCK_FAMILIES = ("sdar", "llada2")


def family_model(family: str, seed: int = 0, **overrides):
    """The tiny double of ``family`` (a module name of tests/families) over the task vocabulary."""
    module = importlib.import_module(f"families.{family}")
    return module.tiny(seed, **{**FAMILY_VOCAB[family], **overrides})


def family_trainer(output_dir: str, family: str, *, num_prompts: int = 4, model=None, **overrides
                   ) -> DiffusionGRPOTrainer:
    """The trainer of ``family``'s double (or ``model``), passed as an object as its users do (its
    remote class is not found by the Auto classes), with TRL's defaults otherwise (gradient
    checkpointing on) and the CPU settings of :func:`tiny_config`; Dream's shifted logits are left
    to the trainer to find."""
    model = family_model(family) if model is None else model
    if family in BLOCK_FAMILIES:
        overrides = {"block_length": None, **overrides}
    return DiffusionGRPOTrainer(model=model, reward_funcs=[sort_reward, digit_reward],
                                args=tiny_config(output_dir, **overrides),
                                train_dataset=sort_dataset(num_prompts), processing_class=sort_tokenizer())


class StopAfter(TrainerCallback):
    """Stops training at the end of global step ``steps``."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.steps:
            control.should_training_stop = True


def straight_and_resumed(make, folder: Path, *, stop: int = 2) -> tuple:
    """``(straight, resumed, start)``: ``make(folder / "straight")`` trained for its ``max_steps`` at
    once; ``make(folder / "split")`` stopped after ``stop`` steps (``save_steps`` must checkpoint
    there), then a new ``make(folder / "split")`` resumed from that checkpoint to the end; ``start``
    the straight trainer's parameters before training, by name."""
    straight = make(folder / "straight")
    start = {key: p.detach().clone() for key, p in straight.model.named_parameters()}
    straight.train()
    interrupted = make(folder / "split")
    interrupted.add_callback(StopAfter(stop))
    interrupted.train()
    assert interrupted.state.global_step == stop
    resumed = make(folder / "split")
    resumed.train(resume_from_checkpoint=str(folder / "split" / f"checkpoint-{stop}"))
    assert resumed.state.global_step == straight.state.global_step
    return straight, resumed, start


def import_example(name: str):
    """The module of ``examples/<name>.py`` (the examples folder is not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
