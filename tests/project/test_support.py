"""The tests' own comparison rules catch what they are meant to catch."""
import math

import pytest
import torch
from support import REDUCTION_FACTOR, assert_close_reduced, reduction_tolerance


def test_the_reduction_tolerance_grows_with_the_dtype_the_length_and_the_magnitude():
    eps32 = torch.finfo(torch.float32).eps
    assert reduction_tolerance(torch.float32, 64) == pytest.approx(REDUCTION_FACTOR * eps32 * 8)
    assert reduction_tolerance(torch.float32, 64, 4.0) == pytest.approx(4 * reduction_tolerance(torch.float32, 64))
    assert reduction_tolerance(torch.float32, 64, 0.01) == reduction_tolerance(torch.float32, 64)  # at least 1
    assert reduction_tolerance(torch.float64, 64) < 1e-13 < reduction_tolerance(torch.float32, 1)
    assert reduction_tolerance(torch.float32, 256) == pytest.approx(2 * reduction_tolerance(torch.float32, 64))
    assert math.isfinite(reduction_tolerance(torch.bfloat16, 0))


def test_two_summation_orders_pass_and_a_planted_error_fails():
    g = torch.Generator().manual_seed(0)
    terms = torch.randn(32, 64, generator=g)
    forward = terms.sum(1)
    backward = terms.flip(1).cumsum(1)[:, -1]  # the same sums in another order
    assert_close_reduced(forward, backward, n=64)
    planted = backward.clone()
    planted[5] += 1e-3
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_reduced(forward, planted, n=64)
    # float64 values that passed through float32 are compared at float32's tolerance only when asked.
    rounded = forward.double().float().double() + 1e-7
    assert_close_reduced(forward.double(), rounded, n=64, dtype=torch.float32)
    with pytest.raises(AssertionError):
        assert_close_reduced(forward.double(), rounded, n=64)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_reduced(torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0]), n=4)
