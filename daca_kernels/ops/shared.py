"""What several ops share: the LM head a chunk of rows is multiplied through, the row chunks and
head checks of the ``(hidden, weight)`` ops, and the log-prob and sampling launchers with their
outputs. A leaf of ``ops/``: it imports no op module.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import Tensor

from daca_kernels.ops import chunked_logprob, dispatch
from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import FLOAT_DTYPES, check_int, check_same_device, check_shape, check_tensor

# The default row chunk keeps a chunk's logits near 1/32 of what the full [N, V] logits would take.
CHUNKS_PER_CALL = 32
MIN_CHUNK_ROWS = 64


def logprob_impl(backend: str, device: torch.device) -> ModuleType:
    """The module providing ``logprob_forward`` / ``logprob_backward`` for the resolved ``backend``
    (``"triton"`` or ``"torch"``) on ``device``."""
    if backend == "triton":
        return dispatch.triton_module("logprob", device)
    return chunked_logprob


def empty_logprob_outputs(like: Tensor, n: int, return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Uninitialised ``(logprob [N], softmax statistics [N, 2], entropy [N or 0])`` in the
    accumulation dtype of ``like`` (the statistics: each row's maximum and log-sum-exp above it)."""
    acc = accumulation_dtype(like.dtype)
    return (
        like.new_empty(n, dtype=acc),
        like.new_empty(n, 2, dtype=acc),
        like.new_empty(n if return_entropy else 0, dtype=acc),
    )


def empty_sampling_outputs(like: Tensor, n: int, return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Uninitialised ``(candidate int64 [N], confidence [N], entropy [N or 0])``, the floats in the
    accumulation dtype of ``like``."""
    acc = accumulation_dtype(like.dtype)
    return (
        like.new_empty(n, dtype=torch.int64),
        like.new_empty(n, dtype=acc),
        like.new_empty(n if return_entropy else 0, dtype=acc),
    )


def default_chunk_rows(num_rows: int) -> int:
    rows = max(MIN_CHUNK_ROWS, math.ceil(num_rows / CHUNKS_PER_CALL))
    return min(max(num_rows, 1), MIN_CHUNK_ROWS * math.ceil(rows / MIN_CHUNK_ROWS))


def chunk_rows(chunk_size: int | None, num_rows: int) -> int:
    """``chunk_size`` (already checked), or the default for ``num_rows`` rows when it is None."""
    return default_chunk_rows(num_rows) if chunk_size is None else chunk_size


def check_chunk_rows(chunk_size, num_rows: int) -> int:
    """``chunk_size`` (an int >= 1), or the default for ``num_rows`` rows when it is None."""
    return chunk_rows(None if chunk_size is None else check_int(chunk_size, "chunk_size", low=1), num_rows)


def check_linear_head(hidden: Tensor, weight: Tensor, bias: Tensor | None, **others: Tensor | None) -> tuple[int, int]:
    """Checks the head inputs shared by every ``(hidden, weight)`` op: ``hidden [N, H]``,
    ``weight [V, H]`` with V > 0, ``bias [V]`` or None, one floating dtype, one device (``others``
    too). Returns ``(N, V)``."""
    check_tensor(hidden, "hidden", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(weight, "weight", ndim=2, dtypes=FLOAT_DTYPES)
    if bias is not None:
        check_tensor(bias, "bias", ndim=1, dtypes=FLOAT_DTYPES)
    check_same_device(hidden, "hidden", weight=weight, **others, bias=bias)
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and value.dtype != hidden.dtype:
            raise TypeError(f"{name} must have the dtype of hidden ({hidden.dtype}), got {value.dtype}")
    num_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != hidden_size:
        raise ValueError(f"weight must have shape [V, H] with H = {hidden_size} (from hidden), got {tuple(weight.shape)}")
    if vocab == 0:
        raise ValueError("weight must have at least one row (V > 0)")
    if bias is not None:
        check_shape(bias, "bias", (vocab,), "[V] (from weight)")
    return num_rows, vocab



# ``torch.mm(..., out_dtype=)`` and ``aten.addmm.dtype_out`` (half-precision GEMMs that write float32) came
# in torch 2.8; older releases upcast the head instead.
MM_OUT_DTYPE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


class LMHead:
    """The LM head in the precision the chunks are computed in.

    Logits and their gradients are always materialised (a chunk at a time) in the accumulation
    dtype, so half/bfloat16 inputs lose nothing to rounded logits. On CUDA with torch 2.8 or later
    the half-precision GEMMs write float32 directly; elsewhere the head is upcast once per call.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.acc = accumulation_dtype(weight.dtype)
        self.dtype = weight.dtype
        self.fp32_out_gemm = MM_OUT_DTYPE and weight.is_cuda and weight.dtype != self.acc
        upcast = weight.dtype != self.acc and not self.fp32_out_gemm
        self.weight = weight.to(self.acc) if upcast else weight
        self.bias = None if bias is None else bias.to(self.acc)

    def logits(self, hidden: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """``[C, hi - lo]`` logits of a chunk of rows against head rows ``lo:hi`` (default: all),
        in the accumulation dtype."""
        weight = self.weight[lo:hi]
        if self.fp32_out_gemm:
            out = torch.mm(hidden, weight.T, out_dtype=self.acc)
        else:
            out = hidden.to(self.acc) @ weight.T
        if self.bias is not None:
            out += self.bias[lo:hi]
        return out

    def operand(self, x: Tensor) -> Tensor:
        """``x`` (``d logits`` or hidden rows) in the dtype the gradient GEMMs read."""
        return x.to(self.dtype if self.fp32_out_gemm else self.acc)

    def product(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        """``out = a @ b`` for ``out`` in the inputs' dtype (accumulated in the accumulation dtype)."""
        a, b = self.operand(a), self.operand(b)
        if out.dtype == a.dtype:
            torch.mm(a, b, out=out)
        else:
            out.copy_(a @ b)

    def accumulate(self, acc: Tensor, a: Tensor, b: Tensor) -> None:
        """``acc += a @ b`` with ``acc`` in the accumulation dtype."""
        a, b = self.operand(a), self.operand(b)
        if self.fp32_out_gemm:
            torch.ops.aten.addmm.dtype_out(acc, a, b, self.acc, out=acc)
        else:
            acc.addmm_(a, b)
