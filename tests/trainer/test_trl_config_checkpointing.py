"""DiffusionGRPOConfig's activation checkpointing: TRL's default (on) without transformers 5's
deprecation warning, and either name honoured when given (transformers 4 knows only
``gradient_checkpointing``, which then carries the value, and warns about neither)."""
import warnings

import pytest
import transformers

pytest.importorskip("trl")

from tests.trl_setup import tiny_config  # noqa: E402


@pytest.mark.parametrize("given, expected, warns", [
    ({}, True, False),
    ({"activation_checkpointing": False}, False, False),
    ({"activation_checkpointing": True}, True, False),
    ({"gradient_checkpointing": False}, False, True),
])
def test_checkpointing_default_and_both_names(tmp_path, given, expected, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = tiny_config(str(tmp_path), **given)
    deprecated = [w for w in caught if issubclass(w.category, FutureWarning) and "gradient_checkpointing" in str(w.message)]
    assert config.activation_checkpointing is expected
    assert config.gradient_checkpointing is expected
    assert bool(deprecated) is (warns and int(transformers.__version__.split(".")[0]) >= 5)
