"""Per-token credit of the tasks whose reward decomposes over positions, on hand-made completions."""
import random

import pytest
import torch

from integration.tasks import get_task, vocab
from integration.tasks.base import Example
from integration.tasks.constraints import (
    ConstraintAnswer,
    ConstraintsTask,
    LetterAt,
    LetterCount,
    NeighboursDiffer,
    Precedes,
)
from integration.tasks.sorting import SortAnswer, SortDigitsTask
from integration.tasks.sudoku import Sudoku4Task, SudokuAnswer

N = None


def credit(task, text, example):
    """Credit of ``text`` padded with [EOS] to the completion length."""
    return task.token_credit(task.encode_completion(text), example)


def credit_unpadded(task, text, example):
    return task.token_credit(vocab.encode(text), example)


SORT = SortDigitsTask()
SORT_EXAMPLE = Example(prompt="52913", answer=SortAnswer("52913", "12359"), reference_completion="12359")


def test_sort_credit():
    assert credit(SORT, "12359", SORT_EXAMPLE) == [1, 1, 1, 1, 1, 1]
    assert credit(SORT, "12395", SORT_EXAMPLE) == [1, 1, 1, 0, 0, 1]
    assert credit(SORT, "1235", SORT_EXAMPLE) == [1, 1, 1, 1, 0, N]  # [EOS] one digit early
    assert credit_unpadded(SORT, "123599", SORT_EXAMPLE) == [1, 1, 1, 1, 1, 0]  # no [EOS]: one symbol too many
    assert credit(SORT, "12[MASK]59", SORT_EXAMPLE) == [1, 1, 0, 1, 1, 1]


SOLUTION = "1234341221434321"
BLANKS = (1, 4, 6, 9, 13, 15)
PUZZLE = "".join("0" if i in BLANKS else c for i, c in enumerate(SOLUTION))
SUDOKU = Sudoku4Task()
SUDOKU_EXAMPLE = Example(prompt=PUZZLE, answer=SudokuAnswer(PUZZLE, SOLUTION), reference_completion=SOLUTION)


def test_sudoku_credit():
    right = [1 if i in BLANKS else N for i in range(16)]
    assert credit(SUDOKU, SOLUTION, SUDOKU_EXAMPLE) == right
    wrong_cell = SOLUTION[:4] + "1" + SOLUTION[5:]  # blank cell 4 wrong
    assert credit(SUDOKU, wrong_cell, SUDOKU_EXAMPLE) == [0 if i == 4 else c for i, c in enumerate(right)]
    given_changed = "4" + SOLUTION[1:]  # a given cell is not credited, right or wrong
    assert credit(SUDOKU, given_changed, SUDOKU_EXAMPLE) == right
    # [EOS] at given cell 10 cuts off blank cells 13 and 15: it is wrong, the rest is not read.
    assert credit(SUDOKU, SOLUTION[:10], SUDOKU_EXAMPLE) == right[:10] + [0] + [N] * 5
    # [EOS] at given cell 14 still cuts off blank 15; at blank 15 it is a wrong cell.
    assert credit(SUDOKU, SOLUTION[:14], SUDOKU_EXAMPLE)[14] == 0
    assert credit(SUDOKU, SOLUTION[:15], SUDOKU_EXAMPLE)[15] == 0


CONSTRAINTS = ConstraintsTask()
ANSWER = ConstraintAnswer(length=6, alphabet="abc", solution="abcbca",
                          constraints=(LetterAt(2, "b"), LetterCount("a", 2), Precedes(1, 4), NeighboursDiffer()))
CONSTRAINTS_EXAMPLE = Example(prompt=ANSWER.prompt, answer=ANSWER, reference_completion=ANSWER.solution)


def constraint_credit(text):
    return credit(CONSTRAINTS, text, CONSTRAINTS_EXAMPLE)


def test_constraints_credit_of_well_formed_sequences():
    assert constraint_credit("abcbca") == [1, 1, 1, 1, 1, 1, 1, N]
    # 2=b fails (blames 1); three a (blames the a at 0, 1, 5); "aa" neighbours (blame 0, 1).
    assert constraint_credit("aacbca") == [0, 0, 1, 1, 1, 0, 1, N]
    # One a, too few (blames every other letter); 1<4 fails (blames 0 and 3).
    assert constraint_credit("cbcbca") == [0, 0, 0, 0, 0, 1, 1, N]


def test_constraints_credit_of_malformed_sequences():
    assert constraint_credit("abdbca") == [N, N, 0, N, N, N, 1, N]  # a letter outside the alphabet
    assert constraint_credit("abcbc") == [N, N, N, N, N, 0, N, N]  # [EOS] too early
    assert constraint_credit("abcbcab") == [N, N, N, N, N, N, 0, N]  # one letter too many
    assert credit_unpadded(CONSTRAINTS, "abcbcabc", CONSTRAINTS_EXAMPLE) == [N] * 6 + [0, 0]


def test_constraints_credit_leaves_unconstrained_positions_out():
    answer = ConstraintAnswer(length=5, alphabet="ab", solution="abbab", constraints=(LetterAt(1, "a"), Precedes(2, 3)))
    example = Example(prompt=answer.prompt, answer=answer, reference_completion=answer.solution)
    assert credit(CONSTRAINTS, "abbab", example) == [1, 0, 0, N, N, 1, N, N]
    assert credit(CONSTRAINTS, "babaa", example) == [0, 1, 1, N, N, 1, N, N]


@pytest.mark.parametrize("name", ["sort", "sudoku4", "constraints"])
def test_credits_of_random_completions(name):
    """Reference completions are all right; on random token rows, ``credits`` matches
    ``token_credit`` row by row, credits only answer tokens, and for sort and sudoku4 counts
    exactly the positions the reward counts as correct."""
    task = get_task(name)
    _, examples = task.batch(24, seed=5)
    reference = task.credits(task.reference_ids(examples), examples)
    assert not bool((reference == 0).any()) and bool((reference == 1).any())
    rng = random.Random(0)
    pool = [vocab.eos_id, vocab.mask_id] + vocab.encode(vocab.DIGITS + "abcd")
    rows = [[rng.choice(pool) if rng.random() < 0.4 else r for r in ref]
            for ref in task.reference_ids(examples).tolist()]
    ids = torch.tensor(rows)
    table = task.credits(ids, examples)
    rewards = task.rewards(ids, examples)
    for row, example, values, reward in zip(rows, examples, table.tolist(), rewards.tolist()):
        expected = task.token_credit(row, example)
        assert [v if v == v else None for v in values] == expected
        span = task.answer_span(row)
        assert all(c is None for c in expected[span:])
        if name == "sort":
            digits = len(example.answer.sorted_digits)
            symbols = span - (row[span - 1] == vocab.eos_id)
            assert sum(c == 1 for c in expected[:digits]) == pytest.approx(reward * max(digits, symbols))
        if name == "sudoku4":
            blanks = example.answer.puzzle.count("0")
            assert sum(c == 1 for c in expected) == pytest.approx(reward * blanks)


def test_bad_input():
    with pytest.raises(NotImplementedError, match="json_schema"):
        get_task("json_schema").token_credit([vocab.eos_id] * get_task("json_schema").completion_length,
                                             get_task("json_schema").batch(1, seed=0).examples[0])
    with pytest.raises(ValueError, match="completion_ids"):
        SORT.token_credit([4, 5], SORT_EXAMPLE)
    with pytest.raises(TypeError, match="example"):
        SORT.token_credit([4] * 6, SUDOKU_EXAMPLE)
    with pytest.raises(ValueError, match="completion_ids"):
        SORT.credits(torch.full((1, 6), 99), [SORT_EXAMPLE])
