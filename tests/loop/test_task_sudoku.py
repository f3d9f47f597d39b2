"""sudoku4: the solver against brute force, unique puzzles, and d1's reward on hand-made grids."""
import itertools
import random

import pytest

from integration.tasks import vocab
from integration.tasks.base import Example
from integration.tasks.sudoku import Sudoku4Task, SudokuAnswer, all_grids, solve

SOLUTION = "1234341221434321"
BLANKS = (1, 4, 6, 9, 13, 15)
PUZZLE = "".join("0" if i in BLANKS else c for i, c in enumerate(SOLUTION))  # "1034041221034301"
EXAMPLE = Example(prompt=PUZZLE, answer=SudokuAnswer(PUZZLE, SOLUTION), reference_completion=SOLUTION)
TASK = Sudoku4Task()


def brute_force_grids():
    """Every valid grid, enumerated row by row from the 24 permutations (independent of the task)."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    grids = [""]
    for r in range(4):
        grids = [
            g + row
            for g in grids
            for row in rows
            if all(row[c] != g[4 * k + c] for k in range(r) for c in range(4))
            and (r % 2 == 0 or (set(row[:2]) == set(g[4 * (r - 1) + 2 : 4 * r])))
        ]
    return grids


def edit(text, position, symbol):
    return text[:position] + symbol + text[position + 1 :]


def test_all_grids_are_the_288_valid_grids():
    grids = brute_force_grids()
    assert len(grids) == 288
    assert all_grids() == tuple(sorted(grids))
    assert solve("0" * 16, limit=1000) == list(all_grids())


def test_solver_matches_brute_force_and_puzzles_are_unique():
    grids = brute_force_grids()
    task = Sudoku4Task(min_blanks=4, max_blanks=12)
    for example in task.batch(300, seed=11).examples:
        puzzle = example.prompt
        consistent = [g for g in grids if all(p in ("0", c) for p, c in zip(puzzle, g))]
        assert consistent == [example.answer.solution]
        assert solve(puzzle, limit=5) == consistent
        assert example.answer.puzzle == puzzle and example.reference_completion == example.answer.solution
        assert all(p in ("0", s) for p, s in zip(puzzle, example.answer.solution))


def test_solver_on_ambiguous_and_contradictory_puzzles():
    first_row_blank = "0" * 4 + SOLUTION[4:]  # each column then misses exactly one digit
    assert solve(first_row_blank) == [SOLUTION]
    two_ways = "0000" + "0000" + SOLUTION[8:]  # rows 1-2 can be swapped within their band
    assert len(solve(two_ways)) == 2
    assert solve("1100" + "0" * 12) == []  # two 1s in a row
    assert solve("1000" + "1000" + "0" * 8) == []  # two 1s in a column


def test_blank_counts_follow_the_configuration():
    for low, high in [(4, 10), (12, 12), (1, 1)]:
        examples = Sudoku4Task(min_blanks=low, max_blanks=high).batch(200, seed=3).examples
        counts = {e.prompt.count("0") for e in examples}
        assert counts == set(range(low, high + 1))


def test_reward_on_hand_made_completions():
    score = lambda text: TASK.reward(text, EXAMPLE)  # noqa: E731
    assert score(SOLUTION) == 1.0
    assert score(edit(edit(SOLUTION, 4, "1"), 9, "4")) == 4 / 6  # two blank cells wrong
    assert score(edit(edit(SOLUTION, 0, "4"), 2, "1")) == 1.0  # given cells do not count
    assert score(PUZZLE) == 0.0  # blanks left as 0
    assert score(SOLUTION[:8]) == 3 / 6  # truncated: blanks 1, 4, 6 filled, the rest missing
    assert score(SOLUTION + "1234") == 1.0  # symbols after the 16th are ignored
    assert score(edit(SOLUTION, 4, "a")) == 5 / 6  # a non-digit in a cell
    # A [MASK] left in a cell is one wrong cell; the cells after it keep their positions.
    assert score(SOLUTION[:4] + "[MASK]" + SOLUTION[5:]) == 5 / 6
    assert score(SOLUTION[:1] + "[PAD]" + SOLUTION[2:]) == 5 / 6
    assert score("[PAD]" + SOLUTION[1:]) == 1.0  # cell 0 is given
    assert score("") == 0.0
    assert score("not a grid at all") == 0.0


def test_a_hand_made_puzzle_without_blanks_scores_zero_as_in_d1():
    example = Example(prompt=SOLUTION, answer=SudokuAnswer(SOLUTION, SOLUTION), reference_completion=SOLUTION)
    assert TASK.reward(SOLUTION, example) == 0.0


def test_reward_from_completion_ids_with_eos_in_the_middle():
    ids = vocab.encode(SOLUTION[:10]) + [vocab.eos_id] + vocab.encode(SOLUTION[11:])
    text = TASK.completion_text(ids)
    assert text == SOLUTION[:10]
    assert TASK.reward(text, EXAMPLE) == 4 / 6  # blanks 1, 4, 6, 9 only
    masked = vocab.encode(SOLUTION)
    masked[13] = vocab.mask_id
    assert TASK.completion_text(masked) == SOLUTION[:13] + "[MASK]" + SOLUTION[14:]
    assert TASK.reward(TASK.completion_text(masked), EXAMPLE) == 5 / 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="^min_blanks"):
        Sudoku4Task(min_blanks=0)
    with pytest.raises(ValueError, match="^max_blanks must be in"):
        Sudoku4Task(max_blanks=13)
    with pytest.raises(ValueError, match="^max_blanks must be >= min_blanks"):
        Sudoku4Task(min_blanks=6, max_blanks=5)
    with pytest.raises(TypeError, match="^min_blanks"):
        Sudoku4Task(min_blanks=4.0)
    with pytest.raises(ValueError, match="^puzzle"):
        solve("12345" + "0" * 11)
    with pytest.raises(ValueError, match="^puzzle"):
        solve("0" * 15)
    with pytest.raises(TypeError, match="^puzzle"):
        solve(list("0" * 16))
    with pytest.raises(ValueError, match="^limit"):
        solve("0" * 16, limit=0)
    with pytest.raises(TypeError, match="^limit"):
        solve("0" * 16, limit=None)


def test_sampling_uses_only_the_given_rng():
    random.seed(0)
    first = TASK.sample(random.Random(5))
    random.seed(1)
    assert TASK.sample(random.Random(5)) == first
