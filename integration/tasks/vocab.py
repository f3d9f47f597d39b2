"""The character-level vocabulary shared by every task.

One symbol per token: four special tokens, the ten digits, the 26 lowercase letters and the
punctuation the task formats use. Ids are fixed (this order is part of the interface)::

    0 [PAD]   1 [MASK]   2 [EOS]   3 [BOS]
    4..13   0-9
    14..39  a-z
    40..51  { } [ ] " : , - = < # !

In text a special token is spelled by its name (``"[MASK]"``). Uppercase letters are not in the
vocabulary, so a name can never be confused with the characters ``[``, ``M``, ... : ``encode``
reads ``"[MASK]"`` as one token, and ``encode(decode(ids, strip_special=False)) == ids``.

Roles: ``[PAD]`` left-pads prompts to a fixed length, ``[BOS]`` marks where a prompt starts,
``[EOS]`` pads completions to a fixed length (LLaDA's convention), ``[MASK]`` is the diffusion
mask.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

PAD = "[PAD]"
MASK = "[MASK]"
EOS = "[EOS]"
BOS = "[BOS]"
SPECIAL_TOKENS = (PAD, MASK, EOS, BOS)

DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PUNCTUATION = '{}[]":,-=<#!'

SYMBOLS: tuple[str, ...] = SPECIAL_TOKENS + tuple(DIGITS + LETTERS + PUNCTUATION)
"""Every token's text, indexed by id."""

size = len(SYMBOLS)
pad_id, mask_id, eos_id, bos_id = range(len(SPECIAL_TOKENS))
special_ids = frozenset(range(len(SPECIAL_TOKENS)))

_ID_OF = {symbol: i for i, symbol in enumerate(SYMBOLS)}


def split_symbols(text: str) -> list[str]:
    """Split ``text`` into symbols: each special-token name is one symbol, every other character
    is one symbol of its own, whether or not it is in the vocabulary (so this never raises on a
    string). Rewards use it to read a completion position by position."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    symbols = []
    i = 0
    while i < len(text):
        if text[i] == "[":
            name = next((s for s in SPECIAL_TOKENS if text.startswith(s, i)), None)
            if name is not None:
                symbols.append(name)
                i += len(name)
                continue
        symbols.append(text[i])
        i += 1
    return symbols


def encode(text: str, *, name: str = "text") -> list[int]:
    """Token ids of ``text`` (special tokens written by name, e.g. ``"12[EOS]"``).

    ``name`` is what error messages call ``text`` (callers pass their own argument's name).

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: ``text`` contains a character outside the vocabulary.
    """
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    ids = []
    position = 0
    for symbol in split_symbols(text):
        token = _ID_OF.get(symbol)
        if token is None:
            raise ValueError(f"{name} contains {symbol!r} at index {position}, which is not in the vocabulary")
        ids.append(token)
        position += len(symbol)
    return ids


def decode(ids, *, strip_special: bool = True) -> str:
    """The text of a sequence of token ids (a list of ints or a 1-D integer tensor).

    With ``strip_special=True`` the text ends before the first ``[EOS]`` (everything after it is
    completion padding) and ``[PAD]``, ``[BOS]`` and ``[MASK]`` are left out. With
    ``strip_special=False`` every token is written, special tokens by name.

    Raises:
        TypeError: ``ids`` is not a sequence of integers (or is a tensor that is not integer).
        ValueError: ``ids`` is a tensor that is not 1-D, or holds an id outside ``[0, size)``.
    """
    if not isinstance(strip_special, bool):
        raise TypeError(f"strip_special must be a bool, got {type(strip_special).__name__}")
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
    symbols = []
    for position, token in enumerate(ids):
        if isinstance(token, bool):
            raise TypeError(f"ids must hold ints, got a bool at index {position}")
        try:
            token = operator.index(token)
        except TypeError:
            raise TypeError(f"ids must hold ints, got {type(token).__name__} at index {position}") from None
        if not 0 <= token < size:
            raise ValueError(f"ids holds {token} at index {position}, outside [0, {size})")
        symbols.append(SYMBOLS[token])
    if strip_special:
        if EOS in symbols:
            symbols = symbols[: symbols.index(EOS)]
        symbols = [s for s in symbols if s not in SPECIAL_TOKENS]
    return "".join(symbols)
