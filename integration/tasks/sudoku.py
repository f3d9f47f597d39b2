"""``sudoku4``: 4x4 Sudoku (2x2 boxes) with a unique solution, scored with d1's reward.

Format (row by row, no separators)::

    prompt      0410314042000020        16 cells, '0' = blank      (prompt_length 17 with [BOS])
    completion  2413314242311324        the 16 digits of the solution   (completion_length 16)

Generation: a full grid drawn uniformly from all 288 valid 4x4 grids, a number of blanks drawn
uniformly from ``[min_blanks, max_blanks]``, then cells are blanked in a random order, each kept
blank only if the puzzle still has exactly one solution (checked with [`solve`][integration.tasks.sudoku.solve]). If an order
gets stuck before the target (every further blank would allow a second solution), a new grid and
order are drawn.

Reward (d1's): the fraction of the originally blank cells that the completion fills correctly.
The completion is read symbol by symbol (``vocab.split_symbols``): symbol ``i`` is cell ``i`` and is
correct only if it is the solution's digit. A missing symbol (a completion shorter than 16), a
non-digit, or a special token such as ``[MASK]`` makes that cell wrong without moving the cells
after it; symbols after the 16th are ignored (d1 truncates); given cells count for nothing, copied
or not. d1 first drops the non-digit characters of its free-form answer; here the completion *is*
the grid, so nothing is dropped.

Token credit: the token of a blank cell is right (1) if it is the solution's digit, else wrong
(0); the token of a given cell is not credited (the reward ignores it), except an ``[EOS]`` there
that cuts off a blank cell after it (wrong). Tokens after the first ``[EOS]`` are not credited
(the reward does not read them; the ``[EOS]`` that cut them off carries the blame).
"""
from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass

from integration.tasks import vocab
from integration.tasks.base import Example, Task, require_int_range

CELLS = 16
BLANK = "0"
# Every other cell of the same row, column or 2x2 box.
_PEERS = tuple(
    tuple(
        j
        for j in range(CELLS)
        if j != i and (j // 4 == i // 4 or j % 4 == i % 4 or (j // 8, j % 4 // 2) == (i // 8, i % 4 // 2))
    )
    for i in range(CELLS)
)


def _search(cells: list[str]) -> Iterator[str]:
    """Every completion of ``cells`` (mutated in place, restored on exit), in lexicographic order."""
    try:
        i = cells.index(BLANK)
    except ValueError:
        yield "".join(cells)
        return
    used = {cells[j] for j in _PEERS[i]}
    for digit in "1234":
        if digit not in used:
            cells[i] = digit
            yield from _search(cells)
    cells[i] = BLANK


def solve(puzzle: str, limit: int = 2) -> list[str]:
    """Up to ``limit`` solutions of a puzzle (16 characters from ``01234``, ``'0'`` = blank), in
    lexicographic order; ``[]`` if its givens contradict each other or it has no solution."""
    if not isinstance(puzzle, str):
        raise TypeError(f"puzzle must be a str, got {type(puzzle).__name__}")
    if len(puzzle) != CELLS or not set(puzzle) <= set("01234"):
        raise ValueError(f"puzzle must be 16 characters from '01234', got {puzzle!r}")
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, got {type(limit).__name__}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    cells = list(puzzle)
    if any(cells[i] != BLANK and cells[i] == cells[j] for i in range(CELLS) for j in _PEERS[i]):
        return []
    solutions = []
    for solution in _search(cells):
        solutions.append(solution)
        if len(solutions) == limit:
            break
    return solutions


@functools.cache
def all_grids() -> tuple[str, ...]:
    """All 288 valid 4x4 Sudoku grids, in lexicographic order."""
    return tuple(_search([BLANK] * CELLS))


@dataclass(frozen=True)
class SudokuAnswer:
    """``puzzle``: the prompt's 16 cells (``'0'`` = blank); ``solution``: the unique solution."""

    puzzle: str
    solution: str


@dataclass(frozen=True)
class Sudoku4Task(Task):
    """4x4 Sudoku with ``min_blanks..max_blanks`` blank cells (1 to 12; a 4x4 puzzle needs at
    least 4 givens to have a unique solution)."""

    min_blanks: int = 4
    max_blanks: int = 10

    name = "sudoku4"
    answer_type = SudokuAnswer

    def __post_init__(self):
        require_int_range(self.min_blanks, self.max_blanks, "min_blanks", "max_blanks", 1, CELLS - 4)

    @property
    def prompt_length(self) -> int:
        return 1 + CELLS

    @property
    def completion_length(self) -> int:
        return CELLS

    def _sample(self, rng: random.Random) -> Example:
        target = rng.randint(self.min_blanks, self.max_blanks)
        while True:
            solution = rng.choice(all_grids())
            puzzle = self._carve(solution, target, rng)
            if puzzle is not None:
                return Example(prompt=puzzle, answer=SudokuAnswer(puzzle, solution), reference_completion=solution)

    @staticmethod
    def _carve(solution: str, target: int, rng: random.Random) -> str | None:
        """Blank ``target`` cells of ``solution`` keeping the solution unique, or None if a random
        removal order gets stuck first."""
        cells = list(solution)
        blanks = 0
        for i in rng.sample(range(CELLS), CELLS):
            cells[i] = BLANK
            if len(solve("".join(cells), limit=2)) == 1:
                blanks += 1
                if blanks == target:
                    return "".join(cells)
            else:
                cells[i] = solution[i]
        return None

    def _score(self, completion_text: str, answer: SudokuAnswer) -> float:
        symbols = vocab.split_symbols(completion_text)
        blanks = [i for i, cell in enumerate(answer.puzzle) if cell == BLANK]
        if not blanks:  # d1 scores a puzzle without blanks 0; generated puzzles always have some
            return 0.0
        correct = sum(1 for i in blanks if i < len(symbols) and symbols[i] == answer.solution[i])
        return correct / len(blanks)

    def _credit(self, ids: list[int], answer: SudokuAnswer) -> list[float | None]:
        span = self.answer_span(ids)
        solution = vocab.encode(answer.solution)
        blanks = [cell == BLANK for cell in answer.puzzle]
        credit: list[float | None] = []
        for i, token in enumerate(ids):
            if i >= span:
                credit.append(None)
            elif blanks[i]:
                credit.append(float(token == solution[i]))
            elif token == vocab.eos_id and any(blanks[i:]):
                credit.append(0.0)
            else:
                credit.append(None)
        return credit
