"""SPG against its loop reference (values and gradients), the A >= 0 / A < 0 split, the EUBO's
closed form for one sample, SPG's rule for tokens no sample masked, its numerics, and bad input."""

import pytest
import torch
from support import assert_unchanged, snapshot

from daca_kernels import elbo_sample_scores, eubo_scores, spg_loss
from daca_kernels.reference import losses as ref


def make_inputs(num_samples=4, batch=6, length=7, seed=0, dtype=torch.float64):
    """Row 2 has no completion token, row 3 a single one; token (0, 1) is a completion token that
    no sample masks; sample 0 masks nothing of row 4 (t = 0); advantages of both signs and 0."""
    g = torch.Generator().manual_seed(seed)
    logp = -(torch.rand(num_samples, batch, length, generator=g, dtype=torch.float64) * 3 + 0.05)
    completion = torch.rand(batch, length, generator=g) < 0.8
    completion[2] = False
    completion[3] = False
    completion[3, 5] = True
    completion[0, 1] = True
    masks = torch.rand(num_samples, batch, length, generator=g) < 0.5
    masks[:, 3, 5] = True
    masks[:, 0, 1] = False
    masks[0, 4] = False
    ratios = (masks & completion).double().sum(-1) / completion.double().sum(-1).clamp(min=1)
    advantages = torch.randn(batch, generator=g, dtype=torch.float64)
    advantages[0], advantages[1], advantages[5] = -0.7, 0.9, 0.0
    weights = 0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64)
    logp, ratios, advantages, weights = (t.to(dtype) for t in (logp, ratios, advantages, weights))
    return logp.requires_grad_(), masks, ratios, completion, advantages, weights


def grads(loss, logp):
    return torch.autograd.grad(loss, logp, retain_graph=True)[0]


@pytest.mark.parametrize("negative_bound", ["eubo", "mix", "elbo"])
@pytest.mark.parametrize("beta", [1.0, 1.7])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("uncovered", ["spg", "zero"])
def test_matches_reference(negative_bound, beta, weighted, uncovered):
    logp, masks, ratios, completion, adv, w = make_inputs()
    kwargs = dict(negative_bound=negative_bound, beta=beta, mix_weight=0.3, token_weights=w if weighted else None,
                  uncovered=uncovered)
    before = snapshot(logp, masks, ratios, completion, adv, w)
    loss, metrics = spg_loss(logp, masks, ratios, completion, adv, **kwargs)
    want = ref.spg_loss(logp, masks, ratios, completion, adv, **kwargs)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    grad = grads(loss, logp)
    torch.testing.assert_close(grad, grads(want, logp), rtol=1e-12, atol=1e-14)
    assert (grad[:, ~completion] == 0).all() and (grad[~masks] == 0).all()
    assert (grad[:, 0, 1] == 0).all()  # never masked
    assert set(metrics) == ({"elbo_mean", "negative_fraction"} | ({"eubo_mean"} if negative_bound != "elbo" else set()))
    assert metrics["negative_fraction"].item() == (adv < 0).double().mean().item()
    assert_unchanged(before, logp, masks, ratios, completion, adv, w)


def test_float32_close_to_reference():
    logp, masks, ratios, completion, adv, w = make_inputs(seed=1, dtype=torch.float32)
    loss, _ = spg_loss(logp, masks, ratios, completion, adv, beta=1.5, token_weights=w)
    assert loss.dtype == torch.float32
    want = ref.spg_loss(logp, masks, ratios, completion, adv, beta=1.5, token_weights=w)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads(loss, logp).double(), grads(want, logp).double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_one_sample_eubo_has_a_closed_form(beta):
    """n = 1: (1/beta) log((1/t) p^beta) = logp - log(t) / beta for every masked token."""
    logp, masks, ratios, completion, adv, w = make_inputs(num_samples=1, seed=2)
    masks = masks & completion
    got = eubo_scores(logp, masks, ratios, beta, w, uncovered="zero")
    want = torch.where(masks[0], (logp[0] - torch.log(ratios[0].clamp(min=1e-30))[:, None] / beta) * w, torch.zeros_like(w)).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    negative = -adv.abs() - 0.1
    loss, _ = spg_loss(logp, masks, ratios, completion, negative, beta=beta, token_weights=w, uncovered="zero")
    torch.testing.assert_close(loss, -(negative * want).sum() / completion.sum(), rtol=1e-12, atol=1e-14)
    # SPG's rule: the mean over the masked tokens, times the completion length.
    spg = eubo_scores(logp, masks, ratios, beta, w, completion_mask=completion)
    covered = masks[0].sum(-1)
    scaled = torch.where(covered > 0, want * completion.sum(-1) / covered.clamp(min=1), torch.zeros_like(want))
    torch.testing.assert_close(spg, scaled, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("negative_bound", ["eubo", "mix"])
def test_nonnegative_advantages_use_only_the_elbo(negative_bound):
    logp, masks, ratios, completion, adv, w = make_inputs(seed=3)
    positive = adv.abs()
    positive[5] = 0.0
    loss, _ = spg_loss(logp, masks, ratios, completion, positive, negative_bound=negative_bound, beta=1.5, token_weights=w)
    elbo = elbo_sample_scores(logp, masks & completion, ratios, token_weights=w).mean(0)
    want = -(positive * elbo).sum() / completion.sum()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads(loss, logp), grads(want, logp), rtol=1e-12, atol=1e-14)


def test_negative_advantages_use_the_upper_bound_and_mixture():
    logp, masks, ratios, completion, adv, w = make_inputs(seed=4)
    negative = -adv.abs() - 0.1
    elbo = elbo_sample_scores(logp, masks & completion, ratios).mean(0)
    eubo = eubo_scores(logp, masks & completion, ratios, 1.5, completion_mask=completion)
    count = completion.sum()
    for bound, want_bound in (("eubo", eubo), ("mix", 0.25 * eubo + 0.75 * elbo), ("elbo", elbo)):
        loss, _ = spg_loss(logp, masks, ratios, completion, negative, negative_bound=bound, beta=1.5, mix_weight=0.25)
        want = -(negative * want_bound).sum() / count
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grads(loss, logp), grads(want, logp), rtol=1e-12, atol=1e-14)
    assert not torch.allclose(eubo, elbo)


def test_values_outside_the_masks_are_ignored():
    logp, masks, ratios, completion, adv, w = make_inputs(seed=5)
    loss, _ = spg_loss(logp, masks, ratios, completion, adv, negative_bound="mix", token_weights=w)
    used = masks & completion
    nan = torch.full_like(logp, float("nan"))
    dirty_logp = torch.where(used, logp.detach(), nan).requires_grad_()
    dirty_w = torch.where(used.any(0), w, float("inf"))
    dirty, metrics = spg_loss(dirty_logp, masks, ratios, completion, adv, negative_bound="mix", token_weights=dirty_w)
    torch.testing.assert_close(dirty, loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads(dirty, dirty_logp), grads(loss, logp), rtol=1e-12, atol=1e-14)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_eubo_is_stable_for_very_negative_logprobs():
    """Shifting every log-probability by -c shifts each counted token's EUBO term by -c."""
    logp, masks, ratios, completion, adv, w = make_inputs(seed=6)
    masks = masks & completion
    shift = 400.0
    base = eubo_scores(logp, masks, ratios, 1.5, w, uncovered="zero")
    shifted_logp = (logp.detach() - shift).requires_grad_()
    shifted = eubo_scores(shifted_logp, masks, ratios, 1.5, w, uncovered="zero")
    counted = torch.where(masks.any(0), w, torch.zeros_like(w)).sum(-1)
    assert torch.isfinite(shifted).all()
    torch.testing.assert_close(shifted, base - shift * counted, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(grads(shifted.sum(), shifted_logp), grads(base.sum(), logp), rtol=1e-10, atol=1e-14)


def test_global_token_count():
    logp, masks, ratios, completion, adv, w = make_inputs(seed=7)
    loss, _ = spg_loss(logp, masks, ratios, completion, adv)
    scaled, _ = spg_loss(logp, masks, ratios, completion, adv, num_items_in_batch=3.0 * float(completion.sum()))
    torch.testing.assert_close(scaled, loss / 3, rtol=1e-12, atol=1e-14)
    as_tensor, _ = spg_loss(logp, masks, ratios, completion, adv, num_items_in_batch=completion.sum())
    torch.testing.assert_close(as_tensor, loss, rtol=1e-12, atol=1e-14)


def test_compiles_fullgraph():
    torch._dynamo.reset()
    logp, masks, ratios, completion, adv, w = make_inputs(seed=8, dtype=torch.float32)

    def fn(lp):
        return spg_loss(lp, masks, ratios, completion, adv, negative_bound="mix", beta=1.5, token_weights=w)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager, _ = fn(logp)
    got, _ = compiled(logp)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(grads(got, logp), grads(eager, logp))


BAD = {
    "masks shape": (lambda a: {**a, "sample_masks": a["sample_masks"][:2]}, ValueError, r"sample_masks must have shape \[n, B, L\]"),
    "masks dtype": (lambda a: {**a, "sample_masks": a["sample_masks"].float()}, TypeError, "sample_masks must have dtype"),
    "ratios shape": (lambda a: {**a, "mask_ratios": a["mask_ratios"][:, :3]}, ValueError, r"mask_ratios must have shape \[n, B\]"),
    "completion shape": (lambda a: {**a, "completion_mask": a["completion_mask"][None]}, ValueError, r"completion_mask must have shape \[B, L\]"),
    "advantages shape": (lambda a: {**a, "advantages": a["advantages"][:, None]}, ValueError, r"advantages must have shape \[B\]"),
    "weights shape": (lambda a: {**a, "token_weights": a["token_weights"][:, :2]}, ValueError, r"token_weights must have shape \[B, L\]"),
    "logp 2-D": (lambda a: {**a, "sample_logp": a["sample_logp"][0]}, ValueError, "sample_logp must be 3-D"),
    "empty": (lambda a: {**a, "sample_logp": a["sample_logp"][:0]}, ValueError, "sample_logp must be non-empty"),
    "device": (lambda a: {**a, "mask_ratios": a["mask_ratios"].to("meta")}, ValueError, "mask_ratios is on meta"),
    "beta below one": (lambda a: {**a, "beta": 0.5}, ValueError, "beta must be a finite number >= 1"),
    "tensor beta": (lambda a: {**a, "beta": torch.tensor(1.5)}, TypeError, "beta must be a Python float"),
    "mix weight": (lambda a: {**a, "mix_weight": 1.5}, ValueError, r"mix_weight must be a finite number in \[0, 1\]"),
    "unknown bound": (lambda a: {**a, "negative_bound": "renyi"}, ValueError, "negative_bound must be one of 'eubo', 'mix', 'elbo'"),
    "unknown uncovered": (lambda a: {**a, "uncovered": "mean"}, ValueError, "uncovered must be one of 'spg', 'zero'"),
    "items": (lambda a: {**a, "num_items_in_batch": -1}, ValueError, "num_items_in_batch must be a finite number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_rejects_bad_input(case):
    make, error, message = BAD[case]
    logp, masks, ratios, completion, adv, w = make_inputs()
    args = dict(sample_logp=logp, sample_masks=masks, mask_ratios=ratios, completion_mask=completion, advantages=adv, token_weights=w)
    before = snapshot(logp, masks, ratios, completion, adv, w)
    with pytest.raises(error, match=message):
        spg_loss(**make(args))
    assert_unchanged(before, logp, masks, ratios, completion, adv, w)


def test_eubo_scores_rejects():
    logp, masks, ratios, completion, adv, w = make_inputs()
    with pytest.raises(ValueError, match="sample_logp must hold at least one sample"):
        eubo_scores(logp[:0], masks[:0], ratios[:0], 1.0)
    with pytest.raises(ValueError, match=r"sample_masks must have shape \[n, B, L\]"):
        eubo_scores(logp, masks[:, :, :3], ratios, 1.0)
    with pytest.raises(ValueError, match="beta must be a finite number >= 1"):
        eubo_scores(logp, masks, ratios, 0.9)
    with pytest.raises(TypeError, match="token_weights must have dtype"):
        eubo_scores(logp, masks, ratios, 1.0, completion)
    with pytest.raises(ValueError, match="completion_mask is required with uncovered='spg'"):
        eubo_scores(logp, masks, ratios, 1.0)
    with pytest.raises(ValueError, match=r"completion_mask must have shape \[B, L\]"):
        eubo_scores(logp, masks, ratios, 1.0, completion_mask=completion[1:])
    with pytest.raises(ValueError, match="uncovered must be one of 'spg', 'zero'"):
        eubo_scores(logp, masks, ratios, 1.0, completion_mask=completion, uncovered=None)


def spg_released_upper_bound(logp, masks, ratios, completion, beta):
    """SPG's released computation of the upper bound's sequence term, step by step: the mean over
    samples of ``p ** beta * masked / t``, the tokens where it is positive, the mean of its log over
    them divided by beta, and (from its loss) the weight of the completion length."""
    probs = logp.detach().exp().double()
    covered_masks = (masks & completion).double()
    avg = (probs.pow(beta) * covered_masks / ratios.double()[..., None].clamp(min=1e-8)).mean(0)
    loss_mask = avg > 0
    dezero = torch.where(loss_mask, avg, torch.ones_like(avg))
    per_seq = (dezero.log() * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1e-8) / beta
    return per_seq * completion.sum(-1)


def test_uncovered_tokens_follow_spgs_released_rule():
    """Two samples leave tokens of most rows unmasked: SPG averages the covered tokens' terms and
    scales to the completion length; ``"zero"`` is the covered sum, smaller by ``covered / n``."""
    logp, masks, ratios, completion, adv, _ = make_inputs(num_samples=2, seed=9)
    covered = (masks & completion).any(0)
    partial = covered.sum(-1) < completion.sum(-1)
    assert partial.sum() >= 3, "the inputs must leave tokens uncovered"
    spg = eubo_scores(logp, masks, ratios, 1.5, completion_mask=completion)
    torch.testing.assert_close(spg, spg_released_upper_bound(logp, masks, ratios, completion, 1.5), rtol=1e-12, atol=1e-12)
    zero = eubo_scores(logp, masks, ratios, 1.5, completion_mask=completion, uncovered="zero")
    n, c = completion.sum(-1).double(), covered.sum(-1).double()
    torch.testing.assert_close(zero * n / c.clamp(min=1), spg, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(zero[partial], spg[partial])
    negative = -adv.abs() - 0.1
    loss, _ = spg_loss(logp, masks, ratios, completion, negative, negative_bound="eubo", beta=1.5)
    torch.testing.assert_close(loss, -(negative * spg).sum() / completion.sum(), rtol=1e-12, atol=1e-14)
    want = -(negative * spg_released_upper_bound(logp, masks, ratios, completion, 1.5)).sum() / completion.sum()
    torch.testing.assert_close(loss.detach(), want, rtol=1e-12, atol=1e-12)
    grad = grads(loss, logp)
    torch.testing.assert_close(grad, grads(ref.spg_loss(logp, masks, ratios, completion, negative, beta=1.5), logp),
                               rtol=1e-12, atol=1e-14)
