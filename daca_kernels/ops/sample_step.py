"""``sample_step`` and ``sample_step_linear``: one denoising step of a masked diffusion sampler.

For every given row (a still-masked position) the candidate token is the Gumbel-max sample at a
temperature (the argmax at 0) and its confidence is the softmax probability of that candidate under
the raw logits, without temperature or noise: LLaDA's low-confidence remasking semantics (the
sampler, [`daca_kernels.rollout`][daca_kernels.rollout], commits the most confident candidates). The mask id is never
a candidate and is left out of the confidence's softmax. One pass over V; the noise of ``(seed,
step, row_id, token)`` comes from the project's counter hash ([`daca_kernels.hashing.gumbel_hash`][daca_kernels.hashing.gumbel_hash]),
so results depend only on those numbers, not on batching; the PyTorch path and the Triton
interpreter give the same bits, and the CUDA kernel's hardware logarithms move the noise by at
most 5.5e-6 nats ([`daca_kernels.kernels.gumbel`][daca_kernels.kernels.gumbel]), so its candidates differ only at such
near-ties.

Layers: the Triton launcher (``daca_kernels.kernels.sampling``) or the chunked PyTorch path
(``chunked_sampling``) do the work; the custom ops below check index ranges and run the launcher of
the backend they are given; the public functions check shapes and dtypes and pick the backend
([`daca_kernels.ops.dispatch.run`][daca_kernels.ops.dispatch.run]). Sampling has no gradient.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from daca_kernels.hashing import STREAM_GUMBEL, seed32
from daca_kernels.ops import chunked_sampling, dispatch
from daca_kernels.ops.shared import LMHead, check_chunk_rows, check_linear_head, chunk_rows, empty_sampling_outputs
from daca_kernels.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    WORD_LIMIT,
    check_int,
    check_nonnegative_float,
    check_same_device,
    check_shape,
    check_tensor,
    guard_index,
    nan_where_invalid,
)


def sampling_impl(backend: str, device: torch.device) -> ModuleType:
    """The module providing ``sample_step_forward`` for the resolved ``backend`` (``"triton"`` or
    ``"torch"``) on ``device``."""
    if backend == "triton":
        return dispatch.triton_module("sampling", device)
    return chunked_sampling


def _row_ids_or_identity(row_ids: Tensor | None, n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device) if row_ids is None else row_ids.to(torch.int64).contiguous()


FLOAT32_TINY = torch.finfo(torch.float32).tiny


def score_scales(temperature: float) -> tuple[float, float]:
    """``(logit_scale, noise_scale)`` with ``argmax(x * logit_scale + g * noise_scale)`` equal to
    ``argmax(x / temperature + g)``; ``noise_scale == 0`` means the plain argmax.

    Scaling by a positive number keeps the argmax, so below 1 the noise is scaled by T instead of
    the logits by 1/T: ``1/T`` of a tiny valid temperature overflows float32 and would tie every
    logit at infinity, and neither factor ever exceeds 1. Above about ``1e38`` the logit scale stays
    at float32's smallest normal number instead of rounding to 0, where a ``-inf`` logit (the mask
    id's) would score ``-inf * 0 = nan`` and could win.
    """
    if temperature == 0:
        return 1.0, 0.0
    return (1.0, temperature) if temperature < 1 else (max(1.0 / temperature, FLOAT32_TINY), 1.0)


@torch.library.custom_op("daca::sample_step", mutates_args=())
def _sample_step_op(
    logits: Tensor,
    row_ids: Tensor | None,
    temperature: float,
    seed: int,
    step: int,
    mask_id: int,
    return_entropy: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    row_ids, valid = _guarded_row_ids(row_ids)
    return _invalid_rows_as_nan(valid, *sampling_impl(backend, logits.device).sample_step_forward(
        logits, _row_ids_or_identity(row_ids, logits.shape[0], logits.device),
        *score_scales(temperature), seed, step, STREAM_GUMBEL, mask_id, return_entropy,
    ))


def _guarded_row_ids(row_ids: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Row ids made 32-bit ([`guard_index`][daca_kernels.validation.guard_index]: a ValueError where checked on the host)."""
    return (None, None) if row_ids is None else guard_index(row_ids, WORD_LIMIT, "row_ids")


def _invalid_rows_as_nan(valid: Tensor | None, tokens: Tensor, confidence: Tensor, entropy: Tensor):
    """A row whose id was out of range gets token -1 and NaN confidence and entropy."""
    if valid is None:
        return tokens, confidence, entropy
    return (torch.where(valid, tokens, torch.full_like(tokens, -1)),
            *nan_where_invalid(valid, confidence, entropy))


@_sample_step_op.register_fake
def _(logits, row_ids, temperature, seed, step, mask_id, return_entropy, backend):
    return empty_sampling_outputs(logits, logits.shape[0], return_entropy)


@torch.library.custom_op("daca::sample_step_linear", mutates_args=())
def _sample_step_linear_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    row_ids: Tensor | None,
    temperature: float,
    seed: int,
    step: int,
    mask_id: int,
    return_entropy: bool,
    chunk_size: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    row_ids, valid = _guarded_row_ids(row_ids)
    n = hidden.shape[0]
    tokens, confidence, entropy = empty_sampling_outputs(hidden, n, return_entropy)
    ids = _row_ids_or_identity(row_ids, n, hidden.device)
    impl, head = sampling_impl(backend, hidden.device), LMHead(weight, bias)
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        t, c, e = impl.sample_step_forward(
            head.logits(hidden[lo:hi]), ids[lo:hi], *score_scales(temperature), seed, step,
            STREAM_GUMBEL, mask_id, return_entropy,
        )
        tokens[lo:hi], confidence[lo:hi] = t, c
        if return_entropy:
            entropy[lo:hi] = e
    return _invalid_rows_as_nan(valid, tokens, confidence, entropy)


@_sample_step_linear_op.register_fake
def _(hidden, weight, bias, row_ids, temperature, seed, step, mask_id, return_entropy, chunk_size, backend):
    return empty_sampling_outputs(hidden, hidden.shape[0], return_entropy)


def _check_sampling_args(temperature, seed, step, mask_id, vocab: int) -> float:
    """The validated temperature; ``seed`` (folding it), ``step`` and ``mask_id`` are only checked."""
    temperature = check_nonnegative_float(temperature, "temperature")
    seed32(seed)
    check_int(step, "step", low=0, high=WORD_LIMIT)
    if mask_id is not None:
        check_int(mask_id, "mask_id", low=0, high=vocab)
        if vocab < 2:
            raise ValueError("mask_id leaves no candidate: the vocabulary must have at least 2 tokens")
    return temperature


def _check_row_ids(row_ids, rows: Tensor, rows_name: str) -> None:
    if row_ids is None:
        return
    check_tensor(row_ids, "row_ids", ndim=1, dtypes=INDEX_DTYPES)
    check_same_device(rows, rows_name, row_ids=row_ids)
    check_shape(row_ids, "row_ids", (rows.shape[0],), f"[N] (one per row of {rows_name})")


def sample_step(
    logits: Tensor,
    *,
    temperature: float,
    seed: int,
    step: int,
    row_ids: Tensor | None = None,
    mask_id: int | None = None,
    return_entropy: bool = False,
    backend: str | None = None,
):
    """One denoising step over the rows of ``logits``: Gumbel-max candidate and its confidence.

    ``candidate[n] = argmax_v(logits[n, v] / temperature + g(seed, step, row_ids[n], v))`` with
    Gumbel noise ``g = -log(-log(u))`` from the counter hash (the plain argmax when
    ``temperature == 0``; the lowest id wins a tie; on CUDA ``g`` is within 5.5e-6 of that) and
    ``confidence[n] = softmax(logits[n])[candidate[n]]`` without temperature or noise.

    Args:
        logits: float16/bfloat16/float32/float64 ``[N, V]`` (any strides), one row per still-masked
            position.
        temperature: Python float >= 0.
        seed: int in ``[0, 2**64)`` (folded to 32 bits).
        step: int in ``[0, 2**32)``, the denoising step (part of the noise's identity).
        row_ids: int64/int32 ``[N]`` in ``[0, 2**32)``: the noise identity of each row (default
            ``arange(N)``), e.g. ``b * L + position`` so that a position's noise does not depend on
            which other positions are still masked.
        mask_id: an id in ``[0, V)`` that is never a candidate and whose logit counts as ``-inf``
            in the confidence's softmax too; None for none.
        return_entropy: also return the entropy of ``softmax(logits)`` (mask id excluded).
        backend: ``"triton"``, ``"torch"``, ``"reference"``, or None for ``DACA_BACKEND`` and
            then the device ([`daca_kernels.ops.dispatch`][daca_kernels.ops.dispatch]).

    Returns:
        ``(candidate int64 [N], confidence float32 [N])`` (float64 for float64 logits), plus the
        entropy when ``return_entropy``. A row with a NaN logit gets a NaN confidence (and an
        unspecified candidate). No gradient flows. A ``row_ids`` entry outside ``[0, 2**32)`` is a
        ValueError, except on CUDA (where the check would wait for the device): there its row gets
        candidate -1 and NaN confidence and entropy.
    """
    check_tensor(logits, "logits", ndim=2, dtypes=FLOAT_DTYPES)
    vocab = logits.shape[1]
    if vocab == 0:
        raise ValueError("logits must have a non-empty last (vocabulary) dimension")
    temperature = _check_sampling_args(temperature, seed, step, mask_id, vocab)
    _check_row_ids(row_ids, logits, "logits")
    return sample_step_unchecked(logits, temperature=temperature, seed=seed, step=step, row_ids=row_ids, mask_id=mask_id,
                                 return_entropy=return_entropy, backend=backend)


def sample_step_unchecked(logits: Tensor, *, temperature: float, seed: int, step: int, row_ids: Tensor | None = None,
                          mask_id: int | None = None, return_entropy: bool = False, backend: str | None = None):
    """[`sample_step`][daca_kernels.ops.sample_step.sample_step] without its checks, for callers that
    checked the arguments (the sampler, once per call: its own logits and row ids, ``temperature`` a
    Python float)."""
    return dispatch.run("sample_step", backend, logits.device, _fused_sample_step,
                        logits, temperature, seed, step, row_ids, mask_id, return_entropy)


def _fused_sample_step(backend: str, logits: Tensor, temperature: float, seed: int, step: int, row_ids: Tensor | None,
                       mask_id: int | None, return_entropy: bool):
    tokens, confidence, entropy = torch.ops.daca.sample_step(
        logits.detach(), row_ids, temperature, seed32(seed), step, -1 if mask_id is None else mask_id, return_entropy,
        backend,
    )
    return (tokens, confidence, entropy) if return_entropy else (tokens, confidence)


def sample_step_linear(
    hidden: Tensor,
    weight: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float,
    seed: int,
    step: int,
    row_ids: Tensor | None = None,
    mask_id: int | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    backend: str | None = None,
):
    """[`sample_step`][daca_kernels.ops.sample_step.sample_step] of ``hidden @ weight.T + bias`` without ``[N, V]`` logits for all rows.

    Rows go through the head ``chunk_size`` at a time (default: about N/32, at least 64 rows); a
    chunk's logits are formed in float32 (float64 for float64 inputs) and consumed at once.

    Args:
        hidden: float ``[N, H]``: the hidden states that predict the still-masked positions.
        weight: ``[V, H]``, the LM head (same dtype and device as ``hidden``).
        bias: ``[V]`` or None.
        temperature: as in [`sample_step`][daca_kernels.ops.sample_step.sample_step].
        seed: as there.
        step: as there.
        row_ids: as there.
        mask_id: as there.
        return_entropy: as there.
        backend: as there.
        chunk_size: rows per chunk (int > 0), or None for the default.

    Returns:
        What [`sample_step`][daca_kernels.ops.sample_step.sample_step] returns.
    """
    n, vocab = check_linear_head(hidden, weight, bias)
    temperature = _check_sampling_args(temperature, seed, step, mask_id, vocab)
    _check_row_ids(row_ids, hidden, "hidden")
    return sample_step_linear_unchecked(hidden, weight, bias=bias, temperature=temperature, seed=seed, step=step,
                                        row_ids=row_ids, mask_id=mask_id, return_entropy=return_entropy,
                                        chunk_size=check_chunk_rows(chunk_size, n), backend=backend)


def sample_step_linear_unchecked(hidden: Tensor, weight: Tensor, *, bias: Tensor | None = None, temperature: float,
                                 seed: int, step: int, row_ids: Tensor | None = None, mask_id: int | None = None,
                                 return_entropy: bool = False, chunk_size: int | None = None,
                                 backend: str | None = None):
    """[`sample_step_linear`][daca_kernels.ops.sample_step.sample_step_linear] without its checks, for
    callers that checked the arguments (the sampler, once per call: its model's head, its own row
    ids, ``temperature`` a Python float)."""
    chunk_size = chunk_rows(chunk_size, hidden.shape[0])
    return dispatch.run("sample_step_linear", backend, hidden.device, _fused_sample_step_linear,
                        hidden, weight, bias, temperature, seed, step, row_ids, mask_id, return_entropy,
                        chunk_size=chunk_size)


def _fused_sample_step_linear(backend: str, hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                              seed: int, step: int, row_ids: Tensor | None, mask_id: int | None, return_entropy: bool,
                              *, chunk_size: int):
    tokens, confidence, entropy = torch.ops.daca.sample_step_linear(
        hidden.detach(), weight.detach(), None if bias is None else bias.detach(), row_ids,
        temperature, seed32(seed), step, -1 if mask_id is None else mask_id, return_entropy, chunk_size, backend,
    )
    return (tokens, confidence, entropy) if return_entropy else (tokens, confidence)
