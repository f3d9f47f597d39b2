"""The argument checks of the package (ops, estimators, objectives, trainer). Every error starts with
the offending argument's name: TypeError for a wrong type or dtype, ValueError for a wrong shape,
value or device.

A public entry point checks its arguments once and calls unchecked internals (CONTRIBUTING.md,
"Checks"). Shape, dtype and device checks are static (safe under ``torch.compile``). Checks that
read tensor values (index ranges, subsets of masks) run only where the read is free of a device
synchronisation ([`reads_values`][daca_kernels.validation.reads_values]); on CUDA the callers guard on the device instead and give NaN
where the check would have raised ([`guard_index`][daca_kernels.validation.guard_index]). Index-range checks of the ops run inside
the registered custom ops, where they execute eagerly.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)
# Counter-hash words are 32-bit: row ids, steps and row indices must stay below this.
WORD_LIMIT = 1 << 32


def check_tensor(
    value,
    name: str,
    *,
    ndim: int | None = None,
    min_ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(value.shape)}")
    return value


def check_same_device(reference: torch.Tensor, reference_name: str, **others: torch.Tensor | None) -> None:
    for name, other in others.items():
        if other is not None and other.device != reference.device:
            raise ValueError(f"{name} is on {other.device} but {reference_name} is on {reference.device}")


def check_shape(value: torch.Tensor, name: str, shape: Sequence[int], described_as: str) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {described_as} = {tuple(shape)}, got {tuple(value.shape)}")


def check_float(
    value,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> float:
    """A finite Python number (not a tensor, not a bool) in the given range, returned as float."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python float, not a tensor (use {name}.item())")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    below = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    above = maximum is not None and (value >= maximum if exclusive_maximum else value > maximum)
    if not math.isfinite(value) or below or above:
        raise ValueError(f"{name} must be a finite number{_range_text(minimum, maximum, exclusive_minimum, exclusive_maximum)}, "
                         f"got {value}")
    return value


def _range_text(minimum: float | None, maximum: float | None, exclusive_minimum: bool, exclusive_maximum: bool) -> str:
    """`` > 0``, `` <= 1``, `` in [0, 1)``, or nothing for an unbounded range."""
    if minimum is not None and maximum is not None:
        low, high = ("(" if exclusive_minimum else "[") + f"{minimum:g}", f"{maximum:g}" + (")" if exclusive_maximum else "]")
        return f" in {low}, {high}"
    if minimum is not None:
        return f" {'>' if exclusive_minimum else '>='} {minimum:g}"
    if maximum is not None:
        return f" {'<' if exclusive_maximum else '<='} {maximum:g}"
    return ""


def check_positive_float(value, name: str) -> float:
    """A finite Python float > 0 (a temperature, a scale)."""
    return check_float(value, name, minimum=0.0, exclusive_minimum=True)


def check_nonnegative_float(value, name: str) -> float:
    """A finite Python float >= 0 (a temperature where 0 means greedy)."""
    return check_float(value, name, minimum=0.0)


def check_probability(value, name: str) -> float:
    """A Python float in ``[0, 1]``."""
    return check_float(value, name, minimum=0.0, maximum=1.0)


def check_float_tensor(
    value, name: str, shape: Sequence[int], described_as: str, device_of: tuple[torch.Tensor, str]
) -> torch.Tensor:
    """A floating tensor of exactly ``shape`` on the device of ``device_of = (tensor, its name)``."""
    check_tensor(value, name, dtypes=FLOAT_DTYPES)
    check_shape(value, name, shape, described_as)
    check_same_device(device_of[0], device_of[1], **{name: value})
    return value


def check_bool_tensor(
    value, name: str, shape: Sequence[int], described_as: str, device_of: tuple[torch.Tensor, str]
) -> torch.Tensor:
    """A bool tensor of exactly ``shape`` on the device of ``device_of = (tensor, its name)``."""
    check_tensor(value, name, dtypes=(torch.bool,))
    check_shape(value, name, shape, described_as)
    check_same_device(device_of[0], device_of[1], **{name: value})
    return value


def check_index_range(index: torch.Tensor, upper: int, name: str) -> None:
    """Raise ValueError unless every entry of ``index`` lies in ``[0, upper)``."""
    if index.numel() == 0:
        return
    # An upper bound past the dtype's range would wrap in the comparison; every entry is below it.
    bad = index < 0
    if upper <= torch.iinfo(index.dtype).max:
        bad |= index >= upper
    if bool(bad.any()):
        first = tuple(bad.nonzero()[0].tolist())
        where = ", ".join(str(i) for i in first)
        raise ValueError(f"{name} must lie in [0, {upper}); {name}[{where}] = {int(index[first])}")


# Device types whose index ranges are guarded on the device instead of checked on the host: a host
# check there waits for the device (a synchronisation on every call).
GUARDED_ON_DEVICE = ("cuda",)


def reads_values(tensor: torch.Tensor) -> bool:
    """Whether checks that read ``tensor``'s values run: not on a device type of
    [`GUARDED_ON_DEVICE`][daca_kernels.validation.GUARDED_ON_DEVICE], where each read is a device-to-host synchronisation; there the caller
    guards on the device instead (NaN results where the check would have raised)."""
    return tensor.device.type not in GUARDED_ON_DEVICE


def check_not_nan(values: torch.Tensor, message: str) -> None:
    """A ValueError with ``message`` when ``values`` holds a NaN, where checks read values; on a device
    type of [`GUARDED_ON_DEVICE`][daca_kernels.validation.GUARDED_ON_DEVICE] the NaN stays in the result
    (visible there, not a synchronisation per call)."""
    if reads_values(values) and bool(torch.isnan(values).any()):
        raise ValueError(message)


def guard_index(index: torch.Tensor, upper: int, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(index, valid)``: an out-of-range id never reaches an address computation and never yields a
    silent number, without a device-to-host synchronisation where that would cost one.

    On a device type of [`GUARDED_ON_DEVICE`][daca_kernels.validation.GUARDED_ON_DEVICE]: ``index`` with every entry outside ``[0, upper)``
    replaced by 0, and the bool mask of the entries that were in range; callers turn the outputs of
    the others into NaN. Elsewhere: [`check_index_range`][daca_kernels.validation.check_index_range] (a ValueError naming ``name``) and
    ``(index, None)``."""
    if reads_values(index):
        check_index_range(index, upper, name)
        return index, None
    valid = index >= 0
    if upper <= torch.iinfo(index.dtype).max:
        valid &= index < upper
    return torch.where(valid, index, torch.zeros_like(index)), valid


def nan_where_invalid(valid: torch.Tensor | None, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``values`` (each ``[N]``, or empty for an output not computed) with NaN where ``valid``
    ([`guard_index`][daca_kernels.validation.guard_index]'s mask) is False; unchanged when ``valid`` is None."""
    if valid is None:
        return values
    return tuple(v if v.numel() == 0 else torch.where(valid, v, torch.full_like(v, float("nan"))) for v in values)


@torch.library.custom_op("daca::checked_index", mutates_args=())
def checked_index(index: torch.Tensor, upper: int, name: str) -> torch.Tensor:
    """A copy of ``index`` after [`check_index_range`][daca_kernels.validation.check_index_range], for paths that run no custom op of
    their own (the ``reference`` backend): as an opaque op the check runs eagerly, so
    ``torch.compile(fullgraph=True)`` traces the caller without a data-dependent branch."""
    check_index_range(index, upper, name)
    return index.clone()


@checked_index.register_fake
def _(index, upper, name):
    return torch.empty_like(index)


def check_disjoint_prompt(prompt: torch.Tensor, maskable: torch.Tensor, maskable_name: str) -> None:
    """The rule of every mask function that takes a ``prompt`` (the positions eligible for d1's
    prompt masking): it lies outside the positions the function masks on its own (``maskable_name``:
    ``maskable`` or ``completion_mask``), whose masks already cover them. Both bool ``[B, L]``, shapes
    and devices already checked; a ValueError naming ``prompt`` and the first shared position
    otherwise (reads the data)."""
    both = prompt & maskable
    if bool(both.any()):
        where = ", ".join(str(v) for v in both.nonzero()[0].tolist())
        raise ValueError(f"prompt must not overlap {maskable_name}: prompt[{where}] and {maskable_name}[{where}] are "
                         f"both True (prompt masking draws among the positions outside {maskable_name}, which has "
                         "masks of its own)")


def check_sequence_length(length: int, max_length: int | None, name: str, described_as: str) -> None:
    """A model input of ``length`` positions must fit the model's ``max_length`` (the
    [`daca_kernels.MaskedLM`][daca_kernels.models.masked_lm.MaskedLM] attribute; None: no limit): a ValueError naming ``name``, with the
    length ``described_as`` (e.g. ``"L"``), otherwise."""
    if max_length is not None and length > max_length:
        raise ValueError(f"{name}: {described_as} = {length} positions, more than the model accepts "
                         f"(lm.max_length = {max_length}, its position limit)")


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int, mask_id: int) -> None:
    """A tokenizer of ``tokenizer_size`` ids (``len(tokenizer)``, added tokens included) drives a model
    whose head scores ``vocab_size`` ids: every id it can produce must be one the model embeds (a
    smaller tokenizer is fine: checkpoints pad their vocabulary), and the model's ``mask_id`` must be
    one it can represent. A ValueError naming ``processing_class`` or ``mask_token_id`` otherwise."""
    if tokenizer_size > vocab_size:
        raise ValueError(f"processing_class: the tokenizer has {tokenizer_size} ids (len(processing_class)) but the "
                         f"model's head scores {vocab_size}: a prompt id >= {vocab_size} would index outside the "
                         "model's embeddings; use the model's own tokenizer")
    if not 0 <= mask_id < tokenizer_size:
        raise ValueError(f"mask_token_id: the mask id {mask_id} lies outside the tokenizer's {tokenizer_size} ids "
                         "(len(processing_class)); use the tokenizer's mask id (DiffusionGRPOConfig(mask_token_id=...))")


def check_bool(value, name: str) -> bool:
    """``value`` if it is a real bool (a string such as ``"False"`` is not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_choice(value, name: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_int(value, name: str, *, low: int, high: int | None = None) -> int:
    """A Python int in ``[low, high)`` (no upper bound when ``high`` is None)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {'in ' if high is not None else ''}{bound}, got {value}")
    return value


def check_row_offset(row_offset, rows: int, *, positions: int | None = None) -> int:
    """``row_offset``, the global index of row 0 of a call (for sharded batches), as an int >= 0.

    Row ``b`` of the call hashes as row ``row_offset + b``, which must stay a 32-bit word: for the
    ``rows`` rows of the call, ``row_offset + rows <= 2**32``. With ``positions`` (the sampler's
    row ids ``(row_offset + b) * positions + j``), ``(row_offset + rows) * positions <= 2**32``.
    """
    row_offset = check_int(row_offset, "row_offset", low=0)
    scale = 1 if positions is None else positions
    if row_offset >= WORD_LIMIT or (row_offset + rows) * scale > WORD_LIMIT:
        if positions is None:
            bound, got = "row_offset + B <= 2**32", f"row_offset = {row_offset} with B = {rows}"
        else:
            bound, got = "(row_offset + B) * L <= 2**32", f"row_offset = {row_offset} with B = {rows}, L = {positions}"
        raise ValueError(f"row_offset must keep {bound} (hashed row ids are 32-bit words), got {got}")
    return row_offset
