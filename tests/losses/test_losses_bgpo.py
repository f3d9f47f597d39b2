"""BGPO: the bound against its loop reference, its on-policy equivalence with the ELBO-based
objective, the bound property, and sample-by-sample backward against all-at-once."""
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from support import assert_model_gradients_close, assert_unchanged, snapshot
from torch import nn

from daca_kernels import bgpo_backward, bgpo_loss, elbo_sample_scores
from daca_kernels.reference import losses as ref


def make_scores(num_samples=3, batch=6, seed=0, drift=0.3):
    """Sequence scores l_j [n, B] (current, with grad), old scores, and advantages of both signs
    (including 0)."""
    g = torch.Generator().manual_seed(seed)
    scores = -(torch.rand(num_samples, batch, generator=g, dtype=torch.float64) * 5 + 0.1)
    old = scores + drift * torch.randn(num_samples, batch, generator=g, dtype=torch.float64)
    advantages = torch.randn(batch, generator=g, dtype=torch.float64)
    advantages[0], advantages[1], advantages[2] = 0.8, -0.6, 0.0
    return scores.requires_grad_(), old, advantages


def make_samples(num_samples=3, batch=4, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -(torch.rand(num_samples, batch, length, generator=g, dtype=torch.float64) * 4 + 0.05)
    masks = torch.rand(num_samples, batch, length, generator=g) < 0.5
    masks[0, 0] = False  # sample 0 masks nothing of row 0, and says t = 0
    ratios = masks.double().mean(dim=-1).clamp(min=1 / length)
    ratios[0, 0] = 0.0
    weights = 0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64)
    return logp.requires_grad_(), masks, ratios, weights


@pytest.mark.parametrize("weighted", [False, True])
def test_elbo_sample_scores_match_reference(weighted):
    logp, masks, ratios, weights = make_samples()
    w = weights if weighted else None
    before = snapshot(logp, masks, ratios, weights)
    got = elbo_sample_scores(logp, masks, ratios, token_weights=w)
    want = ref.elbo_sample_scores(logp, masks, ratios, w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), logp)[0], torch.autograd.grad(want.sum(), logp)[0], rtol=1e-12, atol=1e-14)
    assert got[0, 0].item() == 0.0
    # One sample as [B, L] gives that sample's row; junk outside the masks is ignored.
    nan = torch.full_like(logp[1], float("nan"))
    junk_logp = torch.where(masks[1], logp[1].detach(), nan)
    junk_w = None if w is None else torch.where(masks[1], w, nan)
    single = elbo_sample_scores(junk_logp, masks[1], ratios[1], token_weights=junk_w)
    torch.testing.assert_close(single, got[1].detach(), rtol=1e-12, atol=1e-14)
    assert_unchanged(before, logp, masks, ratios, weights)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_matches_reference(num_samples):
    scores, old, adv = make_scores(num_samples)
    before = snapshot(scores, old, adv)
    loss, metrics = bgpo_loss(scores, old, adv)
    want = ref.bgpo_loss(scores, old, adv)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, scores)[0], torch.autograd.grad(want, scores)[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["sample_log_ratio_mean"], (scores - old).mean().detach(), rtol=1e-12, atol=1e-14)
    assert_unchanged(before, scores, old, adv)


def test_on_policy_equals_the_elbo_objective_in_value_and_gradient():
    scores, _, adv = make_scores(num_samples=4, seed=1)
    old = scores.detach()
    loss, _ = bgpo_loss(scores, old, adv)
    objective = ref.elbo_ratio_objective(scores, old, adv)
    torch.testing.assert_close(loss, objective, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss.detach(), -adv.mean(), rtol=1e-12, atol=1e-14)
    grad = torch.autograd.grad(loss, scores)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(objective, scores)[0], rtol=1e-12, atol=1e-14)
    # = the gradient of -(1/B) sum_b A_b * mean_j l_jb: A times the gradient of the mean ELBO.
    torch.testing.assert_close(grad, (-adv / (4 * adv.shape[0])).expand(4, -1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", range(4))
def test_is_a_lower_bound_of_the_elbo_objective(seed):
    scores, old, adv = make_scores(num_samples=3, seed=seed, drift=1.0)
    loss, _ = bgpo_loss(scores, old, adv)
    objective = ref.elbo_ratio_objective(scores, old, adv)
    assert loss.item() > objective.item()  # loss = -bound >= -objective, strictly off-policy


def test_large_log_ratio_with_positive_advantage_has_finite_gradient():
    scores = torch.tensor([[800.0, -5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = bgpo_loss(scores, old, adv)
    grad = torch.autograd.grad(loss, scores)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5 * torch.exp(torch.tensor(-5.0)).item()]], dtype=torch.float64))


class TinyMaskedModel(nn.Module):
    """Embedding -> MLP -> vocabulary logits: a bidirectional-free stand-in for a masked LM."""

    def __init__(self, vocab=11, hidden=16, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab + 1, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, vocab))
        self.mask_id = vocab
        self.double()

    def token_logp(self, tokens, masks):
        h = self.embed(torch.where(masks, self.mask_id, tokens))
        h = h + h.mean(dim=-2, keepdim=True)  # every position sees the sequence
        return torch.log_softmax(self.mlp(h), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def model_case(num_samples=5, batch=4, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (batch, length), generator=g)
    masks = torch.rand(num_samples, batch, length, generator=g) < 0.5
    ratios = masks.double().mean(dim=-1).clamp(min=1 / length)
    weights = 0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64)
    advantages = torch.randn(batch, generator=g, dtype=torch.float64)
    advantages[0], advantages[1] = 1.0, -1.0
    model = TinyMaskedModel(seed=seed)
    old_model = TinyMaskedModel(seed=seed + 100)
    with torch.no_grad():
        old = torch.stack([elbo_sample_scores(old_model.token_logp(tokens, masks[j]), masks[j], ratios[j], token_weights=weights) for j in range(num_samples)])
    return model, tokens, masks, ratios, weights, advantages, old


def test_sample_by_sample_backward_equals_all_at_once():
    model, tokens, masks, ratios, weights, adv, old = model_case()
    n = masks.shape[0]

    def sample_fn(j):
        return elbo_sample_scores(model.token_logp(tokens, masks[j]), masks[j], ratios[j], token_weights=weights)

    all_scores = torch.stack([sample_fn(j) for j in range(n)])
    assert ((all_scores - old).abs() > 0.1).any()  # genuinely off-policy
    want, want_metrics = bgpo_loss(all_scores, old, adv)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    loss, metrics = bgpo_backward(sample_fn, n, old, adv)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(metrics["sample_log_ratio_mean"], want_metrics["sample_log_ratio_mean"], rtol=1e-12, atol=1e-14)
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)


def test_each_samples_graph_is_freed_before_the_next_sample():
    model, tokens, masks, ratios, weights, adv, old = model_case(num_samples=4)
    activations = []

    def sample_fn(j):
        assert all(ref() is None for ref in activations), "an earlier sample's graph is still alive"
        h = model.embed(torch.where(masks[j], model.mask_id, tokens))
        activations.append(weakref.ref(h))
        logp = torch.log_softmax(model.mlp(h * h), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        return elbo_sample_scores(logp, masks[j], ratios[j])

    gc.collect()
    bgpo_backward(sample_fn, 4, old, adv)
    assert len(activations) == 4


def test_memory_benchmark_cases_agree():
    """The two cases of benchmarks/memory_bgpo.py compute the same loss gradients (so their peaks
    compare like with like), at a tiny size."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import memory_bgpo

    grads = {}
    for name, case in memory_bgpo.CASES.items():
        setup, run = case(n=3, batch=2, length=8, vocab=16, hidden=8, ffn=8)
        inputs = setup()
        run(*inputs)
        grads[name] = [p.grad for p in inputs[0].parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads["all_at_once"])
    assert_model_gradients_close(grads["sample_by_sample"], grads["all_at_once"])


def test_compiles_fullgraph():
    torch._dynamo.reset()
    logp, masks, ratios, weights = make_samples()
    _, old, adv = make_scores(num_samples=3, batch=4)

    def fn(lp):
        return bgpo_loss(elbo_sample_scores(lp, masks, ratios, token_weights=weights), old, adv)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager, _ = fn(logp)
    got, _ = compiled(logp)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(torch.autograd.grad(got, logp)[0], torch.autograd.grad(eager, logp)[0])


LOSS_CASES = {
    "old shape": (lambda s, o, a: (s, o[:, :3], a), ValueError, r"old_sample_logp must have shape \[n, B\] = \(3, 6\)"),
    "advantages shape": (lambda s, o, a: (s, o, a[:5]), ValueError, r"advantages must have shape \[B\]"),
    "scores 1-D": (lambda s, o, a: (s[0], o, a), ValueError, "sample_logp must be 2-D"),
    "integer advantages": (lambda s, o, a: (s, o, a.long()), TypeError, "advantages must have dtype"),
    "empty": (lambda s, o, a: (s[:0], o[:0], a), ValueError, "sample_logp must be non-empty"),
    "device": (lambda s, o, a: (s, o.to("meta"), a), ValueError, "old_sample_logp is on meta"),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_bgpo_loss_rejects(case):
    make, error, message = LOSS_CASES[case]
    scores, old, adv = make_scores()
    before = snapshot(scores, old, adv)
    with pytest.raises(error, match=message):
        bgpo_loss(*make(scores, old, adv))
    assert_unchanged(before, scores, old, adv)


def test_bgpo_backward_rejects():
    scores, old, adv = make_scores()
    fn = lambda j: scores[j]  # noqa: E731
    with pytest.raises(TypeError, match="sample_fn must be callable"):
        bgpo_backward(None, 3, old, adv)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        bgpo_backward(fn, 0, old, adv)
    with pytest.raises(TypeError, match="num_samples must be an int"):
        bgpo_backward(fn, 3.0, old, adv)
    with pytest.raises(ValueError, match="old_sample_logp must have num_samples = 2 rows"):
        bgpo_backward(fn, 2, old, adv)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
        bgpo_backward(fn, 3, old, adv[:2])
    with pytest.raises(ValueError, match=r"sample_fn\(0\) must have shape \[B\]"):
        bgpo_backward(lambda j: scores[j, :2], 3, old, adv)
    with pytest.raises(ValueError, match=r"sample_fn\(0\) must return scores that require grad"):
        bgpo_backward(lambda j: scores[j].detach(), 3, old, adv)
    with pytest.raises(TypeError, match="backward must be callable"):
        bgpo_backward(fn, 3, old, adv, backward=None)
    with pytest.raises(TypeError, match="keep_last must be a bool"):
        bgpo_backward(fn, 3, old, adv, keep_last=1)
    with pytest.raises(ValueError, match=r"sample_fn\(0\) must have shape \[B\]"):
        bgpo_backward(lambda j: scores[j, :2], 3, None, adv)


def test_bgpo_backward_through_a_hook_on_policy_and_keeping_the_last_share():
    """``old_sample_logp=None`` is each sample's own scores detached; ``backward`` runs every share
    (or all but the last, returned with its graph, with ``keep_last``); the gradients are the plain loss's."""
    model, tokens, masks, ratios, weights, adv, _ = model_case()
    n = masks.shape[0]

    def sample_fn(j):
        return elbo_sample_scores(model.token_logp(tokens, masks[j]), masks[j], ratios[j], token_weights=weights)

    scores = torch.stack([sample_fn(j) for j in range(n)])
    want, _ = bgpo_loss(scores, scores.detach(), adv)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    for keep_last in (False, True):
        model.zero_grad()
        calls = []
        loss, _ = bgpo_backward(sample_fn, n, None, adv, backward=lambda t: calls.append(t) or t.backward(),
                                keep_last=keep_last)
        assert len(calls) == (n - 1 if keep_last else n) and loss.requires_grad == keep_last
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-14)
        if keep_last:
            loss.backward()
        for p, g in zip(model.parameters(), want_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)


SCORE_CASES = {
    "mask shape": (lambda lp, m, t, w: (lp, m[:, :, :4], t, w), ValueError, r"sample_masks must have shape \[n, B, L\]"),
    "mask dtype": (lambda lp, m, t, w: (lp, m.long(), t, w), TypeError, "sample_masks must have dtype"),
    "ratios shape": (lambda lp, m, t, w: (lp, m, t[0], w), ValueError, r"mask_ratios must have shape \[n, B\]"),
    "weights shape": (lambda lp, m, t, w: (lp, m, t, w[None]), ValueError, r"token_weights must have shape \[B, L\]"),
    "4-D": (lambda lp, m, t, w: (lp[None], m[None], t[None], w), ValueError, r"sample_logp must be \[n, B, L\] or \[B, L\]"),
}


@pytest.mark.parametrize("case", list(SCORE_CASES))
def test_elbo_sample_scores_rejects(case):
    make, error, message = SCORE_CASES[case]
    logp, masks, ratios, weights = make_samples()
    lp, m, t, w = make(logp, masks, ratios, weights)
    with pytest.raises(error, match=message):
        elbo_sample_scores(lp, m, t, token_weights=w)
