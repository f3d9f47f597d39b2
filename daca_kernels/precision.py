"""The one precision rule of the package outside the kernels (``daca_kernels.kernels.launch`` holds the
kernels' twin of it): values are accumulated and returned in float64 when an input is float64, in float32
otherwise (half-precision inputs included)."""
from __future__ import annotations

import torch


def accumulation_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32 (None entries are ignored)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
