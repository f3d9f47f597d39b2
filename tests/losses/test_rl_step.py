"""``daca_kernels.rl_step``: every objective's loss equals the reference losses on a tiny float64
model (full logits, ``daca_kernels.reference``), the normalisers follow their rules, the backward hook
is called, and BGPO's sample-by-sample backward gives the plain loss's gradients one sample at a time.
"""
import pytest
import torch
from support import assert_unchanged, snapshot
from tiny_models import tiny_masked_lm

from daca_kernels import reference
from daca_kernels.likelihood import EstimatorSpec
from daca_kernels.rl_step import (
    Fillings,
    Policy,
    StepBatch,
    StepOptions,
    bgpo_backward,
    chunk_normaliser,
    mask_samples,
    objective_loss,
    old_values,
    reference_values,
)

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")

ROWS, PROMPT, GEN, Z, ROW_OFFSET = 4, 3, 7, 2, 5


@pytest.fixture(scope="module")
def lm():
    return tiny_masked_lm(vocab=37, hidden=16, dtype=torch.float64, seed=3)


def make_batch(lm, seed: int = 0) -> StepBatch:
    """Left-padded prompts (row 0 has one pad), answers ending early in rows 1 and 2, DPS-like weights,
    advantages of both signs, and Z = 2 fillings of a state with about half the completion masked."""
    g = torch.Generator().manual_seed(seed)
    length = PROMPT + GEN
    ids = torch.randint(0, lm.mask_id, (ROWS, length), generator=g)
    attention = torch.ones(ROWS, length, dtype=torch.long)
    attention[0, 0] = 0
    completion = torch.zeros(ROWS, length, dtype=torch.bool)
    completion[:, PROMPT:] = True
    loss_mask = completion.clone()
    loss_mask[1, PROMPT + 2:] = False
    loss_mask[2, PROMPT + 5:] = False
    weights = 0.5 + torch.rand(ROWS, length, generator=g, dtype=torch.float64)
    advantages = torch.tensor([0.9, -1.1, 0.4, -0.3], dtype=torch.float64)
    filled = completion & (torch.rand(ROWS, length, generator=g) < 0.5)
    filled[:, PROMPT] = True
    state = ids.masked_fill(filled, lm.mask_id)
    fillings = state.repeat_interleave(Z, dim=0)
    filled_rows = filled.repeat_interleave(Z, dim=0)
    fillings[filled_rows] = torch.randint(0, lm.mask_id, (int(filled_rows.sum()),), generator=g)
    rewards = torch.rand(ROWS * Z, generator=g, dtype=torch.float64)
    return StepBatch(ids, attention, completion, loss_mask, advantages, generation_length=GEN, row_offset=ROW_OFFSET,
                     token_weights=weights, fillings=Fillings(state, fillings, filled_rows, rewards, Z))


def reference_token_logprob(lm, batch: StepBatch, masked, scored) -> torch.Tensor:
    """``log p(y_i | input masked at masked)`` at ``scored`` from the full logits, 0 elsewhere."""
    def logits(ids):
        return lm.module(input_ids=ids, attention_mask=batch.attention_mask).logits

    copies = batch.input_ids.masked_fill(masked, lm.mask_id)[None]
    return reference.masked_copies_logprob(logits, batch.input_ids, copies, torch.where(scored, 0, -1), shift=lm.shift)


def reference_samples(lm, options, batch, seed):
    samples = mask_samples(lm, options, batch, seed)
    logp = torch.stack([reference_token_logprob(lm, batch, s.masked, s.scored) for s in samples])
    return logp, torch.stack([s.scored for s in samples]), torch.stack([s.t for s in samples])


def reference_step_logprob(lm, batch):
    f = batch.fillings
    logits = lm.module(input_ids=f.state, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits, dim=-1).repeat_interleave(Z, dim=0).gather(-1, f.fillings[..., None])[..., 0]
    return torch.where(f.filled, logp, 0.0)


def perturbed(values, seed=1, scale=0.1):
    """Old-policy values away from the current ones, so that ratios differ from 1 and clipping acts."""
    g = torch.Generator().manual_seed(seed)
    return values + scale * torch.randn(values.shape, generator=g, dtype=values.dtype)


CASES = {
    "grpo": dict(objective="grpo", estimator="one_step", loss_type="dapo", beta=0.04, epsilon_high=0.28),
    "grpo-bnpo": dict(objective="grpo", estimator="one_step", loss_type="bnpo"),
    "bgpo": dict(objective="bgpo", estimator=EstimatorSpec("elbo", elbo_samples=3)),
    "spg": dict(objective="spg", estimator=EstimatorSpec("elbo", elbo_samples=3), spg_bound="mix", spg_beta=1.5),
    "dispo": dict(objective="dispo", estimator="one_step", loss_type="grpo", dispo_alpha=0.7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_objective_equals_the_reference_losses(lm, case):
    options = StepOptions(**CASES[case])
    batch = make_batch(lm)
    seed = 11
    before = snapshot(batch.input_ids, batch.loss_mask, batch.advantages, batch.token_weights)
    tokens, filled = batch.loss_mask.sum() * 2, batch.fillings.filled.sum() * 2  # another process's rows as many
    normaliser = chunk_normaliser(tokens, filled, processes=2, accumulation=2, chunks=2)
    assert float(normaliser.token_count) == float(batch.loss_mask.sum()) and normaliser.divisor == 2.0
    losses = reference.losses
    old = old_values(lm, options, batch, seed)
    ref = reference_values(lm, options, batch, seed) if options.needs_reference else None
    old = None if old is None else perturbed(old)
    if options.objective == "bgpo":
        scores = losses.elbo_sample_scores(*reference_samples(lm, options, batch, seed), batch.token_weights)
        want = losses.bgpo_loss(scores, old, batch.advantages) / 2
    elif options.objective == "spg":
        logp, scored, t = reference_samples(lm, options, batch, seed)
        want = losses.spg_loss(logp, scored, t, batch.loss_mask, batch.advantages, negative_bound="mix", beta=1.5,
                               token_weights=batch.token_weights, num_items_in_batch=batch.loss_mask.sum())
    else:
        logp = reference_token_logprob(lm, batch, batch.completion_mask, batch.loss_mask)
        kwargs = {k: v for k, v in CASES[case].items() if k in ("loss_type", "beta", "epsilon_high")}
        if options.loss_type == "dapo":
            kwargs["num_items_in_batch"] = batch.loss_mask.sum()
        want, _ = losses.grpo_loss(logp, old, batch.advantages, batch.loss_mask, ref_logp=ref,
                                   token_weights=batch.token_weights, **kwargs)
        if options.loss_type != "dapo":
            want = want / 2  # the accumulation of two chunks
    old_step = None
    if options.objective == "dispo":
        old_step = perturbed(reference_step_logprob(lm, batch).detach(), seed=2)
        f = batch.fillings
        step = losses.dispo_step_loss(reference_step_logprob(lm, batch), old_step, f.filled, f.rewards, Z)
        want = want + 0.7 * step
    loss, metrics = objective_loss(lm, options, batch, seed, normaliser, old=old, ref=ref, old_step=old_step)
    torch.testing.assert_close(loss, want.to(loss.dtype), rtol=1e-9, atol=1e-12)
    assert loss.requires_grad and loss.abs() > 0
    if options.objective == "dispo":
        torch.testing.assert_close(metrics["dispo/step_loss"], step.to(loss.dtype), rtol=1e-9, atol=1e-12)
    assert_unchanged(before, batch.input_ids, batch.loss_mask, batch.advantages, batch.token_weights)


def test_the_normalisers_rules():
    tokens, filled = torch.tensor(24), torch.tensor(10)
    averaged = chunk_normaliser(tokens, filled, processes=2, accumulation=3, chunks=4)
    assert float(averaged.token_count) == 24 / 2 * 3 / 4 and float(averaged.filled_count) == 10 / 2 * 3 / 4
    assert averaged.divisor == 3.0 and not averaged.bnpo_global
    assert float(chunk_normaliser(torch.tensor(0)).token_count) == 1.0, "an empty batch divides by 1"
    summed = chunk_normaliser(tokens, filled, processes=2, gradients="summed")
    assert summed.token_count is tokens and summed.filled_count is filled and summed.divisor == 2.0 and summed.bnpo_global
    with pytest.raises(ValueError, match="accumulation"):
        chunk_normaliser(tokens, processes=2, gradients="summed", accumulation=2)
    with pytest.raises(ValueError, match="gradients"):
        chunk_normaliser(tokens, gradients="mean")


def test_bnpo_over_the_global_tokens_when_gradients_are_summed(lm):
    options, batch = StepOptions(loss_type="bnpo"), make_batch(lm)
    local = batch.loss_mask.sum()
    summed = chunk_normaliser(local * 3, processes=2, gradients="summed")
    averaged = chunk_normaliser(local * 3, processes=2)
    global_mean, _ = objective_loss(lm, options, batch, 0, summed)
    chunk_mean, _ = objective_loss(lm, options, batch, 0, averaged)
    torch.testing.assert_close(global_mean, chunk_mean / 3, rtol=1e-12, atol=0)


def counting_policy(lm, events: list) -> Policy:
    def forward(fn):
        events.append("forward")
        return fn(lm)

    return Policy(forward, lm.mask_id, lm.attention)


@pytest.mark.parametrize("objective", ["grpo", "spg", "dispo"])
def test_the_backward_hook_is_called_once(lm, objective):
    options = StepOptions(**{**CASES[objective], "beta": 0.0})
    batch, events = make_batch(lm), []
    normaliser = chunk_normaliser(batch.loss_mask.sum(), batch.fillings.filled.sum())
    lm.module.zero_grad(set_to_none=True)
    loss, _ = objective_loss(counting_policy(lm, events), options, batch, 3, normaliser,
                             backward=lambda t: events.append("backward") or t.backward())
    assert events == ["forward", "backward"], "one forward call of the model (dispo: both estimates), one backward"
    assert not loss.requires_grad
    expected, _ = objective_loss(lm, options, batch, 3, normaliser)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in lm.module.parameters())


def _gradients(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("on_policy", [True, False])
def test_bgpo_backward_is_the_plain_loss_one_sample_at_a_time(lm, on_policy):
    options = StepOptions(**CASES["bgpo"])
    batch, seed = make_batch(lm), 7
    normaliser = chunk_normaliser(batch.loss_mask.sum(), accumulation=2)
    old = None if on_policy else perturbed(old_values(lm, options, batch, seed))
    lm.module.zero_grad(set_to_none=True)
    plain, plain_metrics = objective_loss(lm, options, batch, seed, normaliser, old=old)
    plain.backward()
    want = _gradients(lm.module)
    assert want and any(g.abs().max() > 0 for g in want.values())

    lm.module.zero_grad(set_to_none=True)
    events = []
    loss, metrics = objective_loss(counting_policy(lm, events), options, batch, seed, normaliser, old=old,
                                   backward=lambda t: events.append("backward") or t.backward())
    # Constant memory: each sample's backward runs before the next sample's forward call.
    assert events == ["forward", "backward"] * 3
    torch.testing.assert_close(loss, plain.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(metrics["sample_log_ratio_mean"], plain_metrics["sample_log_ratio_mean"],
                               rtol=1e-12, atol=1e-15)
    got = _gradients(lm.module)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13, msg=name)

    # keep_last: the last share is returned with its graph, for a training step's own backward.
    lm.module.zero_grad(set_to_none=True)
    events.clear()
    kept, _ = bgpo_backward(counting_policy(lm, events), options, batch, seed, normaliser, old=old,
                            backward=lambda t: events.append("backward") or t.backward(), keep_last=True)
    assert events == ["forward", "backward", "forward", "backward", "forward"] and kept.requires_grad
    torch.testing.assert_close(kept.detach(), plain.detach(), rtol=1e-12, atol=1e-15)
    kept.backward()
    for name, grad in _gradients(lm.module).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-10, atol=1e-13, msg=name)


def test_bad_options_and_batches(lm):
    with pytest.raises(ValueError, match="objective"):
        StepOptions(objective="ppo")
    with pytest.raises(ValueError, match="estimator"):
        StepOptions(objective="bgpo", estimator="one_step")
    with pytest.raises(TypeError, match="model"):
        Policy.of(lm.module)
    batch = make_batch(lm)
    normaliser = chunk_normaliser(batch.loss_mask.sum(), batch.fillings.filled.sum())
    no_fillings = StepBatch(batch.input_ids, batch.attention_mask, batch.completion_mask, batch.loss_mask,
                            batch.advantages, generation_length=GEN)
    with pytest.raises(ValueError, match="batch.fillings"):
        objective_loss(lm, StepOptions(objective="dispo"), no_fillings, 0, normaliser)
    with pytest.raises(ValueError, match="filled_count"):
        objective_loss(lm, StepOptions(objective="dispo"), batch, 0, chunk_normaliser(batch.loss_mask.sum()))
    with pytest.raises(ValueError, match="ref_logp"):
        objective_loss(lm, StepOptions(beta=0.1), batch, 0, normaliser)
    with pytest.raises(ValueError, match="options.objective must be 'bgpo'"):
        bgpo_backward(lm, StepOptions(objective="spg", estimator="elbo"), batch, 0, normaliser)


def test_options_from_a_config():
    class Config:
        objective, estimator, num_strata, beta, max_completion_length = "spg", "stratified", 3, 0.5, 9

    options = StepOptions.from_config(Config(), beta=0.0)
    assert options.estimator == EstimatorSpec("stratified", num_strata=3)
    assert (options.objective, options.beta) == ("spg", 0.0)
    assert options.loss_type == "dapo" and not options.needs_reference
    assert StepOptions(objective="dispo", beta=0.1).needs_reference and not StepOptions(objective="spg", estimator="elbo",
                                                                                          beta=0.1).needs_reference


def test_the_objectives_table_is_what_the_step_does(lm):
    """Every row of ``daca_kernels.objectives.OBJECTIVES`` has a loss in the step, and its needs are the
    step's: Monte-Carlo objectives refuse a one-pass estimator, the kind of old values is what
    ``old_values`` returns, and ``needs_reference`` is the KL term under ``beta > 0``."""
    from daca_kernels.objectives import OBJECTIVES, objective
    from daca_kernels.rl_step import OBJECTIVE_LOSSES

    assert OBJECTIVE_LOSSES.keys() == OBJECTIVES.keys()
    batch = make_batch(lm)
    for name, row in OBJECTIVES.items():
        assert objective(name) is row
        estimator = "elbo" if row.monte_carlo_masks else "one_step"
        if row.monte_carlo_masks:
            with pytest.raises(ValueError, match="estimator must be one of"):
                StepOptions(objective=name, estimator="one_step")
        options = StepOptions(objective=name, estimator=estimator)
        old = old_values(lm, options, batch, seed=11)
        shape = {"tokens": tuple(batch.input_ids.shape), "samples": (options.estimator.elbo_samples, ROWS), None: None}
        assert (None if old is None else tuple(old.shape)) == shape[row.old_values], name
        assert StepOptions(objective=name, estimator=estimator, beta=0.1).needs_reference == row.kl_term
        assert not StepOptions(objective=name, estimator=estimator).needs_reference
    with pytest.raises(ValueError, match="objective must be one of"):
        objective("ppo")
