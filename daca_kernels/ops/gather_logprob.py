"""``gather_logprob`` and ``stratified_gather_logprob``: log-probabilities of chosen targets.

Layers: the Triton launchers (``daca_kernels.kernels.logprob``) or the chunked PyTorch path
(``chunked_logprob``) do the work; the custom ops below validate index ranges, run the launchers
of the backend they are given and carry the autograd formula; the public functions check shapes
and dtypes, pick the backend ([`daca_kernels.ops.dispatch.run`][daca_kernels.ops.dispatch.run]) and shape the result.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels import validation
from daca_kernels.ops import dispatch
from daca_kernels.ops.shared import empty_logprob_outputs, logprob_impl
from daca_kernels.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_positive_float,
    check_same_device,
    check_tensor,
    guard_index,
    nan_where_invalid,
)


def _num_rows(logits: Tensor) -> int:
    return logits.numel() // logits.shape[-1] if logits.shape[-1] else 0


@torch.library.custom_op("daca::gather_logprob", mutates_args=())
def _gather_logprob_op(
    logits: Tensor, targets: Tensor, rows: Tensor | None, temperature: float, return_entropy: bool,
    inplace_backward: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``backend``: ``"triton"`` or ``"torch"``, the launchers to run."""
    impl = logprob_impl(backend, logits.device)
    if backend == "triton" and rows is None and logits.device.type in validation.GUARDED_ON_DEVICE:
        # One row per target, ranges guarded on the device: the kernel itself writes NaN as the
        # log-prob and entropy of a target outside [0, V) (and reads within the row), so nothing
        # is launched to guard the ids.
        return impl.logprob_forward(logits, None, targets, 1.0 / temperature, return_entropy)
    targets, rows, valid = _guarded(logits, targets, rows)
    out, stats, entropy = impl.logprob_forward(logits, rows, targets, 1.0 / temperature, return_entropy)
    out, entropy = nan_where_invalid(valid, out, entropy)
    return out, stats, entropy


def _guarded(logits: Tensor, targets: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Targets and rows made safe to address with ([`guard_index`][daca_kernels.validation.guard_index]), and the mask of the targets
    whose ids were both in range (None where ranges are checked on the host instead)."""
    targets, valid = guard_index(targets, logits.shape[-1], "targets")
    if rows is not None:
        rows, rows_valid = guard_index(rows, _num_rows(logits), "rows")
        valid = rows_valid if valid is None else valid & rows_valid
    return targets, rows, valid


@_gather_logprob_op.register_fake
def _(logits, targets, rows, temperature, return_entropy, inplace_backward, backend):
    return empty_logprob_outputs(logits, targets.shape[0], return_entropy)


@torch.library.custom_op("daca::gather_logprob_backward", mutates_args=())
def _gather_logprob_backward_op(
    grad_out: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    targets: Tensor,
    rows: Tensor | None,
    stats: Tensor,
    entropy: Tensor,
    temperature: float,
    backend: str,
) -> Tensor:
    dlogits = logits.new_empty(_num_rows(logits), logits.shape[-1])
    _write_dlogits(grad_out, grad_entropy, logits, targets, rows, stats, entropy, temperature, dlogits, backend)
    return dlogits.view(logits.shape)


@_gather_logprob_backward_op.register_fake
def _(grad_out, grad_entropy, logits, targets, rows, stats, entropy, temperature, backend):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("daca::gather_logprob_backward_", mutates_args=("logits",))
def _gather_logprob_backward_inplace_op(
    grad_out: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    targets: Tensor,
    stats: Tensor,
    entropy: Tensor,
    temperature: float,
    backend: str,
) -> None:
    """``d logits`` written over ``logits`` itself (contiguous, one target per row): each element is
    read before it is written, and no ``[R, V]`` buffer is allocated."""
    _write_dlogits(grad_out, grad_entropy, logits, targets, None, stats, entropy, temperature,
                   logits.view(_num_rows(logits), logits.shape[-1]), backend)


@_gather_logprob_backward_inplace_op.register_fake
def _(grad_out, grad_entropy, logits, targets, stats, entropy, temperature, backend):
    return None


def _write_dlogits(grad_out: Tensor, grad_entropy: Tensor | None, logits: Tensor, targets: Tensor,
                   rows: Tensor | None, stats: Tensor, entropy: Tensor, temperature: float, dlogits: Tensor,
                   backend: str) -> None:
    """``d logits`` of every row into ``dlogits`` (``[R, V]``; rows no target selects get 0)."""
    num_rows = _num_rows(logits)
    targets, rows, valid = _guarded(logits, targets, rows)
    (grad_out,) = nan_where_invalid(valid, grad_out)  # an id out of range: NaN log-prob, NaN gradient
    unique = True
    if rows is not None and valid is not None:
        # Without a host read neither repeats nor unselected rows are known: every row starts at 0
        # and repeated rows are grouped on the device.
        dlogits.zero_()
        unique = False
    elif rows is not None:
        selected = torch.unique(rows)
        unique = selected.shape[0] == rows.shape[0]
        if selected.shape[0] < num_rows:
            unselected = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
            unselected[selected] = False
            dlogits[unselected] = 0
    logprob_impl(backend, logits.device).logprob_backward(
        logits, rows, unique, targets, grad_out.contiguous(),
        None if grad_entropy is None else grad_entropy.contiguous(),
        stats, entropy, 1.0 / temperature, dlogits,
    )


def _setup_context(ctx, inputs, output):
    logits, targets, rows, temperature, return_entropy, inplace_backward, backend = inputs
    _, stats, entropy = output
    ctx.save_for_backward(logits, targets, rows, stats, entropy)
    ctx.temperature = temperature
    ctx.return_entropy = return_entropy
    ctx.inplace_backward = inplace_backward
    ctx.backend = backend


def _backward(ctx, grad_out, grad_stats, grad_entropy):
    logits, targets, rows, stats, entropy = ctx.saved_tensors
    if grad_out is None:
        grad_out = stats.new_zeros(stats.shape[0])
    if not ctx.return_entropy:
        grad_entropy = None
    if ctx.inplace_backward:
        torch.ops.daca.gather_logprob_backward_(grad_out, grad_entropy, logits, targets, stats, entropy,
                                                ctx.temperature, ctx.backend)
        return logits, None, None, None, None, None, None
    dlogits = torch.ops.daca.gather_logprob_backward(
        grad_out, grad_entropy, logits, targets, rows, stats, entropy, ctx.temperature, ctx.backend
    )
    return dlogits, None, None, None, None, None, None


_gather_logprob_op.register_autograd(_backward, setup_context=_setup_context)


def gather_logprob(
    logits: Tensor,
    targets: Tensor,
    *,
    rows: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str | None = None,
):
    """Log-probability of each target under the softmax of its logits row.

    ``out[n] = log_softmax(logits[rows[n]] / temperature)[targets[n]]``.

    Args:
        logits: float16/bfloat16/float32/float64 ``[..., V]``; leading dims are flattened to ``R``
            rows (any strides; only the selected rows are read).
        targets: int64/int32 ``[N]`` ids in ``[0, V)``. With ``rows=None`` it may also have the
            shape ``logits.shape[:-1]``, and the result then has that shape.
        rows: int64/int32 ``[N]`` in ``[0, R)``: the logits row each target is read from (repeats
            allowed). Default: row n for target n (then ``N == R``).
        temperature: Python float > 0 dividing the logits.
        return_entropy: also return the entropy of each selected row's distribution.
        inplace_backward: the backward writes ``d logits`` over ``logits`` itself instead of a new
            ``[R, V]`` tensor (saves one logits-sized allocation; ``logits`` holds its gradient
            afterwards, so nothing may read it later). Needs contiguous ``logits`` and
            ``rows=None``.
        backend: ``"triton"``, ``"torch"``, ``"reference"``, or None for ``DACA_BACKEND`` and
            then the device ([`daca_kernels.ops.dispatch`][daca_kernels.ops.dispatch]).

    Returns:
        float32 ``[N]`` (float64 for float64 logits), or ``(logprob, entropy)``. The gradient
        flows to ``logits`` only; unselected rows get zero gradient. A NaN anywhere in a
        selected row gives NaN for that row's outputs.

    Ids out of range (``targets`` outside ``[0, V)``, ``rows`` outside ``[0, R)``): a ValueError
    naming the argument, except on CUDA, where the check would wait for the device on every
    call: there they are never read out of bounds (addressed as 0), and the target's log-prob,
    entropy and gradient are NaN.
    """
    check_tensor(logits, "logits", min_ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor(targets, "targets", dtypes=INDEX_DTYPES)
    check_same_device(logits, "logits", targets=targets, rows=rows)
    temperature = check_positive_float(temperature, "temperature")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty last (vocabulary) dimension")
    out_shape = None
    if rows is None:
        if targets.dim() != 1 and tuple(targets.shape) == tuple(logits.shape[:-1]):
            out_shape = targets.shape
            targets = targets.reshape(-1)
        if targets.dim() != 1 or targets.shape[0] != _num_rows(logits):
            raise ValueError(
                f"targets must have shape [R] = [{_num_rows(logits)}] (one per logits row) or "
                f"logits.shape[:-1] = {tuple(logits.shape[:-1])} when rows is None, "
                f"got {tuple(targets.shape)}"
            )
    else:
        check_tensor(rows, "rows", ndim=1, dtypes=INDEX_DTYPES)
        check_tensor(targets, "targets", ndim=1)
        if rows.shape != targets.shape:
            raise ValueError(f"rows must have the shape of targets {tuple(targets.shape)}, got {tuple(rows.shape)}")

    check_bool(inplace_backward, "inplace_backward")
    if inplace_backward and (rows is not None or not logits.is_contiguous()):
        raise ValueError("inplace_backward needs contiguous logits and rows=None (one target per row): the "
                         "gradient is written over logits")

    out, entropy = dispatch.run("gather_logprob", backend, logits.device, _fused,
                                logits, targets, rows, temperature, return_entropy, inplace_backward)
    if out_shape is not None:
        out, entropy = out.view(out_shape), entropy.view(out_shape) if return_entropy else None
    return (out, entropy) if return_entropy else out


def _fused(backend: str, logits: Tensor, targets: Tensor, rows: Tensor | None, temperature: float,
           return_entropy: bool, inplace_backward: bool) -> tuple[Tensor, Tensor | None]:
    out, _, entropy = torch.ops.daca.gather_logprob(logits, targets, rows, temperature, return_entropy,
                                                    inplace_backward, backend)
    return out, entropy if return_entropy else None


def stratified_gather_logprob(
    logits: Tensor,
    targets: Tensor,
    strata: Tensor,
    *,
    shift: bool = False,
    temperature: float = 1.0,
    backend: str | None = None,
) -> Tensor:
    """Per-stratum gather over K masked copies.

    Args:
        logits: ``[K, B, L, V]``: copy k is the model's output on the input with stratum k masked.
        targets: int ``[B, L]`` token ids.
        strata: int ``[B, L]``: the stratum (``0..K-1``) of each position, -1 where it does not count.
        shift: Dream / DiffuCoder convention: the logit at ``i - 1`` predicts token ``i`` (a
            position 0 with a stratum is then an error).
        temperature: Python float > 0.
        backend: as in [`gather_logprob`][daca_kernels.ops.gather_logprob.gather_logprob].

    Returns:
        float32 ``[B, L]``: ``log_softmax(logits[strata[b, i], b, i'])[targets[b, i]]`` with
        ``i' = i - shift``, and 0 where ``strata < 0``. Only the selected rows are read.
    """
    check_tensor(logits, "logits", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(targets, "targets", ndim=2, dtypes=INDEX_DTYPES)
    check_tensor(strata, "strata", ndim=2, dtypes=INDEX_DTYPES + (torch.int16, torch.int8))
    check_same_device(logits, "logits", targets=targets, strata=strata)
    num_strata, batch, length, _ = logits.shape
    for name, value in (("targets", targets), ("strata", strata)):
        if tuple(value.shape) != (batch, length):
            raise ValueError(f"{name} must have shape [B, L] = {(batch, length)} (from logits), got {tuple(value.shape)}")
    if strata.numel() and bool(((strata < -1) | (strata >= num_strata)).any()):
        raise ValueError(f"strata must lie in [-1, {num_strata}) (-1 or a stratum of the K = {num_strata} copies)")
    if shift and bool((strata[:, 0] >= 0).any()):
        raise ValueError("strata[:, 0] must be -1 with shift=True: no logit precedes position 0")
    b, i = (strata >= 0).nonzero(as_tuple=True)
    k = strata[b, i].long()
    rows = (k * batch + b) * length + (i - 1 if shift else i)
    values = gather_logprob(logits, targets[b, i], rows=rows, temperature=temperature, backend=backend)
    out = torch.zeros(batch, length, dtype=values.dtype, device=logits.device)
    out[b, i] = values
    return out
