"""The registry of tasks by name, each with its default configuration."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from integration.tasks.base import Task
from integration.tasks.constraints import ConstraintsTask
from integration.tasks.json_schema import JsonSchemaTask
from integration.tasks.sorting import SortDigitsTask
from integration.tasks.sudoku import Sudoku4Task

TASKS: Mapping[str, Task] = MappingProxyType(
    {task.name: task for task in (Sudoku4Task(), SortDigitsTask(), ConstraintsTask(), JsonSchemaTask())}
)
"""Read-only ``{name: task}``; build a task class directly for another configuration."""


def get_task(name: str) -> Task:
    """The registered task called ``name`` (one of ``TASKS``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in TASKS:
        raise ValueError(f"name must be one of {', '.join(sorted(TASKS))}; got {name!r}")
    return TASKS[name]
