"""``confidence_delta``: the reduction behind the online Denoising Progress Scores (``daca_kernels.credit``).

A sampler keeps the previous step's confidences ``c_s`` of every masked position in a dense
``[B, L]`` buffer. After step s commits, the positions still masked (``U_s``) get new confidences
``c_{s+1}`` at step s + 1, and ``step_gain[:, s] = confidence_delta(c_{s+1}, c_s, U_s)``: the
per-row sum of ``c_{s+1}[j] - c_s[j]`` over ``U_s``. Only O(B * L) state, never ``[B, S, L]``.

The Triton kernel (``daca_kernels.kernels.dps``) does the reduction on CUDA (and under the
interpreter); the PyTorch path is a masked ``sum``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from daca_kernels.ops import dispatch
from daca_kernels.precision import accumulation_dtype
from daca_kernels.validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor


def _torch_confidence_delta(current: Tensor, previous: Tensor, still_masked: Tensor) -> Tensor:
    acc = accumulation_dtype(current.dtype)
    delta = current.to(acc) - previous.to(acc)
    return torch.where(still_masked, delta, 0.0).sum(dim=1)


@torch.library.custom_op("daca::confidence_delta", mutates_args=())
def _confidence_delta_op(current: Tensor, previous: Tensor, still_masked: Tensor, backend: str) -> Tensor:
    if backend == "triton":
        return dispatch.triton_module("dps", current.device).confidence_delta(current, previous, still_masked)
    return _torch_confidence_delta(current, previous, still_masked)


@_confidence_delta_op.register_fake
def _(current, previous, still_masked, backend):
    return current.new_empty(current.shape[0], dtype=accumulation_dtype(current.dtype))


def confidence_delta(current: Tensor, previous: Tensor, still_masked: Tensor, *, backend: str | None = None) -> Tensor:
    """``out[b] = sum_j still_masked[b, j] * (current[b, j] - previous[b, j])``.

    Args:
        current: float ``[B, L]``, the confidences of this step.
        previous: ``[B, L]``, same dtype, the confidences of the previous step.
        still_masked: bool ``[B, L]``, the positions to sum over. Entries of ``current`` and
            ``previous`` outside it are never read (they may be stale or NaN).
        backend: ``"triton"``, ``"torch"``, ``"reference"``, or None for ``DACA_BACKEND`` and
            then the device ([`daca_kernels.ops.dispatch`][daca_kernels.ops.dispatch]).

    Returns:
        float32 ``[B]`` (float64 for float64 inputs). No gradient flows.
    """
    check_tensor(current, "current", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(previous, "previous", ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(still_masked, "still_masked", ndim=2, dtypes=(torch.bool,))
    check_same_device(current, "current", previous=previous, still_masked=still_masked)
    if previous.dtype != current.dtype:
        raise TypeError(f"previous must have the dtype of current ({current.dtype}), got {previous.dtype}")
    check_shape(previous, "previous", current.shape, "[B, L] (from current)")
    check_shape(still_masked, "still_masked", current.shape, "[B, L] (from current)")
    return confidence_delta_unchecked(current, previous, still_masked, backend=backend)


def confidence_delta_unchecked(current: Tensor, previous: Tensor, still_masked: Tensor, *,
                               backend: str | None = None) -> Tensor:
    """[`confidence_delta`][daca_kernels.ops.confidence_delta.confidence_delta] without its checks, for
    callers that built the arguments (the sampler's own confidences and masks)."""
    return dispatch.run("confidence_delta", backend, current.device, _fused, current, previous, still_masked)


def _fused(backend: str, current: Tensor, previous: Tensor, still_masked: Tensor) -> Tensor:
    return torch.ops.daca.confidence_delta(current.detach(), previous.detach(), still_masked, backend)
