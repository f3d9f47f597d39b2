"""``json_schema``: write a small JSON object that matches a schema stated in the prompt.

Format::

    prompt      id:i3-40,nm:s2-4,ok:=true           fields 'name:spec' separated by ','
    completion  {"id":17,"nm":"qbz","ok":true}      one JSON object, then [EOS] padding

Each field has a name of 1-2 lowercase letters and one of these specs:

    ``i3-40``    an integer (not a bool) in [3, 40]                (bounds within 0..99)
    ``s2-4``     a string of 2 to 4 lowercase letters a-z          (lengths within 1..4)
    ``b``        a boolean
    ``l1-3``     a list of 1 to 3 integers, each a digit 0..9      (lengths within 1..3)
    ``=<json>``  exactly this value: ``=7``, ``="ab"``, ``=false``   (an int 0..99, 1-4 letters, a bool)

Every field is required and no other key is allowed. The reference completion is a random
matching object written compactly (``json.dumps(..., separators=(",", ":"))``, fields in prompt
order); any key order and JSON whitespace are accepted.

Reward: 0 if the completion is not valid JSON (``json.loads`` fails; ``NaN``/``Infinity`` and
duplicate keys also count as invalid) or is valid JSON but not an object. Otherwise the fraction
of these checks that pass:

- all required keys are present (one check);
- no key outside the schema (one check);
- per field, its type (a missing field fails it);
- per field with a spec other than ``b``, its value check: integer range; string length and
  charset; list length and digit elements; exact value for ``=``. It fails whenever the type check
  fails.

So a schema with f fields of which c carry a value check has ``2 + f + c`` checks.

Lengths (defaults: 2..3 fields): ``completion_length = 2 + max_fields * 12 + (max_fields - 1)``
(braces; per field quotes, name, colon and the longest value ``[1,2,3]``; commas) = 40;
``prompt_length = 1 + max_fields * 10 + (max_fields - 1)`` (``[BOS]``; per field name, colon and
the longest spec ``="abcd"``; commas) = 33.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Protocol

from integration.tasks import vocab
from integration.tasks.base import Example, Task, require_int_range

MAX_NAME_CHARS = 2
MAX_INT = 99
MAX_STRING_CHARS = 4
MAX_LIST_ITEMS = 3
MAX_VALUE_CHARS = 2 * MAX_LIST_ITEMS + 1  # "[1,2,3]", longer than '"abcd"', "false" or "99"
MAX_SPEC_CHARS = 3 + MAX_STRING_CHARS  # '="abcd"', longer than "i10-99"
MISSING = object()  # the value of a field absent from the completion


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _random_word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(vocab.LETTERS) for _ in range(rng.randint(low, high)))


def _sorted_pair(rng: random.Random, low: int, high: int) -> tuple[int, int]:
    a, b = rng.randint(low, high), rng.randint(low, high)
    return min(a, b), max(a, b)


class Field(Protocol):
    """One required key of a schema."""

    name: str

    @property
    def spec(self) -> str:
        """How the prompt writes the field's type and constraint."""

    def checks(self, value) -> tuple[bool, ...]:
        """Pass/fail of the field's checks for ``value`` (``MISSING`` if absent): the type check,
        then the value check if the field has one."""

    def example_value(self, rng: random.Random):
        """A random value that passes every check."""

    @classmethod
    def random(cls, name: str, rng: random.Random) -> "Field":
        """A field of this kind named ``name`` with random bounds (or value)."""


@dataclass(frozen=True)
class IntField:
    """``i<low>-<high>``: an integer in ``[low, high]``."""

    name: str
    low: int
    high: int

    @property
    def spec(self) -> str:
        return f"i{self.low}-{self.high}"

    def checks(self, value) -> tuple[bool, ...]:
        typed = _is_int(value)
        return typed, typed and self.low <= value <= self.high

    def example_value(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    @classmethod
    def random(cls, name: str, rng: random.Random) -> IntField:
        return cls(name, *_sorted_pair(rng, 0, MAX_INT))


@dataclass(frozen=True)
class StringField:
    """``s<low>-<high>``: a string of ``low..high`` lowercase letters."""

    name: str
    low: int
    high: int

    @property
    def spec(self) -> str:
        return f"s{self.low}-{self.high}"

    def checks(self, value) -> tuple[bool, ...]:
        typed = isinstance(value, str)
        return typed, typed and self.low <= len(value) <= self.high and all(c in vocab.LETTERS for c in value)

    def example_value(self, rng: random.Random) -> str:
        return _random_word(rng, self.low, self.high)

    @classmethod
    def random(cls, name: str, rng: random.Random) -> StringField:
        return cls(name, *_sorted_pair(rng, 1, MAX_STRING_CHARS))


@dataclass(frozen=True)
class BoolField:
    """``b``: a boolean (type check only)."""

    name: str

    @property
    def spec(self) -> str:
        return "b"

    def checks(self, value) -> tuple[bool, ...]:
        return (isinstance(value, bool),)

    def example_value(self, rng: random.Random) -> bool:
        return rng.random() < 0.5

    @classmethod
    def random(cls, name: str, rng: random.Random) -> BoolField:
        return cls(name)


@dataclass(frozen=True)
class DigitListField:
    """``l<low>-<high>``: a list of ``low..high`` integers, each in ``0..9``."""

    name: str
    low: int
    high: int

    @property
    def spec(self) -> str:
        return f"l{self.low}-{self.high}"

    def checks(self, value) -> tuple[bool, ...]:
        typed = isinstance(value, list) and all(_is_int(item) for item in value)
        return typed, typed and self.low <= len(value) <= self.high and all(0 <= item <= 9 for item in value)

    def example_value(self, rng: random.Random) -> list[int]:
        return [rng.randint(0, 9) for _ in range(rng.randint(self.low, self.high))]

    @classmethod
    def random(cls, name: str, rng: random.Random) -> DigitListField:
        return cls(name, *_sorted_pair(rng, 1, MAX_LIST_ITEMS))


@dataclass(frozen=True)
class ConstantField:
    """``=<json>``: exactly ``value`` (an int, a string or a bool), with the same JSON type."""

    name: str
    value: int | str | bool

    @property
    def spec(self) -> str:
        return "=" + json.dumps(self.value)

    def checks(self, value) -> tuple[bool, ...]:
        typed = _is_int(value) if _is_int(self.value) else isinstance(value, type(self.value))
        return typed, typed and value == self.value

    def example_value(self, rng: random.Random) -> int | str | bool:
        return self.value

    @classmethod
    def random(cls, name: str, rng: random.Random) -> ConstantField:
        kind = rng.choice((IntField, StringField, BoolField))
        return cls(name, kind.random(name, rng).example_value(rng))


FIELD_KINDS: tuple[type, ...] = (IntField, StringField, BoolField, DigitListField, ConstantField)


@dataclass(frozen=True)
class Schema:
    """The fields of one instance, in prompt order."""

    fields: tuple[Field, ...]

    @property
    def prompt(self) -> str:
        return ",".join(f"{field.name}:{field.spec}" for field in self.fields)

    def checks(self, obj: dict) -> list[bool]:
        """Every check (see the module docstring) for a parsed JSON object."""
        names = {field.name for field in self.fields}
        results = [names <= obj.keys(), obj.keys() <= names]
        for field in self.fields:
            results.extend(field.checks(obj.get(field.name, MISSING)))
        return results


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def parse_json(text: str):
    """``json.loads(text)``, strict: ``NaN``/``Infinity`` and duplicate keys raise ValueError."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object_without_duplicates)


@dataclass(frozen=True)
class JsonSchemaTask(Task):
    """Tiny JSON objects with ``min_fields..max_fields`` (1 to 4) fields."""

    min_fields: int = 2
    max_fields: int = 3

    name = "json_schema"
    answer_type = Schema

    def __post_init__(self):
        require_int_range(self.min_fields, self.max_fields, "min_fields", "max_fields", 1, 4)

    @property
    def prompt_length(self) -> int:
        return 1 + self.max_fields * (MAX_NAME_CHARS + 1 + MAX_SPEC_CHARS) + self.max_fields - 1

    @property
    def completion_length(self) -> int:
        return 2 + self.max_fields * (2 + MAX_NAME_CHARS + 1 + MAX_VALUE_CHARS) + self.max_fields - 1

    def _sample(self, rng: random.Random) -> Example:
        num_fields = rng.randint(self.min_fields, self.max_fields)
        names: list[str] = []
        while len(names) < num_fields:
            name = _random_word(rng, 1, MAX_NAME_CHARS)
            if name not in names:
                names.append(name)
        schema = Schema(tuple(rng.choice(FIELD_KINDS).random(name, rng) for name in names))
        reference = {field.name: field.example_value(rng) for field in schema.fields}
        completion = json.dumps(reference, separators=(",", ":"))
        return Example(prompt=schema.prompt, answer=schema, reference_completion=completion)

    def _score(self, completion_text: str, answer: Schema) -> float:
        try:
            obj = parse_json(completion_text)
        except (ValueError, RecursionError):
            return 0.0
        if not isinstance(obj, dict):
            return 0.0
        checks = answer.checks(obj)
        return sum(checks) / len(checks)
