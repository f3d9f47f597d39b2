"""Truncated importance weights for cached / parallel rollouts (``truncated_importance_weights``)."""
import math

import pytest
import torch

from daca_kernels.losses import truncated_importance_weights


def inputs():
    target = torch.tensor([[-1.0, -2.0, -0.5, 7.0], [-3.0, -1.0, float("nan"), -2.0]])
    sampling = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-1.0, -4.0, 0.0, -2.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, True]])
    return target, sampling, mask


def test_token_weights_are_truncated_ratios_and_zero_outside_the_mask():
    target, sampling, mask = inputs()
    weights = truncated_importance_weights(target, sampling, mask, cap=3.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 0.0], [math.exp(-2.0), 3.0, 0.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad


def test_sequence_weights_use_the_summed_log_ratio_of_each_row():
    target, sampling, mask = inputs()
    weights = truncated_importance_weights(target, sampling, mask, cap=10.0, level="sequence")
    rows = torch.tensor([math.exp(0.5 - 1.0), math.exp(-2.0 + 3.0)])
    torch.testing.assert_close(weights, rows[:, None] * mask.float())


def test_exact_rollouts_get_weight_one():
    logp = -torch.rand(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert torch.equal(truncated_importance_weights(logp, logp.clone(), mask), torch.ones(2, 5))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(cap=0.0), ValueError, "cap"),
    (dict(level="batch"), ValueError, "level"),
])
def test_bad_options_are_refused_by_name(kwargs, error, message):
    target, sampling, mask = inputs()
    with pytest.raises(error, match=message):
        truncated_importance_weights(target, sampling, mask, **kwargs)


def test_bad_tensors_are_refused_by_name():
    target, sampling, mask = inputs()
    with pytest.raises(ValueError, match="sampling_logp"):
        truncated_importance_weights(target, sampling[:, :3], mask)
    with pytest.raises(TypeError, match="mask"):
        truncated_importance_weights(target, sampling, mask.float())
