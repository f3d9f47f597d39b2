"""json_schema: the prompt grammar, each schema check, and invalid JSON."""
import json

import pytest

from integration.tasks.base import Example
from integration.tasks.json_schema import (
    BoolField,
    ConstantField,
    DigitListField,
    IntField,
    JsonSchemaTask,
    Schema,
    StringField,
)

TASK = JsonSchemaTask()
# 8 checks: keys present, no extra key, 3 types, 3 value checks.
SCHEMA = Schema((IntField("id", 3, 40), StringField("nm", 2, 4), ConstantField("ok", True)))
EXAMPLE = Example(prompt=SCHEMA.prompt, answer=SCHEMA, reference_completion='{"id":17,"nm":"qbz","ok":true}')


def score(text, example=EXAMPLE):
    return TASK.reward(text, example)


def example_of(*fields):
    schema = Schema(fields)
    return Example(prompt=schema.prompt, answer=schema, reference_completion="")


def test_prompt_grammar():
    assert SCHEMA.prompt == "id:i3-40,nm:s2-4,ok:=true"
    fields = (BoolField("b"), DigitListField("xy", 1, 3), ConstantField("c", "ab"), ConstantField("d", 7))
    assert Schema(fields).prompt == 'b:b,xy:l1-3,c:="ab",d:=7'


def test_reward_on_hand_made_objects():
    assert score('{"id":17,"nm":"qbz","ok":true}') == 1.0
    assert score('{"ok": true, "nm": "qb", "id": 3}') == 1.0  # any key order and JSON whitespace
    assert score('{"id":41,"nm":"qbz","ok":true}') == 7 / 8  # out of range
    assert score('{"id":"17","nm":"qbz","ok":true}') == 6 / 8  # wrong type fails the range too
    assert score('{"id":true,"nm":"qbz","ok":true}') == 6 / 8  # a bool is not an int
    assert score('{"id":17.0,"nm":"qbz","ok":true}') == 6 / 8
    assert score('{"id":17,"nm":"qb1","ok":true}') == 7 / 8  # charset
    assert score('{"id":17,"nm":"q","ok":true}') == 7 / 8  # too short
    assert score('{"id":17,"nm":"qbzzz","ok":true}') == 7 / 8  # too long
    assert score('{"id":17,"nm":"qbz","ok":false}') == 7 / 8  # wrong constant
    assert score('{"id":17,"nm":"qbz","ok":1}') == 6 / 8  # 1 is not true
    assert score('{"id":17,"nm":"qbz"}') == 5 / 8  # missing key: presence, type, value
    assert score('{"id":17,"nm":"qbz","ok":true,"x":1}') == 7 / 8  # extra key
    assert score('{"id":17,"ok":true,"x":1}') == 4 / 8
    assert score('{"id":null,"nm":null,"ok":null}') == 2 / 8
    assert score("{}") == 1 / 8  # only "no extra key" holds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        '{"id":17,"nm":"qbz",',  # truncated
        '{"id":17,"nm":"qbz","ok":true}}',  # trailing garbage
        '{"id":17,"nm":"qbz","ok":tr[MASK]e}',
        '{"id":17,"nm":"qbz","ok":true}[EOS]',
        '{"id":NaN,"nm":"qbz","ok":true}',
        '{"id":Infinity,"nm":"qbz","ok":true}',
        '{"id":17,"id":18,"nm":"qbz","ok":true}',  # duplicate key
        "{id:17}",
        "garbage",
        "[" * 100_000,
        "1" * 5000,
        # Valid JSON that is not an object.
        '[{"id":17,"nm":"qbz","ok":true}]',
        '"text"',
        "17",
        "null",
    ],
)
def test_invalid_json_or_non_objects_get_zero(text):
    assert score(text) == 0.0


def test_digit_list_checks():
    example = example_of(DigitListField("l", 1, 3))  # 4 checks
    assert score('{"l":[0,9,5]}', example) == 1.0
    assert score('{"l":[]}', example) == 3 / 4
    assert score('{"l":[1,2,3,4]}', example) == 3 / 4
    assert score('{"l":[1,10]}', example) == 3 / 4
    assert score('{"l":[1,-1]}', example) == 3 / 4
    assert score('{"l":[1,true]}', example) == 2 / 4
    assert score('{"l":[1,"2"]}', example) == 2 / 4
    assert score('{"l":"12"}', example) == 2 / 4


def test_bool_field_has_only_a_type_check_and_constants_keep_their_type():
    example = example_of(BoolField("b"), ConstantField("c", 0), ConstantField("s", "ab"))  # 2 + 3 + 2 checks
    assert score('{"b":false,"c":0,"s":"ab"}', example) == 1.0
    assert score('{"b":0,"c":false,"s":"ab"}', example) == 4 / 7
    assert score('{"b":true,"c":0.0,"s":"ba"}', example) == 4 / 7


def test_generated_examples_cover_every_field_kind():
    kinds = set()
    for e in TASK.batch(300, seed=9).examples:
        fields = e.answer.fields
        assert 2 <= len(fields) <= 3
        assert len({f.name for f in fields}) == len(fields)
        assert all(1 <= len(f.name) <= 2 for f in fields)
        assert e.prompt == e.answer.prompt
        assert list(json.loads(e.reference_completion)) == [f.name for f in fields]
        kinds.update(type(f) for f in fields)
    assert kinds == {IntField, StringField, BoolField, DigitListField, ConstantField}


def test_longest_prompt_and_completion_fit_exactly():
    longest_prompt = 'ab:="abcd",cd:="abcd",ef:="abcd"'
    assert len(TASK.encode_prompt(longest_prompt)) == TASK.prompt_length == 1 + len(longest_prompt)
    longest = example_of(DigitListField("ab", 1, 3), DigitListField("cd", 1, 3), DigitListField("ef", 1, 3))
    completion = '{"ab":[1,2,3],"cd":[4,5,6],"ef":[7,8,9]}'
    assert score(completion, longest) == 1.0
    assert len(completion) == TASK.completion_length == 40


def test_bad_arguments():
    with pytest.raises(ValueError, match="^min_fields"):
        JsonSchemaTask(min_fields=0)
    with pytest.raises(ValueError, match="^max_fields"):
        JsonSchemaTask(max_fields=5)
    with pytest.raises(ValueError, match="^max_fields must be >= min_fields"):
        JsonSchemaTask(min_fields=3, max_fields=2)
