"""DiSPO's step loss against its state-by-state reference, its token locality, and the mixed objective."""
import pytest
import torch
from support import assert_unchanged, snapshot

from daca_kernels import dispo_step_loss, group_advantages, grpo_loss, mixed_objective
from daca_kernels.reference import losses as ref


def make_inputs(num_states=3, num_fillings=4, length=8, seed=0, dtype=torch.float64):
    """Z consecutive fillings per state; state 1 fills a single position; the first filling of
    state 0 drifted up and the second down, so both sides of the clip bind."""
    g = torch.Generator().manual_seed(seed)
    rows = num_states * num_fillings
    logp = -(torch.rand(rows, length, generator=g, dtype=torch.float64) * 3 + 0.05)
    old = logp + 0.1 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    old[0] -= 0.6
    old[1] += 0.6
    filled = (torch.rand(num_states, 1, length, generator=g) < 0.5).expand(-1, num_fillings, -1).reshape(rows, length).clone()
    filled[0:2, :4] = True
    filled[num_fillings : 2 * num_fillings] = False
    filled[num_fillings : 2 * num_fillings, 3] = True
    rewards = torch.rand(rows, generator=g, dtype=torch.float64)
    rewards[0], rewards[1] = 1.0, 0.0  # A > 0 for the first filling, A < 0 for the second
    weights = 0.5 + torch.rand(rows, length, generator=g, dtype=torch.float64)
    logp, old, rewards, weights = (t.to(dtype) for t in (logp, old, rewards, weights))
    return logp.requires_grad_(), old, filled, rewards, weights


def grads(loss, logp):
    return torch.autograd.grad(loss, logp, retain_graph=True)[0]


@pytest.mark.parametrize("num_fillings", [2, 4])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_matches_reference(num_fillings, weighted, epsilon_high):
    logp, old, filled, rewards, w = make_inputs(num_states=12 // num_fillings, num_fillings=num_fillings)
    kwargs = dict(token_weights=w if weighted else None, epsilon=0.2, epsilon_high=epsilon_high)
    before = snapshot(logp, old, filled, rewards, w)
    loss, metrics = dispo_step_loss(logp, old, filled, rewards, num_fillings, **kwargs)
    want = ref.dispo_step_loss(logp, old, filled, rewards, num_fillings, **kwargs)
    assert metrics["clip_fraction_low"].item() > 0 and metrics["clip_fraction_high"].item() > 0
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    grad = grads(loss, logp)
    torch.testing.assert_close(grad, grads(want, logp), rtol=1e-12, atol=1e-14)
    assert (grad[~filled] == 0).all() and (grad[filled] != 0).any()
    assert_unchanged(before, logp, old, filled, rewards, w)


def test_float32_close_to_reference():
    logp, old, filled, rewards, w = make_inputs(seed=1, dtype=torch.float32)
    loss, _ = dispo_step_loss(logp, old, filled, rewards, 4, token_weights=w)
    want = ref.dispo_step_loss(logp, old, filled, rewards, 4, token_weights=w)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads(loss, logp).double(), grads(want, logp).double(), rtol=1e-5, atol=1e-6)


def test_only_newly_filled_positions_count():
    logp, old, filled, rewards, _ = make_inputs(seed=2)
    loss, _ = dispo_step_loss(logp, old, filled, rewards, 4)
    elsewhere = torch.where(filled, logp.detach(), logp.detach() - 5.0).requires_grad_()
    moved, _ = dispo_step_loss(elsewhere, torch.where(filled, old, old + 3.0), filled, rewards, 4)
    torch.testing.assert_close(moved, loss, rtol=1e-12, atol=1e-14)
    assert (grads(moved, elsewhere)[~filled] == 0).all()


def test_advantages_are_relative_within_a_state():
    """A state whose fillings all score the same teaches nothing; adding a constant to one
    state's rewards changes nothing."""
    logp, old, filled, rewards, _ = make_inputs(seed=3)
    tied = rewards.clone()
    tied[4:8] = 0.7
    loss, metrics = dispo_step_loss(logp, old, filled, tied, 4)
    assert (grads(loss, logp)[4:8] == 0).all()
    shifted = tied.clone()
    shifted[8:12] += 10.0
    shifted_loss, _ = dispo_step_loss(logp, old, filled, shifted, 4)
    torch.testing.assert_close(shifted_loss, loss, rtol=1e-9, atol=1e-12)
    expected = ref.group_advantages(tied, 4).abs().mean()
    torch.testing.assert_close(metrics["advantage_abs_mean"], expected, rtol=1e-12, atol=1e-14)


def test_on_policy_default():
    logp, _, filled, rewards, w = make_inputs(seed=4)
    loss, metrics = dispo_step_loss(logp, None, filled, rewards, 4, token_weights=w)
    want = ref.dispo_step_loss(logp, None, filled, rewards, 4, token_weights=w)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads(loss, logp), grads(want, logp), rtol=1e-12, atol=1e-14)
    assert metrics["ratio_mean"].item() == 1.0


def test_mixed_objective_combines_values_and_gradients():
    logp, old, filled, rewards, w = make_inputs(seed=5)
    step, _ = dispo_step_loss(logp, old, filled, rewards, 4, token_weights=w)
    completion = torch.ones_like(filled)
    base, _ = grpo_loss(logp, old, group_advantages(rewards, 4), completion)
    mixed = mixed_objective(base, step, alpha_base=0.7, alpha_step=2.5)
    torch.testing.assert_close(mixed, 0.7 * base + 2.5 * step, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads(mixed, logp), 0.7 * grads(base, logp) + 2.5 * grads(step, logp), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mixed_objective(base, step), base + step, rtol=0, atol=0)


def test_compiles_fullgraph():
    torch._dynamo.reset()
    logp, old, filled, rewards, w = make_inputs(seed=6, dtype=torch.float32)

    def fn(lp):
        step, _ = dispo_step_loss(lp, old, filled, rewards, 4, token_weights=w, epsilon_high=0.28)
        return mixed_objective(lp.mean(), step, alpha_step=0.5)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager = fn(logp)
    got = compiled(logp)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(grads(got, logp), grads(eager, logp))


BAD = {
    "not dividing": (lambda a: {**a, "num_fillings": 5}, ValueError, "num_fillings must divide the number of rows of logp"),
    "one filling": (lambda a: {**a, "num_fillings": 1}, ValueError, "num_fillings must be >= 2"),
    "float fillings": (lambda a: {**a, "num_fillings": 4.0}, TypeError, "num_fillings must be an int"),
    "rewards length": (lambda a: {**a, "rewards": a["rewards"][:6]}, ValueError, r"rewards must have shape \[R\] = \(12,\)"),
    "rewards dtype": (lambda a: {**a, "rewards": a["rewards"].long()}, TypeError, "rewards must have dtype"),
    "rewards device": (lambda a: {**a, "rewards": a["rewards"].to("meta")}, ValueError, "rewards is on meta"),
    "filled dtype": (lambda a: {**a, "filled_mask": a["filled_mask"].double()}, TypeError, "filled_mask must have dtype"),
    "filled shape": (lambda a: {**a, "filled_mask": a["filled_mask"][:, :3]}, ValueError, r"filled_mask must have shape \[R, L\]"),
    "old shape": (lambda a: {**a, "old_logp": a["old_logp"][:, 1:]}, ValueError, r"old_logp must have shape \[R, L\]"),
    "weights shape": (lambda a: {**a, "token_weights": a["token_weights"][:3]}, ValueError, r"token_weights must have shape \[R, L\]"),
    "unknown scale": (lambda a: {**a, "scale": "max"}, ValueError, "scale must be one of"),
    "eps": (lambda a: {**a, "epsilon": 1.5}, ValueError, "epsilon must be a finite number"),
    "logp 3-D": (lambda a: {**a, "logp": a["logp"][None]}, ValueError, "logp must be 2-D"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_rejects_bad_input(case):
    make, error, message = BAD[case]
    logp, old, filled, rewards, w = make_inputs()
    args = dict(logp=logp, old_logp=old, filled_mask=filled, rewards=rewards, num_fillings=4, token_weights=w)
    before = snapshot(logp, old, filled, rewards, w)
    with pytest.raises(error, match=message):
        dispo_step_loss(**make(args))
    assert_unchanged(before, logp, old, filled, rewards, w)


def test_mixed_objective_rejects():
    base, step = torch.tensor(1.0), torch.tensor(2.0)
    with pytest.raises(ValueError, match="base_loss must be 0-D"):
        mixed_objective(torch.ones(2), step)
    with pytest.raises(TypeError, match="step_loss must be a torch.Tensor"):
        mixed_objective(base, 2.0)
    with pytest.raises(TypeError, match="step_loss must have dtype"):
        mixed_objective(base, torch.tensor(2))
    with pytest.raises(ValueError, match="alpha_step must be a finite number"):
        mixed_objective(base, step, alpha_step=-1.0)
    with pytest.raises(TypeError, match="alpha_base must be a Python float"):
        mixed_objective(base, step, alpha_base=torch.tensor(0.5))
    with pytest.raises(ValueError, match="step_loss is on meta"):
        mixed_objective(base, step.to("meta"))
