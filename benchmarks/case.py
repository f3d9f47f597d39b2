"""One benchmark measurement to make: what is timed and how its useful work is counted.

A suite module (``bench_*.py``) exposes ``cases(size, device) -> list[Case]``; ``run.py`` sorts
all cases by ``priority`` (lowest first: every op at the first shape, then the next shape), builds each one's inputs only when its turn
comes, and times the call it returns. ``size`` is ``"smoke"`` (toy shapes, one per case: the test
suite's check that the benchmarks still run), ``"quick"`` (CPU shapes) or ``"full"`` (GPU shapes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SIZES = ("smoke", "quick", "full")


@dataclass(frozen=True)
class Work:
    """Useful work of one call: the formula as written in the row, and its value.

    ``read_only``: bytes that are only read (no output of the same order is written); such a row
    is held to the device's read ceiling rather than its copy ceiling (see ``ceilings.py``).
    """

    formula: str
    value: int
    read_only: bool = False


@dataclass(frozen=True)
class Case:
    op: str
    mode: str
    provider: str
    shape: str
    dtype: str
    setup: Callable[[], Callable[[], object]]  # builds the inputs, returns the call to time
    bytes: Work | None = None
    flops: Work | None = None
    priority: float = 0.0  # the shape's rank (0: the first LLaDA shape) plus a fraction for the op
    steps_per_call: int = 1  # a call that makes several steps (a rollout): the row also gives ms per step
    # The (m, n, k) shapes of the matrix products the case makes (rows counted in FLOPs): the matmul
    # ceiling that judges it is the best rate over these and the square products (``ceilings.py``).
    gemms: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self):
        if (self.bytes is None) == (self.flops is None):
            raise ValueError(f"{self.op}/{self.provider}: exactly one of bytes and flops must be counted")
        if self.flops is not None and self.flops.read_only:
            raise ValueError(f"{self.op}/{self.provider}: read_only applies to bytes")
        if self.gemms and self.flops is None:
            raise ValueError(f"{self.op}/{self.provider}: gemms apply to rows counted in FLOPs")

    @property
    def name(self) -> str:
        """The case's name in logs and pytest ids."""
        return f"{self.op}-{self.mode}-{self.provider}-{self.shape}-{self.dtype}"


def head_gemms(n: int, vocab: int, hidden_size: int, mode: str) -> tuple[tuple[int, int, int], ...]:
    """The (m, n, k) products of a head over ``n`` rows: the logits ``[N, H] @ [H, V]``, and for
    ``fwd+bwd`` also the hidden states' gradient ``[N, V] @ [V, H]`` and the weight's ``[V, N] @ [N, H]``."""
    forward = ((n, vocab, hidden_size),)
    return forward if mode == "fwd" else forward + ((n, hidden_size, vocab), (vocab, hidden_size, n))


def pick(size: str, *, smoke, quick, full):
    """The value of a setting for ``size``."""
    return {"smoke": smoke, "quick": quick, "full": full}[size]
