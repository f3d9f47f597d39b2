"""constraints: the prompt states exactly the checked constraints; reward on hand-made sequences."""
import itertools
import re

import pytest

from integration.tasks.base import Example
from integration.tasks.constraints import (
    ConstraintAnswer,
    ConstraintsTask,
    LetterAt,
    LetterCount,
    NeighboursDiffer,
    Precedes,
)

TASK = ConstraintsTask()
ANSWER = ConstraintAnswer(
    length=6,
    alphabet="abc",
    constraints=(LetterAt(2, "b"), LetterCount("a", 2), Precedes(1, 4), NeighboursDiffer()),
    solution="abcbca",
)
EXAMPLE = Example(prompt=ANSWER.prompt, answer=ANSWER, reference_completion=ANSWER.solution)


def score(text):
    return TASK.reward(text, EXAMPLE)


def fraction_from_prompt(prompt, sequence):
    """Read the prompt as a person would (independently of the task code) and score ``sequence``."""
    header, body = prompt.split(":", 1)
    length, alphabet = int(header[0]), header[1:]
    if len(sequence) != length or not set(sequence) <= set(alphabet):
        return 0.0
    results = []
    for item in body.split(","):
        if m := re.fullmatch(r"(\d)=([a-z])", item):
            results.append(sequence[int(m[1]) - 1] == m[2])
        elif m := re.fullmatch(r"(\d)<(\d)", item):
            results.append(sequence[int(m[1]) - 1] < sequence[int(m[2]) - 1])
        elif m := re.fullmatch(r"#([a-z])=(\d)", item):
            results.append(sequence.count(m[1]) == int(m[2]))
        else:
            assert item == "!=", f"unknown constraint {item!r} in {prompt!r}"
            results.append(all(a != b for a, b in zip(sequence, sequence[1:])))
    return sum(results) / len(results)


def test_prompt_format():
    assert EXAMPLE.prompt == "6abc:2=b,#a=2,1<4,!="
    assert ConstraintAnswer(9, "ab", (LetterCount("b", 0),), "aaaaaaaaa").prompt == "9ab:#b=0"


def test_reward_on_hand_made_sequences():
    assert score("abcbca") == 1.0
    assert score("ababcc") == 3 / 4  # all but != (c, c)
    assert score("cbaabc") == 2 / 4  # 2=b and #a=2; c < a fails, a, a are neighbours
    assert score("cacbca") == 2 / 4  # #a=2 and !=
    assert score("bbbbbb") == 1 / 4  # only 2=b
    assert score("cccccc") == 0 / 4
    # Not a well-formed sequence of 6 letters from {a, b, c}: reward 0.
    assert score("abcbc") == 0.0
    assert score("abcbcaa") == 0.0
    assert score("abcbcd") == 0.0
    assert score("abcBca") == 0.0
    assert score("ab[MASK]bca") == 0.0
    assert score("ab,bca") == 0.0
    assert score("") == 0.0


def test_reward_checks_constraints_not_a_fixed_answer():
    solutions = ["".join(s) for s in itertools.product("abc", repeat=6) if score("".join(s)) == 1.0]
    assert "abcbca" in solutions and len(solutions) > 1
    assert all(s[1] == "b" and s.count("a") == 2 and s[0] < s[3] for s in solutions)


def test_reward_agrees_with_the_prompt_on_every_sequence():
    task = ConstraintsTask(min_length=3, max_length=5, min_letters=2, max_letters=3, max_constraints=5)
    for example in task.batch(40, seed=8).examples:
        answer = example.answer
        for letters in itertools.product(answer.alphabet + "d", repeat=answer.length):
            sequence = "".join(letters)
            assert task.reward(sequence, example) == pytest.approx(fraction_from_prompt(example.prompt, sequence))
        assert fraction_from_prompt(example.prompt, example.reference_completion) == 1.0


def test_generated_instances():
    examples = TASK.batch(400, seed=2).examples
    kinds = set()
    for e in examples:
        a = e.answer
        assert 5 <= a.length <= 8 and a.alphabet in ("ab", "abc", "abcd")
        assert 3 <= len(a.constraints) <= 5
        assert len(set(a.constraints)) == len(a.constraints)
        assert e.prompt == a.prompt and e.reference_completion == a.solution
        assert all(c.holds(a.solution) for c in a.constraints)
        kinds.update(type(c) for c in a.constraints)
    assert kinds == {LetterAt, Precedes, LetterCount, NeighboursDiffer}


def test_longest_prompt_fits():
    task = ConstraintsTask(
        min_length=9, max_length=9, min_letters=5, max_letters=5, min_constraints=5, max_constraints=5
    )
    longest = "9abcde:#a=1,#b=2,#c=3,#d=2,#e=1"
    assert len(task.encode_prompt(longest)) == task.prompt_length
    assert task.encode_prompt(longest)[0] != 0  # no padding left


def test_bad_arguments():
    with pytest.raises(ValueError, match="^max_length"):
        ConstraintsTask(max_length=10)
    with pytest.raises(ValueError, match="^min_length"):
        ConstraintsTask(min_length=1)
    with pytest.raises(ValueError, match="^max_letters"):
        ConstraintsTask(max_letters=27)
    with pytest.raises(ValueError, match="^max_constraints must be in"):
        ConstraintsTask(max_constraints=8)  # more than min_length + min_letters = 7
    with pytest.raises(ValueError, match="^max_constraints must be >= min_constraints"):
        ConstraintsTask(min_constraints=4, max_constraints=3)
    with pytest.raises(TypeError, match="^min_letters"):
        ConstraintsTask(min_letters=None)
