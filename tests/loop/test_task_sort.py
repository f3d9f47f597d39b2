"""sort: credit per correct position, length penalty, malformed completions."""
import pytest

from integration.tasks.base import Example
from integration.tasks.sorting import SortAnswer, SortDigitsTask

TASK = SortDigitsTask()
EXAMPLE = Example(prompt="52913", answer=SortAnswer("52913", "12359"), reference_completion="12359")


def score(text):
    return TASK.reward(text, EXAMPLE)


def test_generated_examples():
    examples = TASK.batch(300, seed=4).examples
    assert {len(e.prompt) for e in examples} == {3, 4, 5, 6}
    for e in examples:
        assert e.prompt.isdigit()
        assert e.reference_completion == "".join(sorted(e.prompt)) == e.answer.sorted_digits
        assert e.answer.digits == e.prompt
    assert any(len(set(e.prompt)) < len(e.prompt) for e in examples)  # repeated digits occur


def test_reward_on_hand_made_completions():
    assert score("12359") == 1.0
    assert score("12395") == 3 / 5  # last two swapped
    assert score("52913") == 1 / 5  # the prompt copied: only the 2 at index 1 is in place
    assert score("1235") == 4 / 5  # one digit short
    assert score("123599") == 5 / 6  # one symbol too many
    assert score("1235999999") == 5 / 10
    assert score("[MASK]2359") == 4 / 5  # a left-in mask costs its position only
    assert score("1[PAD]359") == 4 / 5
    assert score("12a59") == 4 / 5
    assert score("") == 0.0
    assert score("abcde") == 0.0
    assert score("{}") == 0.0


def test_repeated_digits():
    example = Example(prompt="3113", answer=SortAnswer("3113", "1133"), reference_completion="1133")
    assert TASK.reward("1133", example) == 1.0
    assert TASK.reward("1313", example) == 2 / 4
    assert TASK.reward("113", example) == 3 / 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="^min_length"):
        SortDigitsTask(min_length=0)
    with pytest.raises(ValueError, match="^max_length must be >= min_length"):
        SortDigitsTask(min_length=5, max_length=4)
    with pytest.raises(ValueError, match="^max_length"):
        SortDigitsTask(max_length=33)
    with pytest.raises(TypeError, match="^max_length"):
        SortDigitsTask(max_length="6")
