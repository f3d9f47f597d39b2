"""Verifiable tasks for the reference GRPO loop, generated in code, over one character vocabulary.

Vocabulary ([`integration.tasks.vocab`][integration.tasks.vocab]): 52 tokens: ``[PAD]`` 0, ``[MASK]`` 1, ``[EOS]`` 2,
``[BOS]`` 3, the digits, ``a-z`` and ``{}[]":,-=<#!``. ``vocab.encode`` / ``vocab.decode``.

Protocol ([`integration.tasks.base`][integration.tasks.base]): a [`Task`][integration.tasks.base.Task] has a ``name``, a fixed
``prompt_length`` and ``completion_length`` (tokens), ``sample(rng) -> Example`` (``prompt``,
hidden ``answer``, a ``reference_completion`` with reward 1), ``reward(completion_text, example)``
in ``[0, 1]`` (never raises on a string), and tensor helpers: ``batch(num, seed)`` (long prompt ids
``[num, prompt_length]``: ``[PAD]...[PAD] [BOS] prompt``, plus the examples), ``reference_ids``
(SFT targets ``[num, completion_length]``, ``[EOS]``-padded), ``completion_text(ids)`` (the text a
reward reads: up to the first ``[EOS]``, other special tokens kept by name in place) and
``rewards(completion_ids, examples)`` (float32 ``[num]``). Where the reward decomposes over positions
(``sort``, ``sudoku4``, ``constraints``), ``token_credit(ids, example)`` says which generated tokens
are right (1), wrong (0) or not credited (None), and ``credits(completion_ids, examples)`` gives it
for a batch (NaN for None).

Tasks (default configurations, registered in ``TASKS`` / ``get_task(name)``), with prompt and
completion lengths in tokens:

- ``sudoku4`` (17, 16): 4x4 Sudoku, 4-10 blanks, unique solution. Reward (d1's): the fraction of
  the puzzle's blank cells filled correctly.
- ``sort`` (7, 6): sort 3-6 digits. Reward: correct positions / max(digits, completion symbols).
- ``constraints`` (31, 8): a sequence of 5-8 letters from a 2-4 letter alphabet meeting 3-5
  stated constraints. Reward: 0 unless exactly ``length`` letters of the alphabet, else the
  fraction of the constraints satisfied.
- ``json_schema`` (33, 40): a JSON object with 2-3 typed, bounded fields. Reward: 0 unless a valid
  JSON object, else the fraction of schema checks passed (keys present, no extra key, each type,
  each range or value).

Examples (prompt -> reference completion)::

    sudoku4      0410314042000020          -> 2413314242311324
    sort         58073                     -> 03578
    constraints  6abc:#b=2,2=a,1=b,4=a,3=b -> babaaa
    json_schema  zw:i14-20,o:b,u:l1-2      -> {"zw":18,"o":true,"u":[0]}

Each task module's docstring gives the exact prompt grammar, generation and reward parsing. With the
default configurations the prompt formats cannot be confused with one another, so tasks can be
mixed in one model.
Everything is deterministic given the seed (``random.Random``; no global random state).
"""
from integration.tasks import vocab
from integration.tasks.base import Batch, Example, Task
from integration.tasks.constraints import ConstraintsTask
from integration.tasks.json_schema import JsonSchemaTask
from integration.tasks.registry import TASKS, get_task
from integration.tasks.sorting import SortDigitsTask
from integration.tasks.sudoku import Sudoku4Task

__all__ = [
    "TASKS",
    "Batch",
    "ConstraintsTask",
    "Example",
    "JsonSchemaTask",
    "SortDigitsTask",
    "Sudoku4Task",
    "Task",
    "get_task",
    "vocab",
]
