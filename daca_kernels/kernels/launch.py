"""Launch settings shared by the kernel modules.

``INTERPRETED`` records whether the kernels are built for the Triton interpreter: ``triton.jit``
reads ``TRITON_INTERPRET`` when a kernel module is imported, and this module is imported with the
first of them (``daca_kernels.ops.dispatch`` imports kernel modules lazily, on first launch).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The interpreter runs a block as one numpy operation: the wider, the fewer Python iterations.
INTERPRETER_MAX_BLOCK = 1 << 15


def accumulator_dtype(dtype: torch.dtype):
    """The Triton dtype of running sums for inputs of ``dtype``: float64 for float64, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def row_block(length: int, gpu_max: int) -> int:
    """Elements of a row one program loads at a time: the row's power of two, capped at
    ``gpu_max`` on a GPU (register pressure) and at ``INTERPRETER_MAX_BLOCK`` under the interpreter."""
    return min(triton.next_power_of_2(max(length, 1)), INTERPRETER_MAX_BLOCK if INTERPRETED else gpu_max)


def num_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)
