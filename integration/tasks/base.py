"""The task protocol: what every verifiable task provides to the trainer.

A task generates [`Example`][integration.tasks.base.Example] s from a ``random.Random``, scores completions with a reward in
``[0, 1]``, and turns prompts and completions into fixed-length token ids:

- prompt ids: ``[PAD] * k + [BOS] + prompt``, exactly ``prompt_length`` tokens (prompts of
  different lengths are left-padded, so the completion always starts at position
  ``prompt_length`` and a model can attend with ``prompt_ids != vocab.pad_id``);
- completion ids: ``completion + [EOS] * k``, exactly ``completion_length`` tokens (LLaDA's
  padding: the model learns to end an answer by filling the rest with ``[EOS]``).

A reward never raises on a string: malformed completions get the reward each task documents.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from integration.tasks import vocab


@dataclass(frozen=True)
class Example:
    """One task instance.

    Attributes:
        prompt: the prompt text (without ``[BOS]``/padding).
        answer: what the reward needs to score a completion (the task's ``answer_type``); it is
            not shown to the model.
        reference_completion: one correct completion (reward 1.0), without ``[EOS]`` padding;
            the targets of the SFT warm-up.
    """

    prompt: str
    answer: object
    reference_completion: str


class Batch(NamedTuple):
    """``prompt_ids``: long ``[num, prompt_length]``; ``examples``: the ``num`` examples, in order."""

    prompt_ids: torch.Tensor
    examples: list[Example]


def require_int(value, name: str, low: int, high: int) -> int:
    """``value`` as an int, or TypeError/ValueError (naming ``name``) unless it is an int in
    ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def require_int_range(low, high, low_name: str, high_name: str, floor: int, ceiling: int) -> None:
    """Check a configured ``[low, high]`` range: both ints in ``[floor, ceiling]``, ``low <= high``."""
    require_int(low, low_name, floor, ceiling)
    require_int(high, high_name, floor, ceiling)
    if high < low:
        raise ValueError(f"{high_name} must be >= {low_name} = {low}, got {high}")


class Task(ABC):
    """A verifiable task. Subclasses set ``name`` and ``answer_type`` and implement
    ``prompt_length``, ``completion_length``, ``_sample`` and ``_score``."""

    name: ClassVar[str]
    answer_type: ClassVar[type]

    @property
    @abstractmethod
    def prompt_length(self) -> int:
        """Tokens in every encoded prompt, ``[BOS]`` and left padding included."""

    @property
    @abstractmethod
    def completion_length(self) -> int:
        """Tokens in every completion, ``[EOS]`` padding included."""

    @abstractmethod
    def _sample(self, rng: random.Random) -> Example:
        """A fresh example drawn with ``rng`` (and no other source of randomness)."""

    @abstractmethod
    def _score(self, completion_text: str, answer) -> float:
        """The reward of ``completion_text`` for an example whose answer is ``answer``."""

    def sample(self, rng: random.Random) -> Example:
        """One example, deterministic given the state of ``rng``."""
        if not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
        return self._sample(rng)

    def reward(self, completion_text: str, example: Example) -> float:
        """The reward in ``[0, 1]`` of a completion (decoded text, see [`completion_text`][integration.tasks.base.Task.completion_text]).

        Never raises on a string, however malformed; raises TypeError if ``completion_text`` is
        not a str or ``example`` was not made by a task of this kind.
        """
        if not isinstance(completion_text, str):
            raise TypeError(f"completion_text must be a str, got {type(completion_text).__name__}")
        self._check_example(example, "example")
        return self._score(completion_text, example.answer)

    def encode_prompt(self, prompt: str) -> list[int]:
        """``[PAD] * k + [BOS] + encode(prompt)``, ``prompt_length`` ids."""
        ids = [vocab.bos_id] + vocab.encode(prompt, name="prompt")
        if len(ids) > self.prompt_length:
            raise ValueError(
                f"prompt needs {len(ids)} tokens with [BOS], more than prompt_length = {self.prompt_length}"
            )
        return [vocab.pad_id] * (self.prompt_length - len(ids)) + ids

    def encode_completion(self, completion: str) -> list[int]:
        """``encode(completion) + [EOS] * k``, ``completion_length`` ids."""
        ids = vocab.encode(completion, name="completion")
        if len(ids) > self.completion_length:
            raise ValueError(
                f"completion needs {len(ids)} tokens, more than completion_length = {self.completion_length}"
            )
        return ids + [vocab.eos_id] * (self.completion_length - len(ids))

    @staticmethod
    def completion_text(completion_ids) -> str:
        """The text a reward reads from one row of completion ids: everything before the first
        ``[EOS]``, with any other special token (a ``[MASK]`` the sampler left, a stray ``[PAD]``)
        kept and written by name, so that it stays in its position and is scored as a wrong
        character instead of shifting the characters after it."""
        return vocab.decode(completion_ids, strip_special=False).split(vocab.EOS, 1)[0]

    def batch(self, num: int, seed: int) -> Batch:
        """``num`` examples drawn from ``random.Random(seed)`` and their prompt ids.

        The same ``(num, seed)`` always gives the same batch, and ``batch(n, s)`` is a prefix of
        ``batch(m, s)`` for ``n <= m``.
        """
        require_int(num, "num", 0, 2**31 - 1)
        # random.Random seeds with abs(seed): negative seeds would repeat positive ones.
        require_int(seed, "seed", 0, 2**63 - 1)
        rng = random.Random(seed)
        examples = [self._sample(rng) for _ in range(num)]
        ids = [self.encode_prompt(example.prompt) for example in examples]
        prompt_ids = torch.tensor(ids, dtype=torch.long).reshape(num, self.prompt_length)
        return Batch(prompt_ids, examples)

    def reference_ids(self, examples: Sequence[Example]) -> torch.Tensor:
        """The reference completions as long ``[len(examples), completion_length]`` ids."""
        self._check_examples(examples)
        ids = [self.encode_completion(example.reference_completion) for example in examples]
        return torch.tensor(ids, dtype=torch.long).reshape(len(examples), self.completion_length)

    def rewards(self, completion_ids: torch.Tensor, examples: Sequence[Example]) -> torch.Tensor:
        """Float32 rewards ``[len(examples)]`` (on ``completion_ids.device``) of integer completion
        ids ``[len(examples), completion_length]``, row ``i`` scored against ``examples[i]``."""
        rows = self._completion_rows(completion_ids, examples)
        scores = [self.reward(self.completion_text(row), example) for row, example in zip(rows, examples)]
        return torch.tensor(scores, dtype=torch.float32, device=completion_ids.device)

    def token_credit(self, completion_ids: Sequence[int], example: Example) -> list[float | None]:
        """Whether each generated token of one completion is right: ``1.0`` (right), ``0.0``
        (wrong) or ``None`` (not credited: the reward does not depend on it, e.g. anything after
        the first ``[EOS]``). ``completion_ids``: ``completion_length`` token ids.

        The per-token truth behind a reward that decomposes over positions; each task documents its
        rule. Raises NotImplementedError for a task whose reward does not decompose.
        """
        rows = self._completion_rows(torch.as_tensor([list(completion_ids)]), [example])
        return self._credit(rows[0], example.answer)

    def credits(self, completion_ids: torch.Tensor, examples: Sequence[Example]) -> torch.Tensor:
        """[`token_credit`][integration.tasks.base.Task.token_credit] of every row: float32 ``[len(examples), completion_length]`` (on
        ``completion_ids.device``), NaN where a token is not credited."""
        rows = self._completion_rows(completion_ids, examples)
        values = [[float("nan") if c is None else c for c in self._credit(row, example.answer)]
                  for row, example in zip(rows, examples)]
        return torch.tensor(values, dtype=torch.float32, device=completion_ids.device).reshape(len(rows), self.completion_length)

    def _credit(self, ids: list[int], answer) -> list[float | None]:
        """The credit of each token of one completion (valid ids, ``completion_length`` of them)."""
        raise NotImplementedError(f"task {self.name!r} has no per-token credit (its reward does not decompose over positions)")

    @staticmethod
    def answer_span(ids: Sequence[int]) -> int:
        """How many leading tokens of a completion the reward reads: up to and including the first
        ``[EOS]`` (all of them without one)."""
        return ids.index(vocab.eos_id) + 1 if vocab.eos_id in ids else len(ids)

    def _completion_rows(self, completion_ids: torch.Tensor, examples: Sequence[Example]) -> list[list[int]]:
        """``completion_ids`` (integer ``[len(examples), completion_length]``, valid ids) as lists."""
        self._check_examples(examples)
        if not isinstance(completion_ids, torch.Tensor):
            raise TypeError(f"completion_ids must be a torch.Tensor, got {type(completion_ids).__name__}")
        dtype = completion_ids.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"completion_ids must be an integer tensor, got dtype {dtype}")
        expected = (len(examples), self.completion_length)
        if tuple(completion_ids.shape) != expected:
            raise ValueError(
                f"completion_ids must have shape [len(examples), completion_length] = {expected}, "
                f"got {tuple(completion_ids.shape)}"
            )
        rows = completion_ids.cpu().tolist()
        if any(not 0 <= token < vocab.size for row in rows for token in row):
            raise ValueError(f"completion_ids must hold token ids in [0, {vocab.size})")
        return rows

    def _check_examples(self, examples) -> None:
        if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
            raise TypeError(f"examples must be a sequence of Example, got {type(examples).__name__}")
        for i, example in enumerate(examples):
            self._check_example(example, f"examples[{i}]")

    def _check_example(self, example, name: str) -> None:
        if not isinstance(example, Example) or not isinstance(example.answer, self.answer_type):
            raise TypeError(f"{name} must be an Example sampled from a {self.name!r} task, got {example!r}")
