"""``sort``: sort a short list of digits in ascending order, with credit per position.

Format::

    prompt      52913        min_length..max_length digits (repeats allowed), left-padded
    completion  12359        the same digits, ascending, then [EOS] padding

Lengths (defaults 3..6): ``prompt_length = 1 + max_length`` (with ``[BOS]``),
``completion_length = max_length``.

Reward: the completion is read symbol by symbol (``vocab.split_symbols``); with ``n`` the number of
digits and ``m`` the number of symbols, reward = (positions ``i < n`` whose symbol is the ``i``-th
smallest digit) / ``max(n, m)``. A missing, wrong or non-digit symbol (``[MASK]`` included) earns
nothing at its position; extra symbols after the ``n``-th lower the reward through the
denominator, so the model must also learn where to stop. An empty completion gets 0.

Token credit: the right completion is unique (the sorted digits, then ``[EOS]`` padding), so each
token the reward reads (up to and including the first ``[EOS]``) is right (1) if it is that
completion's token at its position, else wrong (0); the tokens after the first ``[EOS]`` are not
credited.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from integration.tasks import vocab
from integration.tasks.base import Example, Task, require_int_range


@dataclass(frozen=True)
class SortAnswer:
    """``digits``: the prompt's digits; ``sorted_digits``: the same digits in ascending order."""

    digits: str
    sorted_digits: str


@dataclass(frozen=True)
class SortDigitsTask(Task):
    """Sort ``min_length..max_length`` random digits (1 to 32 of them)."""

    min_length: int = 3
    max_length: int = 6

    name = "sort"
    answer_type = SortAnswer

    def __post_init__(self):
        require_int_range(self.min_length, self.max_length, "min_length", "max_length", 1, 32)

    @property
    def prompt_length(self) -> int:
        return 1 + self.max_length

    @property
    def completion_length(self) -> int:
        return self.max_length

    def _sample(self, rng: random.Random) -> Example:
        length = rng.randint(self.min_length, self.max_length)
        digits = "".join(rng.choice(vocab.DIGITS) for _ in range(length))
        ordered = "".join(sorted(digits))
        return Example(prompt=digits, answer=SortAnswer(digits, ordered), reference_completion=ordered)

    def _score(self, completion_text: str, answer: SortAnswer) -> float:
        symbols = vocab.split_symbols(completion_text)
        target = answer.sorted_digits
        correct = sum(1 for got, want in zip(symbols, target) if got == want)
        return correct / max(len(target), len(symbols))

    def _credit(self, ids: list[int], answer: SortAnswer) -> list[float | None]:
        target = self.encode_completion(answer.sorted_digits)
        span = self.answer_span(ids)
        return [float(got == want) if i < span else None for i, (got, want) in enumerate(zip(ids, target))]
