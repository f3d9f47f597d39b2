"""``linear_logprob``: log-probabilities of targets through an LM head without ``[N, V]`` logits.

The rows are processed ``chunk_size`` at a time: the chunk's logits are one matmul (float32
output), the log-sum-exp/gather runs on them (Triton kernel or chunked PyTorch path) and only the
per-row log-sum-exp is kept. Backward recomputes a chunk's logits, turns them into ``d logits`` in
place and feeds the two gradient matmuls; the weight (and bias) gradient is accumulated in float32.
Peak extra memory is one float32 chunk of logits plus the float32 weight-gradient accumulator
(which, for float32 weights, is the gradient itself).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from daca_kernels import reference
from daca_kernels.ops.dispatch import resolve_backend
from daca_kernels.ops.gather_logprob import accumulation_dtype, empty_logprob_outputs, logprob_impl
from daca_kernels.ops.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_positive_float,
    check_same_device,
    check_shape,
    check_tensor,
    checked_index,
)

# The default chunk keeps a chunk's logits near 1/32 of what the full [N, V] logits would take.
CHUNKS_PER_CALL = 32
MIN_CHUNK_ROWS = 64


def default_chunk_rows(num_rows: int) -> int:
    rows = max(MIN_CHUNK_ROWS, math.ceil(num_rows / CHUNKS_PER_CALL))
    return min(max(num_rows, 1), MIN_CHUNK_ROWS * math.ceil(rows / MIN_CHUNK_ROWS))


def check_chunk_rows(chunk_size, num_rows: int) -> int:
    """``chunk_size`` (a positive int), or the default for ``num_rows`` rows when it is None."""
    if chunk_size is None:
        return default_chunk_rows(num_rows)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


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


class _Head:
    """The LM head in the precision the chunks are computed in.

    Logits and their gradients are always materialised (a chunk at a time) in the accumulation
    dtype, so half/bfloat16 inputs lose nothing to rounded logits. On CUDA the half-precision
    GEMMs write float32 directly; elsewhere the head is upcast once per call.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.acc = accumulation_dtype(weight.dtype)
        self.dtype = weight.dtype
        self.fp32_out_gemm = weight.is_cuda and weight.dtype != self.acc
        upcast = weight.dtype != self.acc and not self.fp32_out_gemm
        self.weight = weight.to(self.acc) if upcast else weight
        self.bias = None if bias is None else bias.to(self.acc)

    def logits(self, hidden: Tensor) -> Tensor:
        """``[C, V]`` logits of a chunk of rows, in the accumulation dtype."""
        if self.fp32_out_gemm:
            out = torch.mm(hidden, self.weight.T, out_dtype=self.acc)
        else:
            out = hidden.to(self.acc) @ self.weight.T
        if self.bias is not None:
            out += self.bias
        return out

    def grad_hidden(self, dlogits: Tensor, out: Tensor) -> None:
        if self.fp32_out_gemm:
            torch.mm(dlogits.to(self.dtype), self.weight, out=out)
        elif out.dtype == self.acc:
            torch.mm(dlogits, self.weight, out=out)
        else:
            out.copy_(dlogits @ self.weight)

    def accumulate_grad_weight(self, acc: Tensor, dlogits: Tensor, hidden: Tensor) -> None:
        """``acc += dlogits.T @ hidden`` with ``acc`` in the accumulation dtype."""
        if self.fp32_out_gemm:
            torch.ops.aten.addmm.dtype_out(acc, dlogits.to(self.dtype).T, hidden, self.acc, out=acc)
        else:
            acc.addmm_(dlogits.T, hidden.to(self.acc))


@torch.library.custom_op("daca::linear_logprob", mutates_args=())
def _linear_logprob_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    return_entropy: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    check_index_range(targets, weight.shape[0], "targets")
    n = hidden.shape[0]
    out, stats, entropy = empty_logprob_outputs(hidden, n, return_entropy)
    impl, head = logprob_impl(hidden.device), _Head(weight, bias)
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        logits = head.logits(hidden[lo:hi])
        o, s, e = impl.logprob_forward(logits, None, targets[lo:hi], 1.0 / temperature, return_entropy)
        out[lo:hi], stats[lo:hi] = o, s
        if return_entropy:
            entropy[lo:hi] = e
    return out, stats, entropy


@_linear_logprob_op.register_fake
def _(hidden, weight, targets, bias, temperature, return_entropy, chunk_size):
    return empty_logprob_outputs(hidden, hidden.shape[0], return_entropy)


@torch.library.custom_op("daca::linear_logprob_backward", mutates_args=())
def _linear_logprob_backward_op(
    grad_out: Tensor,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    stats: Tensor,
    entropy: Tensor,
    temperature: float,
    chunk_size: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    n = hidden.shape[0]
    acc = accumulation_dtype(hidden.dtype)
    grad_out = grad_out.contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
    d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0)
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else weight.new_empty(0)
    need_bias = need_bias and bias is not None
    d_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_bias else weight.new_empty(0)
    impl, head = logprob_impl(hidden.device), _Head(weight, bias)
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        h = hidden[lo:hi]
        dlogits = head.logits(h)
        impl.logprob_backward(
            dlogits, None, True, targets[lo:hi], grad_out[lo:hi],
            None if grad_entropy is None else grad_entropy[lo:hi],
            stats[lo:hi], entropy[lo:hi],
            1.0 / temperature, dlogits,
        )
        if need_hidden:
            head.grad_hidden(dlogits, d_hidden[lo:hi])
        if need_weight:
            head.accumulate_grad_weight(d_weight, dlogits, h)
        if need_bias:
            d_bias += dlogits.sum(0, dtype=acc)
    if need_weight:
        d_weight = d_weight.to(weight.dtype)
    if need_bias:
        d_bias = d_bias.to(bias.dtype)
    return d_hidden, d_weight, d_bias


@_linear_logprob_backward_op.register_fake
def _(grad_out, grad_entropy, hidden, weight, targets, bias, stats, entropy, temperature, chunk_size,
      need_hidden, need_weight, need_bias):
    return (
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias and bias is not None else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, return_entropy, chunk_size = inputs
    _, stats, entropy = output
    ctx.save_for_backward(hidden, weight, targets, bias, stats, entropy)
    ctx.temperature, ctx.return_entropy, ctx.chunk_size = temperature, return_entropy, chunk_size


def _backward(ctx, grad_out, grad_stats, grad_entropy):
    hidden, weight, targets, bias, stats, entropy = ctx.saved_tensors
    if grad_out is None:
        grad_out = stats.new_zeros(stats.shape[0])
    if not ctx.return_entropy:
        grad_entropy = None
    need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
    d_hidden, d_weight, d_bias = torch.ops.daca.linear_logprob_backward(
        grad_out, grad_entropy, hidden, weight, targets, bias, stats, entropy, ctx.temperature,
        ctx.chunk_size, need_hidden, need_weight, need_bias,
    )
    return (
        d_hidden if need_hidden else None,
        d_weight if need_weight else None,
        None,
        d_bias if need_bias else None,
        None,
        None,
        None,
    )


_linear_logprob_op.register_autograd(_backward, setup_context=_setup_context)


def linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
):
    """Log-probability of each target under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Never holds ``[N, V]`` logits for all rows at once: rows go through the head ``chunk_size`` at
    a time (default: about N/32, at least 64 rows).

    Args:
        hidden: float ``[N, H]``.
        weight: ``[V, H]``, the LM head (same dtype and device as ``hidden``).
        targets: int64/int32 ``[N]`` ids in ``[0, V)``.
        bias: ``[V]`` or None.
        temperature: Python float > 0.
        return_entropy: also return each row's entropy.
        chunk_size: rows per chunk (int > 0), or None for the default.

    Returns:
        float32 ``[N]`` (float64 for float64 inputs), or ``(logprob, entropy)``. Gradients flow to
        ``hidden``, ``weight`` and ``bias``; the weight and bias gradients are accumulated in
        float32 across chunks.
    """
    check_tensor(targets, "targets", ndim=1, dtypes=INDEX_DTYPES)
    num_rows, vocab = check_linear_head(hidden, weight, bias, targets=targets)
    check_shape(targets, "targets", (num_rows,), "[N] (from hidden)")
    temperature = check_positive_float(temperature, "temperature")
    chunk_size = check_chunk_rows(chunk_size, num_rows)

    if resolve_backend(hidden.device) == "reference":
        targets = checked_index(targets, vocab, "targets")
        return reference.linear_logprob(hidden, weight, targets, bias, temperature, return_entropy)
    out, _, entropy = torch.ops.daca.linear_logprob(
        hidden, weight, targets, bias, temperature, return_entropy, chunk_size
    )
    return (out, entropy) if return_entropy else out
