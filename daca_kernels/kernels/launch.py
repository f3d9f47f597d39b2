"""Launch settings shared by the kernel modules.

``INTERPRETED`` records whether the kernels are built for the Triton interpreter: ``triton.jit``
reads ``TRITON_INTERPRET`` when a kernel module is imported, and this module is imported with the
first of them (``daca_kernels.ops.dispatch`` imports kernel modules lazily, on first launch).

Every kernel module also lists, in ``cuda_launch_cases()``, calls of its launchers that reach every
configuration those launchers can choose on a GPU; ``daca_kernels.tools.ahead_of_time`` compiles
them for NVIDIA targets. The helpers at the end of this module build such calls.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The interpreter runs a block as one numpy operation: the wider, the fewer Python iterations.
INTERPRETER_MAX_BLOCK = 1 << 15

# The floating dtypes the kernels accept.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the kernels' outputs and running sums for inputs of ``dtype``: float64 for
    float64, else float32 (the kernels' twin of ``daca_kernels.precision``; kernels import nothing
    outside ``kernels/``)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulator_dtype(dtype: torch.dtype):
    """The Triton dtype of running sums for inputs of ``dtype`` ([`accumulation_dtype`][daca_kernels.kernels.launch.accumulation_dtype])."""
    return tl.float64 if accumulation_dtype(dtype) == torch.float64 else tl.float32


def row_block(length: int, gpu_block: int) -> int:
    """Elements of a row one program loads at a time: ``gpu_block`` on a GPU (one compiled kernel
    per dtype and flags, whatever the row length; shorter rows leave lanes masked), the row's power
    of two up to ``INTERPRETER_MAX_BLOCK`` under the interpreter (fewer Python iterations)."""
    if INTERPRETED:
        return min(triton.next_power_of_2(max(length, 1)), INTERPRETER_MAX_BLOCK)
    return gpu_block


def num_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def gpu_row_lengths(limit: int = 1 << 16) -> list[int]:
    """Row lengths 16, 32, ..., ``limit`` for ``cuda_launch_cases``: should a launcher's block ever
    depend on the row length (powers of two below ``limit``), they reach every choice. Multiples of
    16, as the vocabularies and sequence lengths of production models are."""
    return [1 << i for i in range(4, limit.bit_length())]
