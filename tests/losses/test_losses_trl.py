"""grpo_loss against the installed TRL's own ``GRPOTrainer._compute_loss`` on the same tensors.

``_compute_loss`` is called unbound on a stand-in that carries only the attributes it reads; its
model forward is replaced by returning the test's per-token log-probabilities, so values and
gradients with respect to them are compared for every loss type of TRL, both importance-sampling
levels, with and without the KL (plain and bias-corrected) and with two-sided clipping.
Skipped when TRL is not installed.
"""
import dataclasses
import inspect
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from daca_kernels import grpo_loss  # noqa: E402

# The keywords of grpo_loss that are TRL GRPOConfig fields, named as TRL names them.
TRL_FIELDS = (
    "beta", "epsilon", "epsilon_high", "delta", "loss_type", "importance_sampling_level", "use_bias_correction_kl",
    "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg",
)
TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in TRL_FIELDS}
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
CISPO_CAP = 1.5  # below the largest ratios of the inputs, so that the cap binds


def make_inputs(seed=0):
    """Float64 ``[8, 9]`` inputs whose rows cover A > 0 with r above the clip range, A < 0 below it,
    A < 0 above it (where ``delta`` binds), A > 0 below it, ratios near 1, an empty row (6) and a
    single-token row (7); values outside the mask are finite (TRL multiplies by the mask)."""
    g = torch.Generator().manual_seed(seed)
    batch, length = 8, 9
    logp = -(torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 + 0.05)
    shift = torch.tensor([-0.6, 0.6, -0.6, 0.6, 0.0, 0.0, 0.0, -0.3], dtype=torch.float64)[:, None]
    old = logp + shift + 0.15 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.5 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    sign = torch.tensor([1, -1, -1, 1, 1, -1, 1, -1], dtype=torch.float64)
    advantages = sign * (0.2 + torch.rand(batch, generator=g, dtype=torch.float64))
    mask = torch.rand(batch, length, generator=g) > 0.3
    mask[:4, :4] = True
    mask[6] = False
    mask[7] = False
    mask[7, 5] = True
    return logp.requires_grad_(), old, ref_logp, advantages, mask


class TrainerStandIn:
    """What ``GRPOTrainer._compute_loss`` reads from ``self``: one process, no gradient
    accumulation, no vLLM, no entropy mask or bonus, no off-policy mask."""

    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)

    def __init__(self, logp, config):
        self._logp = logp
        self.args = SimpleNamespace(**config, steps_per_generation=1)
        self.loss_type = config["loss_type"]
        self.importance_sampling_level = config["importance_sampling_level"]
        self.beta = config["beta"]
        self.epsilon_low = config["epsilon"]
        self.epsilon_high = config["epsilon"] if config["epsilon_high"] is None else config["epsilon_high"]
        self.max_completion_length = logp.shape[1]
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(
            num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t, reduce=lambda t, reduction: t
        )
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == self._logp.shape[1]
        return self._logp, torch.zeros_like(self._logp), None


def trl_loss(logp, old, ref_logp, advantages, mask, **kwargs):
    """TRL's loss on these tensors, with grpo_loss's keywords translated to GRPOConfig's fields
    (TRL's defaults for the others)."""
    config = dict(TRL_DEFAULTS)
    config.update(kwargs)
    batch, length = logp.shape
    completion_mask = mask.long()
    inputs = {
        "prompt_ids": torch.zeros(batch, 3, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 3, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),
    }
    if config["beta"] != 0.0:
        inputs["ref_per_token_logps"] = ref_logp
    stand_in = TrainerStandIn(logp, config)
    return GRPOTrainer._compute_loss(stand_in, None, inputs), stand_in._metrics["train"]


def ours(logp, old, ref_logp, advantages, mask, **kwargs):
    """grpo_loss with TRL's defaults for the keywords not given (TRL's bias-corrected KL
    included), and Dr. GRPO's constant the completion width, TRL's ``max_completion_length``."""
    defaults = {name: TRL_DEFAULTS[name] for name in TRL_FIELDS if name != "epsilon_high"}
    options = {**defaults, **kwargs}
    if options["loss_type"] == "dr_grpo":
        options["max_completion_length"] = logp.shape[1]
    return grpo_loss(logp, old, advantages, mask, ref_logp=ref_logp if options["beta"] > 0 else None, **options)


def assert_same_as_trl(kwargs, seed=0, inputs=None, rtol=1e-10):
    logp, old, ref_logp, advantages, mask = make_inputs(seed) if inputs is None else inputs
    want, trl_metrics = trl_loss(logp, old, ref_logp, advantages, mask, **kwargs)
    (want_grad,) = torch.autograd.grad(want, logp)
    loss, metrics = ours(logp, old, ref_logp, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    assert want_grad.abs().max() > 1e-3, "TRL's gradient vanishes: the comparison would mean little"
    torch.testing.assert_close(loss, want, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=rtol, atol=1e-12)
    return metrics, trl_metrics


def test_defaults_are_trls():
    """Every keyword named after a GRPOConfig field defaults to TRL's value, except the KL bias
    correction (False here, True in TRL)."""
    signature = inspect.signature(grpo_loss).parameters
    assert TRL_DEFAULTS["use_bias_correction_kl"] is True
    assert signature["use_bias_correction_kl"].default is False
    for name in TRL_FIELDS:
        if name not in ("use_bias_correction_kl", "importance_sampling_level", "epsilon_high"):
            assert signature[name].default == TRL_DEFAULTS[name], name
    assert TRL_DEFAULTS["epsilon_high"] is None and signature["epsilon_high"].default is None
    assert signature["importance_sampling_level"].default == TRL_DEFAULTS["importance_sampling_level"] == "token"


@pytest.mark.parametrize("kl", ["none", "k3", "bias corrected"])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type, importance_sampling_level, kl):
    kwargs = dict(loss_type=loss_type, importance_sampling_level=importance_sampling_level, epsilon=0.2, epsilon_high=0.28)
    if loss_type == "cispo":
        kwargs["epsilon_high"] = CISPO_CAP
    if loss_type == "sapo":  # exact in float32 (see test_sapo_default_temperatures_match_trl_to_float32)
        kwargs["sapo_temperature_neg"] = 1.25
    if kl != "none":
        kwargs.update(beta=0.04, use_bias_correction_kl=kl == "bias corrected")
    else:
        kwargs.update(use_bias_correction_kl=False)
    metrics, trl_metrics = assert_same_as_trl(kwargs)
    if loss_type == "cispo":
        assert float(metrics["clip_fraction_high"]) > 0
        if importance_sampling_level == "token":  # TRL averages sequence-level flags per sequence, we per token
            assert float(metrics["clip_fraction_high"]) == pytest.approx(trl_metrics["cispo_clip_ratio"][0])
    elif loss_type not in ("sapo", "vespo"):
        assert float(metrics["clip_fraction_low"]) > 0 and float(metrics["clip_fraction_high"]) > 0
        if importance_sampling_level == "token":
            assert float(metrics["clip_fraction_low"]) == pytest.approx(trl_metrics["clip_ratio/low_mean"][0])
            assert float(metrics["clip_fraction_high"]) == pytest.approx(trl_metrics["clip_ratio/high_mean"][0])


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_two_sided_clipping_matches_trl(loss_type, importance_sampling_level):
    kwargs = dict(loss_type=loss_type, importance_sampling_level=importance_sampling_level, delta=1.4, beta=0.02,
                  use_bias_correction_kl=True)
    metrics, _ = assert_same_as_trl(kwargs, seed=1)
    assert float(metrics["clip_fraction_delta"]) > 0, "delta binds on some A < 0 token"
    without, _ = ours(*make_inputs(seed=1), **{**kwargs, "delta": None})
    with_delta, _ = ours(*make_inputs(seed=1), **kwargs)
    assert float(with_delta.detach()) != float(without.detach())


@pytest.mark.parametrize("loss_type", ["sapo", "vespo"])
def test_non_default_temperatures_and_gamma_match_trl(loss_type):
    kwargs = dict(loss_type=loss_type, sapo_temperature_pos=0.75, sapo_temperature_neg=2.5, vespo_k_pos=0.5,
                  vespo_lambda_pos=1.5, vespo_k_neg=1.0, vespo_lambda_neg=0.5, use_bias_correction_kl=False)
    assert_same_as_trl(kwargs, seed=2)


def test_sapo_default_temperatures_match_trl_to_float32():
    """TRL picks the temperature per token with ``torch.where`` of two Python floats, which rounds
    them to float32 (1.05 by ~2e-8 relative); grpo_loss keeps them in the compute dtype. In float64
    the two agree to that rounding."""
    for importance_sampling_level in ("token", "sequence"):
        assert_same_as_trl(dict(loss_type="sapo", importance_sampling_level=importance_sampling_level, beta=0.04), rtol=1e-6)


def test_vespo_clamps_match_trl():
    """Log ratios beyond VESPO's clamps: a token below -20, a sequence whose clamped sum is below
    log(1e-8), one above 20; small k so that the clamped weights are not negligible."""
    logp, old, ref_logp, advantages, mask = make_inputs(seed=3)
    old = old.clone()
    old[0, 0] = logp[0, 0].detach() + 25.0  # token log ratio -25, clamped to -20
    old[1, :4] = logp[1, :4].detach() + 6.0  # sum below log(1e-8)
    old[2, :4] = logp[2, :4].detach() - 6.0  # sum above 20
    # k and lambda exact in float32, where TRL's torch.where of Python floats puts them.
    kwargs = dict(loss_type="vespo", vespo_k_pos=0.25, vespo_lambda_pos=1e-6, vespo_k_neg=0.125, vespo_lambda_neg=0.0,
                  use_bias_correction_kl=False)
    assert_same_as_trl(kwargs, inputs=(logp, old, ref_logp, advantages, mask))


def test_vespo_weight_that_overflows_is_dropped_as_in_trl():
    """Row 0 (A > 0) has its log ratios summing to log(k / lam), where phi peaks at
    ``lam + k log(k / lam) - k`` (about 872 for k = 70, lam = 1e-4): exp overflows even in float64.
    TRL's ``get_gamma_weights`` maps that weight to 0 (its sequence gets no gradient); grpo_loss
    agrees with TRL's weights and with its loss and gradient, all finite."""
    logp, old, ref_logp, advantages, mask = make_inputs(seed=5)
    k = 70.0  # exact in float32, where TRL's torch.where of Python floats puts it
    old = old.clone()
    old[0] = torch.where(mask[0], logp[0].detach() - math.log(k / 1e-4) / mask[0].sum(), old[0])
    old[4] = logp[4].detach()  # the other A > 0 rows: ratio 1 (phi = 1) and ratios below 1 (phi ~ 0)
    assert advantages[0] > 0 and advantages[4] > 0
    log_ratio = torch.where(mask, logp.detach() - old, 0.0)
    phi = GRPOTrainer.get_gamma_weights(advantages[:, None], log_ratio, mask.double(), None, k_pos=k, lambda_pos=0.0)
    assert phi[0].item() == 0.0 and torch.isfinite(phi).all() and phi[4].item() == 1.0
    with torch.no_grad():
        unguarded = torch.exp(1e-4 + k * log_ratio[0].sum() - 1e-4 * log_ratio[0].sum().exp())
    assert torch.isinf(unguarded), "row 0's weight overflows before TRL's guard"
    kwargs = dict(loss_type="vespo", vespo_k_pos=k, vespo_lambda_pos=0.0, use_bias_correction_kl=False)
    assert_same_as_trl(kwargs, inputs=(logp, old, ref_logp, advantages, mask))
    loss, _ = ours(logp, old, ref_logp, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[0] == 0).all()


def test_on_policy_bias_correction_changes_only_the_gradient():
    """On-policy (old = current) the corrected KL has the same value but the ratio's gradient adds
    ``kl * grad logp`` per token; TRL agrees in both."""
    logp, _, ref_logp, advantages, mask = make_inputs(seed=4)
    old = logp.detach()
    base = dict(loss_type="dapo", beta=0.1)
    plain, _ = ours(logp, old, ref_logp, advantages, mask, **base, use_bias_correction_kl=False)
    corrected, _ = ours(logp, old, ref_logp, advantages, mask, **base, use_bias_correction_kl=True)
    torch.testing.assert_close(corrected, plain, rtol=1e-12, atol=1e-14)
    difference = torch.autograd.grad(corrected, logp)[0] - torch.autograd.grad(plain, logp)[0]
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    expected = torch.where(mask, 0.1 * kl.detach() / mask.sum(), torch.zeros_like(kl))
    torch.testing.assert_close(difference, expected, rtol=1e-10, atol=1e-14)
    assert_same_as_trl(dict(base, use_bias_correction_kl=True), inputs=(logp, old, ref_logp, advantages, mask))
