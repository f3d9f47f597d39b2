"""``constraints``: write a short letter sequence that satisfies a set of stated constraints.

Format::

    prompt      6abc:2=b,#a=2,1<4,!=      length, alphabet ':' constraints separated by ','
    completion  abcbca                    any sequence satisfying them, then [EOS] padding

The prompt starts with the required length (one digit) and the alphabet (the first k letters),
then lists the constraints (positions count from 1):

    ``3=b``    the letter at position 3 is ``b``
    ``2<5``    the letter at position 2 comes strictly before the letter at position 5 in the alphabet
    ``#a=2``   the sequence holds exactly 2 ``a``
    ``!=``     no two neighbouring letters are equal

Generation: a random solution is drawn first (length ``min_length..max_length``, alphabet size
``min_letters..max_letters``), then ``min_constraints..max_constraints`` distinct constraints that
it satisfies: for each one a kind is drawn uniformly among the kinds with unused true constraints
left, then one of those. Every instance is satisfiable (the solution is the reference completion)
and usually has other solutions too; the reward checks the constraints, not a fixed answer.

Reward: the completion is read symbol by symbol (``vocab.split_symbols``). It must be a
well-formed sequence, exactly ``length`` symbols each in the alphabet, otherwise the reward is 0
(wrong length, another letter or character, a ``[MASK]`` left in). A well-formed sequence gets the
fraction of the stated constraints it satisfies.

Token credit (0-based positions): every constraint involves some positions (``3=b`` position 2,
``2<5`` positions 1 and 4, ``#a=2`` and ``!=`` all of them) and, when violated, blames some of
them: ``3=b`` and ``2<5`` the positions they involve, ``!=`` every letter equal to a neighbour,
``#a=2`` the ``a`` s if there are too many, the other letters if too few. In a well-formed
sequence a letter is wrong (0) if a violated constraint blames it, right (1) if not, and not
credited if no constraint involves it (the reward does not depend on it). In a malformed one (reward
0) the tokens that break the form are wrong: a token other than a letter of the alphabet among the
first ``length``, any token but ``[EOS]`` after them; its other letters are not credited. An
``[EOS]`` right after the ``length``-th token is right; tokens after the first ``[EOS]`` are not
credited.

Lengths (defaults: length 5..8, 2..4 letters, 3..5 constraints): ``completion_length =
max_length``; ``prompt_length = 1 + (2 + max_letters) + 4 * max_constraints + (max_constraints - 1)``
(``[BOS]``, the header, the longest constraints and the commas).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Protocol

from integration.tasks import vocab
from integration.tasks.base import Example, Task, require_int_range

MAX_CONSTRAINT_CHARS = 4  # "#a=2"


class Constraint(Protocol):
    """A checkable statement about a sequence, written compactly in the prompt."""

    @property
    def text(self) -> str:
        """How the prompt writes the constraint."""

    def holds(self, sequence: str) -> bool:
        """Whether ``sequence`` (a well-formed sequence of the instance) satisfies it."""

    def involved(self, length: int) -> set[int]:
        """The 0-based positions of a sequence of ``length`` letters that it depends on."""

    def blamed(self, sequence: str) -> set[int]:
        """The 0-based positions of ``sequence`` (well-formed) to blame if it fails; empty if it holds."""


@dataclass(frozen=True)
class LetterAt:
    """``3=b``: the letter at (1-based) ``position`` is ``letter``."""

    position: int
    letter: str

    @property
    def text(self) -> str:
        return f"{self.position}={self.letter}"

    def holds(self, sequence: str) -> bool:
        return sequence[self.position - 1] == self.letter

    def involved(self, length: int) -> set[int]:
        return {self.position - 1}

    def blamed(self, sequence: str) -> set[int]:
        return set() if self.holds(sequence) else self.involved(len(sequence))


@dataclass(frozen=True)
class Precedes:
    """``2<5``: the letter at position ``left`` comes strictly before the one at ``right`` in the
    alphabet."""

    left: int
    right: int

    @property
    def text(self) -> str:
        return f"{self.left}<{self.right}"

    def holds(self, sequence: str) -> bool:
        return sequence[self.left - 1] < sequence[self.right - 1]

    def involved(self, length: int) -> set[int]:
        return {self.left - 1, self.right - 1}

    def blamed(self, sequence: str) -> set[int]:
        return set() if self.holds(sequence) else self.involved(len(sequence))


@dataclass(frozen=True)
class LetterCount:
    """``#a=2``: ``letter`` occurs exactly ``count`` times."""

    letter: str
    count: int

    @property
    def text(self) -> str:
        return f"#{self.letter}={self.count}"

    def holds(self, sequence: str) -> bool:
        return sequence.count(self.letter) == self.count

    def involved(self, length: int) -> set[int]:
        return set(range(length))

    def blamed(self, sequence: str) -> set[int]:
        count = sequence.count(self.letter)
        if count == self.count:
            return set()
        too_many = count > self.count
        return {i for i, letter in enumerate(sequence) if (letter == self.letter) == too_many}


@dataclass(frozen=True)
class NeighboursDiffer:
    """``!=``: no two neighbouring letters are equal."""

    @property
    def text(self) -> str:
        return "!="

    def holds(self, sequence: str) -> bool:
        return all(a != b for a, b in zip(sequence, sequence[1:]))

    def involved(self, length: int) -> set[int]:
        return set(range(length))

    def blamed(self, sequence: str) -> set[int]:
        pairs = [i for i in range(len(sequence) - 1) if sequence[i] == sequence[i + 1]]
        return set(pairs) | {i + 1 for i in pairs}


@dataclass(frozen=True)
class ConstraintAnswer:
    """The instance: required ``length`` and ``alphabet``, the stated ``constraints`` (in prompt
    order) and the ``solution`` they were derived from (one of possibly many)."""

    length: int
    alphabet: str
    constraints: tuple[Constraint, ...]
    solution: str

    @property
    def prompt(self) -> str:
        return f"{self.length}{self.alphabet}:" + ",".join(c.text for c in self.constraints)


def true_constraints(solution: str, alphabet: str) -> dict[str, list[Constraint]]:
    """Every constraint of each kind that ``solution`` satisfies, by kind, in a fixed order."""
    positions = range(1, len(solution) + 1)
    return {
        "letter_at": [LetterAt(i, solution[i - 1]) for i in positions],
        "precedes": [
            Precedes(i, j) for i, j in itertools.permutations(positions, 2) if solution[i - 1] < solution[j - 1]
        ],
        "letter_count": [LetterCount(letter, solution.count(letter)) for letter in alphabet],
        "neighbours_differ": [NeighboursDiffer()] if NeighboursDiffer().holds(solution) else [],
    }


@dataclass(frozen=True)
class ConstraintsTask(Task):
    """Constraint satisfaction over sequences of ``min_length..max_length`` (2 to 9) letters from
    the first ``min_letters..max_letters`` (2 to 26) letters, with
    ``min_constraints..max_constraints`` constraints (at most ``min_length + min_letters``, so an
    instance always has enough true constraints to choose from)."""

    min_length: int = 5
    max_length: int = 8
    min_letters: int = 2
    max_letters: int = 4
    min_constraints: int = 3
    max_constraints: int = 5

    name = "constraints"
    answer_type = ConstraintAnswer

    def __post_init__(self):
        require_int_range(self.min_length, self.max_length, "min_length", "max_length", 2, 9)
        require_int_range(self.min_letters, self.max_letters, "min_letters", "max_letters", 2, len(vocab.LETTERS))
        require_int_range(
            self.min_constraints,
            self.max_constraints,
            "min_constraints",
            "max_constraints",
            1,
            self.min_length + self.min_letters,
        )

    @property
    def prompt_length(self) -> int:
        header = 1 + self.max_letters + 1
        return 1 + header + MAX_CONSTRAINT_CHARS * self.max_constraints + self.max_constraints - 1

    @property
    def completion_length(self) -> int:
        return self.max_length

    def _sample(self, rng: random.Random) -> Example:
        length = rng.randint(self.min_length, self.max_length)
        alphabet = vocab.LETTERS[: rng.randint(self.min_letters, self.max_letters)]
        solution = "".join(rng.choice(alphabet) for _ in range(length))
        pools = true_constraints(solution, alphabet)
        chosen = []
        for _ in range(rng.randint(self.min_constraints, self.max_constraints)):
            pool = pools[rng.choice([kind for kind, pool in pools.items() if pool])]
            chosen.append(pool.pop(rng.randrange(len(pool))))
        answer = ConstraintAnswer(length, alphabet, tuple(chosen), solution)
        return Example(prompt=answer.prompt, answer=answer, reference_completion=solution)

    def _score(self, completion_text: str, answer: ConstraintAnswer) -> float:
        symbols = vocab.split_symbols(completion_text)
        letters = frozenset(answer.alphabet)
        if len(symbols) != answer.length or not all(symbol in letters for symbol in symbols):
            return 0.0
        sequence = "".join(symbols)
        return sum(c.holds(sequence) for c in answer.constraints) / len(answer.constraints)

    def _credit(self, ids: list[int], answer: ConstraintAnswer) -> list[float | None]:
        span, length = self.answer_span(ids), answer.length
        symbols = [vocab.SYMBOLS[token] for token in ids]
        letters = frozenset(answer.alphabet)
        credit: list[float | None] = [None] * len(ids)
        if length < len(ids) and symbols[length] == vocab.EOS and span == length + 1:
            credit[length] = 1.0
        well_formed = span >= length and all(symbol in letters for symbol in symbols[:length]) and (
            span == length or credit[length] == 1.0)
        if not well_formed:
            for i in range(span):
                if (i < length and symbols[i] not in letters) or (i >= length and symbols[i] != vocab.EOS):
                    credit[i] = 0.0
            return credit
        sequence = "".join(symbols[:length])
        involved = set().union(*(c.involved(length) for c in answer.constraints))
        blamed = set().union(*(c.blamed(sequence) for c in answer.constraints))
        for i in involved:
            credit[i] = 0.0 if i in blamed else 1.0
        return credit
