"""``linear_logprob``: log-probabilities of targets through an LM head without ``[N, V]`` logits.

Two ways through the head, both with float32 logits (one GEMM per chunk, float32 output) and
float32 accumulation:

- vocabulary chunks (CUDA, heads wider than one vocabulary chunk): the forward takes every row
  through ``vocab_chunk`` head rows at a time, runs the log-prob kernel on the chunk and merges
  the chunks' softmax statistics (maximum, log-sum-exp above it, entropy) per row; the target's
  logit is read in the chunk that holds it. The backward recomputes each chunk's logits, writes
  its ``d logits`` from the saved statistics, writes the chunk's slice of the weight (and bias)
  gradient once and adds its share of ``d hidden`` to a float32 ``[N, H]`` accumulator. The head
  is streamed once per GEMM pass and no ``[V, H]`` buffer is read or written more than once. The
  chunk is sized so that its float32 logits (with the half-precision ``d logits`` copy the GEMMs
  read, and the float32 ``d hidden`` accumulator beyond the gradient itself) stay within 5 % of
  the float32 ``[N, V]`` logits, at least ``MIN_VOCAB_CHUNK`` entries. With Triton and a
  half-precision head, one kernel computes a chunk's logits and its statistics (forward) or its
  ``d logits`` (backward) in a pass (``daca_kernels.kernels.linear_logprob``): the chunk's float32
  logits are never written; in the forward one more launch per chunk folds the chunk's statistics
  into each row's running ones.
- row chunks (CPU, small heads, at most ``MIN_CHUNK_ROWS`` rows, or an explicit ``chunk_size``):
  ``chunk_size`` rows at a time against the whole head; the weight gradient is accumulated across
  chunks in a float32 ``[V, H]`` buffer (on CPU the head is upcast once per call, so for float32
  weights this buffer is the gradient itself).
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.ops import dispatch
from daca_kernels.ops.dispatch import triton_module
from daca_kernels.ops.shared import (
    MIN_CHUNK_ROWS,
    LMHead,
    check_linear_head,
    chunk_rows,
    empty_logprob_outputs,
    logprob_impl,
)
from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import (
    INDEX_DTYPES,
    check_int,
    check_positive_float,
    check_shape,
    check_tensor,
    guard_index,
    nan_where_invalid,
)

# A vocabulary chunk's working set stays within this share of the float32 [N, V] logits.
LOGITS_MEMORY_SHARE = 0.05
# Vocabulary chunks are multiples of this (16-byte aligned rows for the kernels, whole GEMM tiles)
# and at least MIN_VOCAB_CHUNK entries, enough for the chunk's GEMMs to stay compute-bound.
VOCAB_CHUNK_UNIT = 256
MIN_VOCAB_CHUNK = 2048


def default_vocab_chunk(vocab: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Head rows per vocabulary chunk for ``dtype`` inputs: per row of hidden, the chunk's logits
    (accumulation dtype), the copy of its ``d logits`` in ``dtype`` the GEMMs read (half precision
    only) and the excess of the float32 ``d hidden`` accumulator over the gradient itself fit in
    ``LOGITS_MEMORY_SHARE`` of a float32 logits row; rounded down to ``VOCAB_CHUNK_UNIT``, at
    least ``MIN_VOCAB_CHUNK``."""
    acc = accumulation_dtype(dtype)
    acc_bytes, in_bytes = acc.itemsize, dtype.itemsize
    budget = LOGITS_MEMORY_SHARE * 4 * vocab - (acc_bytes - in_bytes) * hidden_size
    per_entry = acc_bytes + (in_bytes if dtype != acc else 0)
    return max(MIN_VOCAB_CHUNK, int(budget // per_entry) // VOCAB_CHUNK_UNIT * VOCAB_CHUNK_UNIT)


def plan_vocab_chunk(hidden: Tensor, weight: Tensor, chunk_size) -> int:
    """Head rows per vocabulary chunk for this call, or 0 for row chunks: vocabulary chunks on
    CUDA when no ``chunk_size`` is given, the head is wider than one chunk and there are more
    rows than one row chunk holds (up to ``MIN_CHUNK_ROWS`` rows, one row chunk already streams
    the head once per pass, with fewer launches)."""
    if chunk_size is not None or not hidden.is_cuda or hidden.shape[0] <= MIN_CHUNK_ROWS:
        return 0
    vocab_chunk = default_vocab_chunk(weight.shape[0], weight.shape[1], weight.dtype)
    return vocab_chunk if weight.shape[0] > vocab_chunk else 0


def _fused_head(hidden: Tensor, backend: str):
    """The Triton kernels that compute a vocabulary chunk's logits and consume them in one pass
    (``daca_kernels.kernels.linear_logprob``) when they serve these inputs (``backend="triton"``, a
    half-precision head), else None."""
    if backend == "triton" and hidden.dtype in (torch.float16, torch.bfloat16):
        return triton_module("linear_logprob", hidden.device)
    return None


def _vocab_chunks(vocab: int, vocab_chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(vocab, lo + vocab_chunk)) for lo in range(0, vocab, vocab_chunk)]


def _merge_blocks(outs, maxima, logs, entropies, which, return_entropy):
    """Merges softmax statistics of rows split in blocks of columns. Per block b and row n
    (``[B, N]`` each): the target's log-prob within the block (read in block ``which[n]`` only), the
    maximum ``m_b``, ``l_b = log sum exp(x - m_b)`` and the entropy ``H_b`` (``[B, 0]`` without
    ``return_entropy``). Returns the rows' ``(log-prob, maximum, log sum exp above it, entropy)``,
    the entropy ``[0]`` without ``return_entropy``."""
    row_max = maxima.max(0).values
    shifted = maxima - row_max
    log_total = torch.logsumexp(shifted + logs, 0)
    which = which.unsqueeze(0)
    # The target's scaled logit minus its block's maximum, kept apart from the maxima for precision.
    target_centred = (outs.gather(0, which) + logs.gather(0, which)).squeeze(0)
    out = (target_centred + (maxima.gather(0, which).squeeze(0) - row_max)) - log_total
    if not return_entropy:
        return out, row_max, log_total, log_total.new_empty(0)
    # H = l - sum_b w_b E_b[x - m], with E_b[x - m_b] = l_b - H_b and w_b the block's probability mass.
    weights = torch.exp(shifted + logs - log_total)
    return out, row_max, log_total, log_total - (weights * (logs - entropies + shifted)).sum(0)


def _forward_vocab_chunks(hidden, weight, head, targets, inv_temperature, return_entropy, vocab_chunk, impl,
                          backend):
    """The forward over vocabulary chunks: per chunk the kernel's statistics (maximum ``m_c``,
    ``l_c = log sum exp(x - m_c)``, entropy ``H_c``) and the target's log-prob within the chunk,
    merged per row into the whole head's after the loop (``[chunks, N]`` work). With Triton and a
    half-precision head, one kernel computes each chunk's logits and the statistics of its blocks of
    columns and one more folds them into the rows' running statistics
    (``daca_kernels.kernels.linear_logprob``): two launches per chunk."""
    n, vocab = hidden.shape[0], weight.shape[0]
    out, stats, entropy = empty_logprob_outputs(hidden, n, return_entropy)
    targets = targets.to(torch.int64)
    fused = _fused_head(hidden, backend)
    if fused is not None:
        # Per chunk: the kernel's block statistics, folded into the rows' running statistics by one
        # more launch; the outputs hold the whole head's after the last chunk.
        state = hidden.new_empty(len(fused.STATE), n, dtype=torch.float32)
        for lo, hi in _vocab_chunks(vocab, vocab_chunk):
            parts = fused.head_stats_parts(hidden, weight[lo:hi], None if head.bias is None else head.bias[lo:hi],
                                           targets, inv_temperature, return_entropy, target_offset=lo)
            fused.merge_chunk(parts, targets, lo, hi, state, out, stats, entropy, lo == 0)
        return out, stats, entropy
    parts = []
    for lo, hi in _vocab_chunks(vocab, vocab_chunk):
        local = (targets - lo).clamp_(0, hi - lo - 1)
        chunk_out, chunk_stats, chunk_entropy = impl.logprob_forward(head.logits(hidden, lo, hi), None, local,
                                                                     inv_temperature, return_entropy)
        parts.append((chunk_out, *chunk_stats.unbind(-1), chunk_entropy))
    outs, maxima, logs, entropies = (torch.stack(part) for part in zip(*parts))
    merged, stats[:, 0], stats[:, 1], merged_entropy = _merge_blocks(outs, maxima, logs, entropies,
                                                                     targets // vocab_chunk, return_entropy)
    out.copy_(merged)
    entropy.copy_(merged_entropy)
    return out, stats, entropy


def _forward_row_chunks(hidden, head, targets, inv_temperature, return_entropy, chunk_size, impl):
    n = hidden.shape[0]
    out, stats, entropy = empty_logprob_outputs(hidden, n, return_entropy)
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        o, s, e = impl.logprob_forward(head.logits(hidden[lo:hi]), None, targets[lo:hi], inv_temperature,
                                       return_entropy)
        out[lo:hi], stats[lo:hi] = o, s
        if return_entropy:
            entropy[lo:hi] = e
    return out, stats, entropy


@torch.library.custom_op("daca::linear_logprob", mutates_args=())
def _linear_logprob_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    return_entropy: bool,
    chunk_size: int,
    vocab_chunk: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``vocab_chunk`` > 0: vocabulary chunks of that many head rows; 0: row chunks of ``chunk_size``.
    ``backend``: ``"triton"`` or ``"torch"``, the log-prob launchers to run."""
    targets, valid = guard_index(targets, weight.shape[0], "targets")
    impl, head = logprob_impl(backend, hidden.device), LMHead(weight, bias)
    if vocab_chunk:
        out, stats, entropy = _forward_vocab_chunks(hidden, weight, head, targets, 1.0 / temperature,
                                                    return_entropy, vocab_chunk, impl, backend)
    else:
        out, stats, entropy = _forward_row_chunks(hidden, head, targets, 1.0 / temperature, return_entropy,
                                                  chunk_size, impl)
    out, entropy = nan_where_invalid(valid, out, entropy)
    return out, stats, entropy


@_linear_logprob_op.register_fake
def _(hidden, weight, targets, bias, temperature, return_entropy, chunk_size, vocab_chunk, backend):
    return empty_logprob_outputs(hidden, hidden.shape[0], return_entropy)


def _gradient_buffers(hidden, weight, bias, vocab_chunk, need_hidden, need_weight, need_bias):
    """``(d hidden, d weight, d bias)`` to write into, each empty(0) when not needed: the ones a
    pass accumulates into are zeroed float32 (float64) buffers, the ones written once per chunk
    are in the input dtype."""
    acc = accumulation_dtype(hidden.dtype)

    def buffer(shape, like, accumulated):
        if accumulated:
            return torch.zeros(shape, dtype=acc, device=like.device)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    return (
        buffer(hidden.shape, hidden, bool(vocab_chunk)) if need_hidden else hidden.new_empty(0),
        buffer(weight.shape, weight, not vocab_chunk) if need_weight else weight.new_empty(0),
        buffer(weight.shape[:1], weight, not vocab_chunk) if need_bias else weight.new_empty(0),
    )


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
    vocab_chunk: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden.dtype)
    targets, valid = guard_index(targets, vocab, "targets")
    (grad_out,) = nan_where_invalid(valid, grad_out)  # an id out of range: NaN log-prob, NaN gradient
    grad_out = grad_out.contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
    need_bias = need_bias and bias is not None
    d_hidden, d_weight, d_bias = _gradient_buffers(hidden, weight, bias, vocab_chunk, need_hidden, need_weight,
                                                   need_bias)
    impl, head = logprob_impl(backend, hidden.device), LMHead(weight, bias)
    if vocab_chunk:
        targets = targets.to(torch.int64)
        # The GEMMs read d logits in the inputs' dtype: on CUDA the kernels write it so directly,
        # unless the bias gradient needs it in float32 first.
        in_place = not head.fp32_out_gemm or need_bias
        # Triton with a half-precision head: one kernel computes each chunk's logits and turns them
        # into d logits, without writing the float32 logits.
        fused = _fused_head(hidden, backend)
        for lo, hi in _vocab_chunks(vocab, vocab_chunk):
            if fused is not None:
                dlogits = hidden.new_empty(n, hi - lo, dtype=head.acc if in_place else head.dtype)
                fused.head_dlogits(hidden, weight[lo:hi], None if bias is None else bias[lo:hi], targets,
                                   grad_out, grad_entropy, stats, entropy, 1.0 / temperature, dlogits, target_offset=lo)
            else:
                logits = head.logits(hidden, lo, hi)
                dlogits = logits if in_place else torch.empty_like(logits, dtype=head.dtype)
                impl.logprob_backward(logits, None, True, targets - lo, grad_out, grad_entropy, stats, entropy,
                                      1.0 / temperature, dlogits)
            if need_bias:
                d_bias[lo:hi] = dlogits.sum(0, dtype=acc)
            dlogits = head.operand(dlogits)
            if need_hidden:
                head.accumulate(d_hidden, dlogits, head.weight[lo:hi])
            if need_weight:
                head.product(dlogits.T, hidden, d_weight[lo:hi])
        return d_hidden.to(hidden.dtype), d_weight, d_bias
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
        if need_bias:
            d_bias += dlogits.sum(0, dtype=acc)
        dlogits = head.operand(dlogits)
        if need_hidden:
            head.product(dlogits, head.weight, d_hidden[lo:hi])
        if need_weight:
            head.accumulate(d_weight, dlogits.T, h)
    return d_hidden, d_weight.to(weight.dtype), d_bias.to(weight.dtype)


@_linear_logprob_backward_op.register_fake
def _(grad_out, grad_entropy, hidden, weight, targets, bias, stats, entropy, temperature, chunk_size, vocab_chunk,
      need_hidden, need_weight, need_bias, backend):
    return (
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias and bias is not None else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, return_entropy, chunk_size, vocab_chunk, backend = inputs
    _, stats, entropy = output
    ctx.save_for_backward(hidden, weight, targets, bias, stats, entropy)
    ctx.temperature, ctx.return_entropy = temperature, return_entropy
    ctx.chunk_size, ctx.vocab_chunk, ctx.backend = chunk_size, vocab_chunk, backend


def _backward(ctx, grad_out, grad_stats, grad_entropy):
    hidden, weight, targets, bias, stats, entropy = ctx.saved_tensors
    if grad_out is None:
        grad_out = stats.new_zeros(stats.shape[0])
    if not ctx.return_entropy:
        grad_entropy = None
    need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
    d_hidden, d_weight, d_bias = torch.ops.daca.linear_logprob_backward(
        grad_out, grad_entropy, hidden, weight, targets, bias, stats, entropy, ctx.temperature,
        ctx.chunk_size, ctx.vocab_chunk, need_hidden, need_weight, need_bias, ctx.backend,
    )
    return (
        d_hidden if need_hidden else None,
        d_weight if need_weight else None,
        None,
        d_bias if need_bias else None,
        None,
        None,
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
    backend: str | None = None,
):
    """Log-probability of each target under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Holds the float32 logits of one chunk at a time. Without ``chunk_size``, CUDA inputs of more
    than 64 rows whose head is wider than one vocabulary chunk (``default_vocab_chunk``: about 2 %
    of V at LLaDA's head, at least 2048) go through the head a vocabulary chunk at a time (each
    head row read once per pass); otherwise rows go through the whole head ``chunk_size`` at a
    time (default: about N/32, at least 64 rows). See the module docstring.

    Args:
        hidden: float ``[N, H]``.
        weight: ``[V, H]``, the LM head (same dtype and device as ``hidden``).
        targets: int64/int32 ``[N]`` ids in ``[0, V)``.
        bias: ``[V]`` or None.
        temperature: Python float > 0.
        return_entropy: also return each row's entropy.
        chunk_size: rows per chunk (int > 0; takes rows through the whole head in chunks of this
            size on every device), or None for the default.
        backend: ``"triton"``, ``"torch"``, ``"reference"``, or None for ``DACA_BACKEND`` and
            then the device ([`daca_kernels.ops.dispatch`][daca_kernels.ops.dispatch]).

    Returns:
        float32 ``[N]`` (float64 for float64 inputs), or ``(logprob, entropy)``. Gradients flow to
        ``hidden``, ``weight`` and ``bias``, accumulated in float32 (float64) across chunks. A
        target outside ``[0, V)`` is a ValueError, except on CUDA (where the check would wait for
        the device): there it is never read and its log-prob, entropy and gradients are NaN.
    """
    check_tensor(targets, "targets", ndim=1, dtypes=INDEX_DTYPES)
    num_rows, _ = check_linear_head(hidden, weight, bias, targets=targets)
    check_shape(targets, "targets", (num_rows,), "[N] (from hidden)")
    temperature = check_positive_float(temperature, "temperature")
    if chunk_size is not None:
        check_int(chunk_size, "chunk_size", low=1)
    return linear_logprob_unchecked(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=return_entropy,
                           chunk_size=chunk_size, backend=backend)


def linear_logprob_unchecked(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                    temperature: float = 1.0, return_entropy: bool = False, chunk_size: int | None = None,
                    backend: str | None = None):
    """[`linear_logprob`][daca_kernels.ops.linear_logprob.linear_logprob] without its checks, for callers that checked the arguments (the
    estimators: their model's head and the ids they gather; ``temperature`` a Python float)."""
    vocab_chunk = plan_vocab_chunk(hidden, weight, chunk_size)
    chunk_size = chunk_rows(chunk_size, hidden.shape[0])
    return dispatch.run("linear_logprob", backend, hidden.device, _fused,
                        hidden, weight, targets, bias, temperature, return_entropy,
                        chunk_size=chunk_size, vocab_chunk=vocab_chunk)


def _fused(backend: str, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, temperature: float,
           return_entropy: bool, *, chunk_size: int, vocab_chunk: int):
    out, _, entropy = torch.ops.daca.linear_logprob(
        hidden, weight, targets, bias, temperature, return_entropy, chunk_size, vocab_chunk, backend
    )
    return (out, entropy) if return_entropy else out
