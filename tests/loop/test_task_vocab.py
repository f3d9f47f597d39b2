"""The character vocabulary: fixed ids, round trips, special tokens, bad input."""
import re

import pytest
import torch
from properties import given, settings, st

from integration.tasks import vocab

CHARACTERS = vocab.DIGITS + vocab.LETTERS + vocab.PUNCTUATION


def test_ids_are_fixed_and_small():
    assert (vocab.pad_id, vocab.mask_id, vocab.eos_id, vocab.bos_id) == (0, 1, 2, 3)
    assert vocab.SYMBOLS[:4] == ("[PAD]", "[MASK]", "[EOS]", "[BOS]")
    assert vocab.size == len(vocab.SYMBOLS) == 52 < 64
    assert len(set(vocab.SYMBOLS)) == vocab.size
    assert vocab.special_ids == {0, 1, 2, 3}
    assert vocab.encode("09az{}[]\":,-=<#!") == [4, 13, 14, 39] + list(range(40, 52))


def test_special_token_names_are_single_tokens():
    assert vocab.encode("[MASK]") == [vocab.mask_id]
    assert vocab.encode("1[EOS][PAD]") == [5, vocab.eos_id, vocab.pad_id]
    # Brackets around anything that is not a special-token name stay characters.
    assert vocab.encode("[1,2]") == [42, 5, 46, 6, 43]
    assert vocab.encode("[mask]") == [42, 26, 14, 32, 24, 43]
    assert vocab.split_symbols('{"a":[MASK]}') == ["{", '"', "a", '"', ":", "[MASK]", "}"]


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=CHARACTERS, max_size=50))
def test_text_round_trip(text):
    ids = vocab.encode(text)
    assert len(ids) == len(text)
    assert all(i not in vocab.special_ids for i in ids)
    assert vocab.decode(ids) == text
    assert vocab.decode(ids, strip_special=False) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, vocab.size - 1), max_size=50))
def test_ids_round_trip_through_named_special_tokens(ids):
    text = vocab.decode(ids, strip_special=False)
    assert vocab.encode(text) == ids
    assert vocab.decode(torch.tensor(ids, dtype=torch.long), strip_special=False) == text


def test_decode_strips_special_tokens_and_stops_at_eos():
    ids = vocab.encode("[PAD][PAD][BOS]12[MASK]3[PAD][EOS]45[EOS]")
    assert vocab.decode(ids) == "123"
    assert vocab.decode(ids, strip_special=False) == "[PAD][PAD][BOS]12[MASK]3[PAD][EOS]45[EOS]"
    assert vocab.decode(vocab.encode("[EOS]12")) == ""
    assert vocab.decode([]) == ""
    assert vocab.decode(torch.tensor([5, 6, vocab.eos_id, 7], dtype=torch.int32)) == "12"


def test_split_symbols_never_raises_on_unknown_characters():
    assert vocab.split_symbols("aZé [MAS") == ["a", "Z", "é", " ", "[", "M", "A", "S"]
    assert vocab.split_symbols("") == []


@pytest.mark.parametrize("text, bad, index", [("abC", "C", 2), ("1 2", " ", 1), ("[MAS", "M", 1), ("x\n", "\n", 1)])
def test_encode_rejects_unknown_characters(text, bad, index):
    with pytest.raises(ValueError, match="^" + re.escape(f"text contains {bad!r} at index {index}")):
        vocab.encode(text)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="^text"):
        vocab.encode(12)
    with pytest.raises(TypeError, match="^text"):
        vocab.split_symbols(None)
    with pytest.raises(ValueError, match="^ids holds 52 at index 1"):
        vocab.decode([4, 52])
    with pytest.raises(ValueError, match="^ids holds -1"):
        vocab.decode([-1])
    with pytest.raises(TypeError, match="^ids must hold ints, got a bool"):
        vocab.decode([True])
    with pytest.raises(TypeError, match="^ids must hold ints, got float"):
        vocab.decode([4.0])
    with pytest.raises(TypeError, match="^ids must be a sequence"):
        vocab.decode("12")
    with pytest.raises(TypeError, match="^ids must be a sequence"):
        vocab.decode(4)
    with pytest.raises(TypeError, match="^ids must be an integer tensor"):
        vocab.decode(torch.tensor([4.0]))
    with pytest.raises(ValueError, match="^ids must be 1-D"):
        vocab.decode(torch.tensor([[4, 5]]))
    with pytest.raises(TypeError, match="^strip_special"):
        vocab.decode([4], strip_special=None)
