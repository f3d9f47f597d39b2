"""grpo_loss against the token-by-token reference: values, gradients and metrics for every
normalisation, both importance levels and each feature (weights, KL, asymmetric clipping)."""
import math

import pytest
import torch
from support import assert_unchanged, snapshot

from daca_kernels import grpo_loss, k3_kl
from daca_kernels.reference import losses as ref

# Per-row shifts of old_logp: row 0 (A > 0) has ratio ~exp(0.6) and row 1 (A < 0) ~exp(-0.6), so
# both sides of the clip bind at token and at sequence level; rows 4 and 5 (A = 0) lie below and
# above the range; the others stay mostly inside.
ROW_SHIFT = [-0.6, 0.6, 0.0, 0.0, 0.6, -0.6, 0.0, 0.0]


def make_inputs(batch=8, length=7, seed=0, dtype=torch.float64):
    """Random inputs with an all-masked row (2), a single-token row (3), both signs of A and A = 0."""
    g = torch.Generator().manual_seed(seed)
    logp = -(torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 + 0.05)
    shift = torch.tensor(ROW_SHIFT[:batch], dtype=torch.float64)[:, None]
    old = logp + shift + 0.15 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    reference_logp = logp + 0.5 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    advantages = torch.randn(batch, generator=g, dtype=torch.float64)
    advantages[0], advantages[1] = advantages[0].abs() + 0.1, -advantages[1].abs() - 0.1
    advantages[4] = advantages[5] = 0.0  # ratios outside the clip range, but A = 0: not clipped tokens
    mask = torch.rand(batch, length, generator=g) > 0.25
    mask[2] = False
    mask[3] = False
    mask[3, 4] = True
    mask[0, :3] = True
    mask[1, :3] = True
    weights = 0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64)
    cast = [t.to(dtype) for t in (logp, old, reference_logp, advantages, weights)]
    return cast[0].requires_grad_(), cast[1], cast[2], cast[3], mask, cast[4]


FEATURES = {
    "plain": lambda ref_logp, w: {},
    "weights": lambda ref_logp, w: {"token_weights": w},
    "kl": lambda ref_logp, w: {"ref_logp": ref_logp, "beta": 0.04},
    "asymmetric clip": lambda ref_logp, w: {"epsilon": 0.1, "epsilon_high": 0.28},
    "all": lambda ref_logp, w: {"ref_logp": ref_logp, "beta": 0.1, "token_weights": w, "epsilon": 0.15, "epsilon_high": 0.3},
}


def assert_metrics_equal(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].requires_grad is False
        assert abs(float(got[key]) - value) < 1e-12, (key, float(got[key]), value)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_matches_reference(feature, loss_type, importance_sampling_level):
    logp, old, ref_logp, adv, mask, w = make_inputs()
    kwargs = dict(FEATURES[feature](ref_logp, w), loss_type=loss_type, importance_sampling_level=importance_sampling_level)
    before = snapshot(logp, old, ref_logp, adv, mask, w)
    loss, metrics = grpo_loss(logp, old, adv, mask, **kwargs)
    want, want_metrics = ref.grpo_loss(logp, old, adv, mask, **kwargs)
    assert want_metrics["clip_fraction_low"] > 0 and want_metrics["clip_fraction_high"] > 0
    assert want_metrics["clip_fraction"] < 0.75
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
    assert (grad[~mask] == 0).all()
    assert_metrics_equal(metrics, want_metrics)
    assert_unchanged(before, logp, old, ref_logp, adv, mask, w)


TRL_FEATURES = {
    "plain": lambda ref_logp, w: {},
    "weights": lambda ref_logp, w: {"token_weights": w},
    "kl": lambda ref_logp, w: {"ref_logp": ref_logp, "beta": 0.04},
    "bias-corrected kl": lambda ref_logp, w: {"ref_logp": ref_logp, "beta": 0.1, "use_bias_correction_kl": True},
    "all": lambda ref_logp, w: {"ref_logp": ref_logp, "beta": 0.1, "use_bias_correction_kl": True, "token_weights": w,
                                "sapo_temperature_pos": 0.6, "sapo_temperature_neg": 2.0, "vespo_k_pos": 0.5,
                                "vespo_lambda_pos": 1.0, "vespo_k_neg": 1.5, "vespo_lambda_neg": 0.7},
}


@pytest.mark.parametrize("feature", list(TRL_FEATURES))
@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_other_loss_types_match_reference(feature, loss_type, importance_sampling_level):
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=11)
    kwargs = dict(TRL_FEATURES[feature](ref_logp, w), loss_type=loss_type, importance_sampling_level=importance_sampling_level)
    if loss_type == "cispo":
        kwargs["epsilon_high"] = 1.5  # the cap on the ratio binds on rows 0 and 5
    before = snapshot(logp, old, ref_logp, adv, mask, w)
    loss, metrics = grpo_loss(logp, old, adv, mask, **kwargs)
    want, want_metrics = ref.grpo_loss(logp, old, adv, mask, **kwargs)
    if loss_type == "cispo":
        assert want_metrics["clip_fraction_high"] > 0
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
    assert (grad[~mask] == 0).all() and grad.abs().max() > 1e-3
    assert_metrics_equal(metrics, want_metrics)
    assert_unchanged(before, logp, old, ref_logp, adv, mask, w)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_two_sided_clipping_and_bias_corrected_kl_match_reference(loss_type, importance_sampling_level):
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=12)
    adv[5] = -0.7  # row 5's ratio ~exp(0.6) lies above delta: A < 0 makes delta bind
    kwargs = dict(ref_logp=ref_logp, beta=0.05, use_bias_correction_kl=True, token_weights=w, delta=1.5,
                  loss_type=loss_type, importance_sampling_level=importance_sampling_level)
    loss, metrics = grpo_loss(logp, old, adv, mask, **kwargs)
    want, want_metrics = ref.grpo_loss(logp, old, adv, mask, **kwargs)
    assert want_metrics["clip_fraction_delta"] > 0
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(want, logp)[0], rtol=1e-12, atol=1e-14)
    assert_metrics_equal(metrics, want_metrics)
    without, _ = grpo_loss(logp, old, adv, mask, **{**kwargs, "delta": None})
    assert float(without.detach()) != float(loss.detach())


def test_vespo_clamps_match_reference():
    """Per-token log ratios beyond [-20, 20] and sequence sums beyond [log 1e-8, 20]."""
    logp, old, _, adv, mask, w = make_inputs(seed=13)
    old = old.clone()
    old[0, 0] = logp[0, 0].detach() + 25.0
    old[1, :3] = logp[1, :3].detach() + 7.0
    old[6, mask[6]] = logp[6, mask[6]].detach() - 12.0
    kwargs = dict(loss_type="vespo", token_weights=w, vespo_k_pos=0.3, vespo_k_neg=0.2, vespo_lambda_neg=1e-6)
    loss, _ = grpo_loss(logp, old, adv, mask, **kwargs)
    want, _ = ref.grpo_loss(logp, old, adv, mask, **kwargs)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(want, logp)[0], rtol=1e-12, atol=1e-14)


def test_vespo_weight_that_overflows_is_zero_as_in_trl():
    """Large k with a small lambda: phi peaks at ``lam + k log(k / lam) - k`` (about 105 for k = 10,
    lam = 1e-4), past float32's exp range. TRL maps such a weight to 0; so does grpo_loss: a finite
    loss and finite gradients, equal to ``-sum_b phi_b A_b sum_i logp_bi / N`` with that row's phi 0
    (before, an inf loss and NaN gradients)."""
    logp, old, _, adv, mask, _ = make_inputs(seed=14, dtype=torch.float32)
    k, lam = 10.0, 1e-4
    old = old.clone()
    # Row 0 (A > 0): its log ratios sum to log(k / lam), where phi peaks.
    old[0] = torch.where(mask[0], logp[0].detach() - math.log(k / lam) / mask[0].sum(), old[0])
    before = snapshot(logp, old, adv, mask)
    loss, _ = grpo_loss(logp, old, adv, mask, loss_type="vespo", vespo_k_pos=k, vespo_lambda_pos=0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_unchanged(before, logp, old, adv, mask)

    log_w = torch.where(mask, logp.detach() - old, 0.0).double().clamp(-20, 20).sum(1).clamp(math.log(1e-8), 20)
    nonnegative = adv.double() >= 0
    k_b = torch.where(nonnegative, k, 3.0)
    lam_b = torch.where(nonnegative, lam, 2.0)
    log_phi = lam_b + k_b * log_w - lam_b * log_w.exp()
    overflows = log_phi > math.log(torch.finfo(torch.float32).max)
    assert overflows.tolist() == [True] + [False] * (len(adv) - 1), "row 0 alone overflows in float32"
    phi = torch.where(overflows, 0.0, log_phi.exp())
    coefficient = torch.where(mask, -(phi * adv.double())[:, None], 0.0) / mask.sum()
    torch.testing.assert_close(loss.double(), (coefficient * logp.detach().double()).sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), coefficient, rtol=1e-5, atol=1e-7)
    assert (grad[0] == 0).all() and grad[1].abs().max() > 0


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_unclipped_and_on_policy(importance_sampling_level):
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=1)
    wide = dict(epsilon=0.99, epsilon_high=100.0, importance_sampling_level=importance_sampling_level, token_weights=w)
    loss, metrics = grpo_loss(logp, old, adv, mask, **wide)
    want, want_metrics = ref.grpo_loss(logp, old, adv, mask, **wide)
    assert want_metrics["clip_fraction"] == 0 and float(metrics["clip_fraction"]) == 0
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(want, logp)[0], rtol=1e-12, atol=1e-14)

    # old_logp=None: ratio 1, the plain policy gradient -A * w / (number of tokens).
    loss, metrics = grpo_loss(logp, None, adv, mask, token_weights=w, importance_sampling_level=importance_sampling_level)
    count = mask.sum()
    torch.testing.assert_close(loss, -(adv[:, None] * w)[mask].sum() / count, rtol=1e-12, atol=1e-14)
    want_grad = torch.where(mask, -adv[:, None] * w / count, torch.zeros_like(w))
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], want_grad, rtol=1e-12, atol=1e-14)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_float32_inputs_stay_close_to_reference(loss_type):
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=2, dtype=torch.float32)
    kwargs = dict(ref_logp=ref_logp, beta=0.05, token_weights=w, loss_type=loss_type)
    loss, _ = grpo_loss(logp, old, adv, mask, **kwargs)
    assert loss.dtype == torch.float32
    want, _ = ref.grpo_loss(logp, old, adv, mask, **kwargs)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.autograd.grad(loss, logp)[0].double(), torch.autograd.grad(want, logp)[0].double(), rtol=1e-5, atol=1e-6
    )


def test_gspo_gradient_is_the_sequence_objectives():
    """Uniform weights, per-sequence mean: GSPO-token equals GSPO's sequence-level objective in
    value and gradient, clipped sequences included."""
    logp, old, _, adv, mask, _ = make_inputs(seed=3)
    loss, metrics = grpo_loss(logp, old, adv, mask, loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1)
    assert float(metrics["clip_fraction_low"]) > 0 and float(metrics["clip_fraction_high"]) > 0
    want = ref.gspo_sequence_loss(logp, old, adv, mask, eps=0.1)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(want, logp)[0], rtol=1e-12, atol=1e-14)


def test_dapo_global_token_count_splits_over_processes():
    """Two 'processes' holding half the batch each, with DDP's gradient averaging: passing
    global tokens / 2 reproduces the single-process loss and gradient."""
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=4)
    kwargs = dict(ref_logp=ref_logp, beta=0.02, token_weights=w)
    full, _ = grpo_loss(logp, old, adv, mask, **kwargs)
    half_count = mask.sum() / 2
    parts = []
    for rows in (slice(0, 4), slice(4, 8)):
        part_kwargs = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        part, _ = grpo_loss(logp[rows], old[rows], adv[rows], mask[rows], num_items_in_batch=half_count, **part_kwargs)
        parts.append(part)
    averaged = (parts[0] + parts[1]) / 2
    torch.testing.assert_close(averaged, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(averaged, logp)[0], torch.autograd.grad(full, logp)[0], rtol=1e-12, atol=1e-14)
    as_float, _ = grpo_loss(logp, old, adv, mask, num_items_in_batch=float(mask.sum()) * 3, **kwargs)
    torch.testing.assert_close(as_float, full / 3, rtol=1e-12, atol=1e-14)


def trl_dr_grpo(per_token_loss, completion_mask, max_completion_length):
    """TRL's ``GRPOTrainer._compute_loss`` for ``loss_type="dr_grpo"`` on its ``[B, G]`` completion layout."""
    return (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * max_completion_length)


def test_dr_grpo_normaliser_is_the_completion_width_in_either_layout():
    logp, old, _, adv, mask, _ = make_inputs(seed=5)
    batch, width = mask.shape
    assert mask.any(0).all(), "every completion column is used by some row"
    loss, _ = grpo_loss(logp, old, adv, mask, loss_type="dr_grpo", max_completion_length=32)
    want, _ = ref.grpo_loss(logp, old, adv, mask, loss_type="dr_grpo", max_completion_length=32)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    # TRL's formula on the [B, G] layout (ratio 1: the per-token loss is -A).
    per_token = -adv[:, None].expand(batch, width)
    default, _ = grpo_loss(logp, None, adv, mask, loss_type="dr_grpo")
    torch.testing.assert_close(default, trl_dr_grpo(per_token, mask, width), rtol=1e-12, atol=1e-14)
    # The [B, P + G] layout: prompt columns hold no mask token and are not counted.
    prompt = 5
    padded = lambda t, fill: torch.cat([torch.full((batch, prompt), fill, dtype=t.dtype), t], dim=1)  # noqa: E731
    full_logp = padded(logp.detach(), -1.0).requires_grad_()
    full, _ = grpo_loss(full_logp, None, adv, padded(mask, False), loss_type="dr_grpo")
    torch.testing.assert_close(full, default, rtol=1e-12, atol=1e-14)
    full_want, _ = ref.grpo_loss(full_logp, padded(old, -1.0), adv, padded(mask, False), loss_type="dr_grpo")
    full_with_old, _ = grpo_loss(full_logp, padded(old, -1.0), adv, padded(mask, False), loss_type="dr_grpo")
    torch.testing.assert_close(full_with_old, full_want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(full_with_old, full_logp, retain_graph=True)[0],
                               torch.autograd.grad(full_want, full_logp)[0], rtol=1e-12, atol=1e-14)
    # Completions that all end before the last generated column: the default counts the used
    # columns; the generation length G gives TRL's normaliser (what the loop passes).
    short = mask.clone()
    short[:, -2:] = False
    used, _ = grpo_loss(logp, None, adv, short, loss_type="dr_grpo")
    torch.testing.assert_close(used, trl_dr_grpo(per_token, short, width - 2), rtol=1e-12, atol=1e-14)
    with_g, _ = grpo_loss(logp, None, adv, short, loss_type="dr_grpo", max_completion_length=width)
    torch.testing.assert_close(with_g, trl_dr_grpo(per_token, short, width), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_values_outside_the_mask_are_ignored(importance_sampling_level):
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=6)
    kwargs = dict(beta=0.05, importance_sampling_level=importance_sampling_level, loss_type="grpo")
    clean, _ = grpo_loss(logp, old, adv, mask, ref_logp=ref_logp, token_weights=w, **kwargs)
    clean_grad = torch.autograd.grad(clean, logp)[0]
    junk = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64).repeat(50)[: mask.numel()].view_as(mask)

    def poison(t):
        return torch.where(mask, t.detach(), junk)

    dirty_logp = poison(logp).requires_grad_()
    dirty, metrics = grpo_loss(dirty_logp, poison(old), adv, mask, ref_logp=poison(ref_logp), token_weights=poison(w), **kwargs)
    torch.testing.assert_close(dirty, clean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(dirty, dirty_logp)[0], clean_grad, rtol=1e-12, atol=1e-14)
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
def test_all_masked_batch_gives_zero(loss_type, importance_sampling_level):
    logp, old, ref_logp, adv, mask, _ = make_inputs(seed=7)
    none = torch.zeros_like(mask)
    loss, metrics = grpo_loss(logp, old, adv, none, ref_logp=ref_logp, beta=0.1, loss_type=loss_type, importance_sampling_level=importance_sampling_level)
    assert loss.item() == 0.0
    assert (torch.autograd.grad(loss, logp)[0] == 0).all()
    assert all(float(v) == 0.0 for k, v in metrics.items())


def test_k3_kl():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    kl = k3_kl(a, b)
    assert (kl >= 0).all()
    assert (k3_kl(a, a) == 0).all()
    torch.testing.assert_close(kl, torch.exp(a - b) - (a - b) - 1)


@pytest.mark.parametrize("importance_sampling_level, loss_type", [("token", "dapo"), ("sequence", "dapo"), ("token", "vespo"),
                                                       ("sequence", "sapo")])
def test_compiles_fullgraph_like_eager(importance_sampling_level, loss_type):
    torch._dynamo.reset()
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=9, dtype=torch.float32)
    extra = {} if loss_type == "dapo" else {"use_bias_correction_kl": True}

    def fn(lp, n):
        return grpo_loss(lp, old, adv, mask, ref_logp=ref_logp, token_weights=w, beta=0.04, epsilon_high=0.28,
                         importance_sampling_level=importance_sampling_level, loss_type=loss_type,
                         num_items_in_batch=None if loss_type == "sapo" else n, **extra)

    count = mask.sum().float()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager_loss, eager_metrics = fn(logp, count)
    compiled_loss, compiled_metrics = compiled(logp, count)
    torch.testing.assert_close(compiled_loss, eager_loss)
    torch.testing.assert_close(torch.autograd.grad(compiled_loss, logp)[0], torch.autograd.grad(eager_loss, logp)[0])
    for key in eager_metrics:
        torch.testing.assert_close(compiled_metrics[key], eager_metrics[key])


BAD = {
    "old shape": (lambda t: dict(old_logp=t["old"][:, :5]), ValueError, r"old_logp must have shape \[B, L\] = \(8, 7\)"),
    "advantages per token": (lambda t: dict(advantages=t["old"]), ValueError, r"advantages must have shape \[B\]"),
    "mask shape": (lambda t: dict(mask=t["mask"][:4]), ValueError, r"mask must have shape \[B, L\]"),
    "mask not bool": (lambda t: dict(mask=t["mask"].float()), TypeError, "mask must have dtype in \\(bool\\)"),
    "ref shape": (lambda t: dict(ref_logp=t["old"].T, beta=0.1), ValueError, "ref_logp must have shape"),
    "weights shape": (lambda t: dict(token_weights=t["old"][:, :1]), ValueError, "token_weights must have shape"),
    "integer logp": (lambda t: dict(logp=t["mask"].long()), TypeError, "logp must have dtype"),
    "logp 1-D": (lambda t: dict(logp=t["old"][0]), ValueError, "logp must be 2-D"),
    "empty": (lambda t: dict(logp=t["old"][:0], old_logp=t["old"][:0], advantages=t["old"][:0, 0], mask=t["mask"][:0]), ValueError, "logp must be non-empty"),
    "device": (lambda t: dict(old_logp=t["old"].to("meta")), ValueError, "old_logp is on meta but logp is on cpu"),
    "beta without ref": (lambda t: dict(beta=0.1), ValueError, "ref_logp is required when beta > 0"),
    "negative beta": (lambda t: dict(beta=-0.1), ValueError, "beta must be a finite number"),
    "tensor eps": (lambda t: dict(epsilon=torch.tensor(0.2)), TypeError, "epsilon must be a Python float"),
    "epsilon one": (lambda t: dict(epsilon=1.0), ValueError, r"epsilon must be a finite number in \[0, 1\)"),
    "negative epsilon_high": (lambda t: dict(epsilon_high=-0.1), ValueError, "epsilon_high must be a finite number"),
    "nan epsilon_high": (lambda t: dict(epsilon_high=float("nan")), ValueError, "epsilon_high must be a finite number"),
    "unknown loss type": (lambda t: dict(loss_type="ppo"), ValueError, "loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'"),
    "unknown level": (lambda t: dict(importance_sampling_level="sentence"), ValueError, "importance_sampling_level must be one of 'token', 'sequence'"),
    "max length for dapo": (lambda t: dict(max_completion_length=16), ValueError, "max_completion_length is only used by loss_type='dr_grpo'"),
    "zero max length": (lambda t: dict(loss_type="dr_grpo", max_completion_length=0), ValueError, "max_completion_length must be >= 1"),
    "items for bnpo": (lambda t: dict(loss_type="bnpo", num_items_in_batch=10), ValueError, r"num_items_in_batch is only used by loss_type in \('dapo', 'cispo', 'vespo'\)"),
    "zero items": (lambda t: dict(num_items_in_batch=0), ValueError, "num_items_in_batch must be a finite number"),
    "items for luspo": (lambda t: dict(loss_type="luspo", num_items_in_batch=10), ValueError, "num_items_in_batch is only used by"),
    "cispo without cap": (lambda t: dict(loss_type="cispo"), ValueError, "epsilon_high is required with loss_type='cispo'"),
    "delta below clip": (lambda t: dict(delta=1.1, epsilon_high=0.2), ValueError, "delta must be a finite number >= 1.2"),
    "delta for sapo": (lambda t: dict(loss_type="sapo", delta=2.0), ValueError, "delta is only used by the clipped loss types"),
    "tensor delta": (lambda t: dict(delta=torch.tensor(2.0)), TypeError, "delta must be a Python float"),
    "bias correction not bool": (lambda t: dict(use_bias_correction_kl=1), TypeError, "use_bias_correction_kl must be a bool"),
    "zero sapo temperature": (lambda t: dict(loss_type="sapo", sapo_temperature_neg=0.0), ValueError, "sapo_temperature_neg must be a finite number"),
    "negative vespo k": (lambda t: dict(loss_type="vespo", vespo_k_pos=-1.0), ValueError, "vespo_k_pos must be a finite number"),
    "negative vespo lambda": (lambda t: dict(loss_type="vespo", vespo_lambda_neg=-0.5), ValueError, "vespo_lambda_neg must be a finite number"),
    "items vector": (lambda t: dict(num_items_in_batch=torch.ones(2)), ValueError, "num_items_in_batch must be a number or a 0-d tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_rejects_bad_input(case):
    make, error, message = BAD[case]
    logp, old, ref_logp, adv, mask, w = make_inputs(seed=10)
    override = make({"old": old, "mask": mask})
    args = {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask}
    kwargs = {}
    for key, value in override.items():
        (args if key in args else kwargs)[key] = value
    before = snapshot(logp, old, ref_logp, adv, mask, w)
    with pytest.raises(error, match=message):
        grpo_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], **kwargs)
    assert_unchanged(before, logp, old, ref_logp, adv, mask, w)
