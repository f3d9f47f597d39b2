"""group_advantages against the plain-Python reference, its edge cases and bad input."""
import pytest
import torch
from support import assert_unchanged, snapshot

from daca_kernels import group_advantages
from daca_kernels.reference import losses as ref


def rewards_for(num_groups, group_size, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_groups * group_size, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("num_groups,group_size", [(3, 4), (1, 2), (2, 5)])
def test_matches_reference(scale, leave_one_out, num_groups, group_size):
    rewards = rewards_for(num_groups, group_size)
    got = group_advantages(rewards, group_size, scale=scale, leave_one_out=leave_one_out)
    want = ref.group_advantages(rewards, group_size, scale=scale, leave_one_out=leave_one_out)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_of_one_gives_zero(scale):
    rewards = rewards_for(5, 1)
    got = group_advantages(rewards, 1, scale=scale)
    torch.testing.assert_close(got, torch.zeros(5, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(got, ref.group_advantages(rewards, 1, scale=scale), rtol=0, atol=0)


def test_constant_group_gives_zero_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.25])
    got = group_advantages(rewards, 3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:3], torch.zeros(3))
    assert (got[3:] != 0).all()


def test_float32_and_half_inputs():
    rewards = rewards_for(2, 4)
    want = ref.group_advantages(rewards, 4)
    got32 = group_advantages(rewards.float(), 4)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)
    got16 = group_advantages(rewards.half(), 4)
    assert got16.dtype == torch.float32
    torch.testing.assert_close(got16.double(), ref.group_advantages(rewards.half(), 4), rtol=1e-5, atol=1e-5)


def test_leave_one_out_is_scaled_centring():
    rewards = rewards_for(3, 4, seed=3)
    centred = group_advantages(rewards, 4, scale="none")
    loo = group_advantages(rewards, 4, scale="none", leave_one_out=True)
    torch.testing.assert_close(loo, centred * 4 / 3, rtol=1e-12, atol=1e-12)


def test_group_and_batch_scaling_differ_and_groups_are_consecutive():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0], dtype=torch.float64)
    first, second = 0.5 / (0.5**0.5 + 1e-4), 10.0 / (200.0**0.5 + 1e-4)
    want = torch.tensor([-first, first, -second, second], dtype=torch.float64)
    group = group_advantages(rewards, 2)
    torch.testing.assert_close(group, want, rtol=1e-12, atol=0)
    batch = group_advantages(rewards, 2, scale="batch")
    batch_std = float(torch.tensor([0.0, 1.0, 10.0, 30.0]).double().std())
    torch.testing.assert_close(batch, torch.tensor([-0.5, 0.5, -10.0, 10.0], dtype=torch.float64) / (batch_std + 1e-4))


def test_compiles_fullgraph():
    torch._dynamo.reset()
    rewards = rewards_for(3, 4)

    def fn(r):
        return group_advantages(r, 4, scale="batch", leave_one_out=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(rewards), fn(rewards))


CASES = {
    "not dividing": (dict(group_size=3), ValueError, "group_size must divide the number of rewards"),
    "zero group": (dict(group_size=0), ValueError, "group_size must be >= 1"),
    "float group": (dict(group_size=2.0), TypeError, "group_size must be an int"),
    "bool group": (dict(group_size=True), TypeError, "group_size must be an int"),
    "loo with one": (dict(group_size=1, leave_one_out=True), ValueError, "group_size must be >= 2 with leave_one_out"),
    "unknown scale": (dict(scale="std"), ValueError, "scale must be one of 'group', 'batch', 'none'"),
    "loo not bool": (dict(leave_one_out=1), TypeError, "leave_one_out must be a bool"),
    "negative eps": (dict(eps=-1e-3), ValueError, "eps must be a finite number"),
    "tensor eps": (dict(eps=torch.tensor(1e-4)), TypeError, "eps must be a Python float"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejects_bad_arguments(case):
    kwargs, error, message = CASES[case]
    rewards = rewards_for(2, 4)
    before = snapshot(rewards)
    kwargs = {"group_size": 4, **kwargs}
    group_size = kwargs.pop("group_size")
    with pytest.raises(error, match=message):
        group_advantages(rewards, group_size, **kwargs)
    assert_unchanged(before, rewards)


@pytest.mark.parametrize(
    "rewards,error,message",
    [
        (torch.ones(2, 4), ValueError, "rewards must be 1-D"),
        (torch.ones(8, dtype=torch.long), TypeError, "rewards must have dtype"),
        (torch.ones(0), ValueError, "rewards must not be empty"),
        ([1.0, 0.0], TypeError, "rewards must be a torch.Tensor"),
    ],
)
def test_rejects_bad_rewards(rewards, error, message):
    with pytest.raises(error, match=message):
        group_advantages(rewards, 2)
