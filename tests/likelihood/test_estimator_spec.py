"""``EstimatorSpec``: an estimator's settings, checked once, passed as ``estimate_logprob``'s keywords."""
import dataclasses

import pytest
import torch
from tiny_models import tiny_masked_lm

from daca_kernels.likelihood import ESTIMATORS, EstimatorSpec, estimate_logprob, monte_carlo_masks
from daca_kernels.likelihood.estimator import MONTE_CARLO_ESTIMATORS
from daca_kernels.rl_step import StepOptions

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


@pytest.mark.parametrize("name", ESTIMATORS)
def test_the_spec_gives_the_estimate_of_its_keywords(name):
    lm = tiny_masked_lm(vocab=31, hidden=16, seed=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, lm.mask_id, (3, 11), generator=g)
    completion = torch.zeros(3, 11, dtype=torch.bool)
    completion[:, 4:] = True
    spec = EstimatorSpec(name, num_strata=3, elbo_samples=3, prompt_mask_prob=0.3)
    by_spec = estimate_logprob(lm, ids, completion, completion, None, seed=7, **spec.keywords())
    by_name = estimate_logprob(lm, ids, completion, completion, None, estimator=name, seed=7, num_strata=3,
                               elbo_samples=3, prompt_mask_prob=0.3)
    assert torch.equal(by_spec, by_name)
    if name in MONTE_CARLO_ESTIMATORS:
        masks = monte_carlo_masks(ids, completion, completion, None, seed=7, mask_id=lm.mask_id, **spec.keywords())
        assert len(masks) == 3  # K = 3 strata, or 3 ELBO samples


def test_the_spec_reads_a_config_and_step_options_hold_it():
    class Config:
        estimator, num_strata, prompt_mask_prob, unrelated = "stratified", 2, 0.15, "x"

    spec = EstimatorSpec.from_config(Config())
    assert spec == EstimatorSpec("stratified", num_strata=2, prompt_mask_prob=0.15)
    assert spec.keywords() == dict(estimator="stratified", num_strata=2, elbo_samples=2, prompt_mask_prob=0.15,
                                   mask_block_length=None, mask_block_choice="uniform")
    assert StepOptions(estimator="coupled").estimator == EstimatorSpec("coupled")
    assert StepOptions(objective="bgpo", estimator=spec).estimator is spec
    with pytest.raises(TypeError, match="estimator must be an EstimatorSpec or an estimator's name, got int"):
        StepOptions(estimator=3)
    with pytest.raises(ValueError, match="estimator must be one of stratified, elbo"):
        StepOptions(objective="spg", estimator=EstimatorSpec("coupled"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_strata = 5


@pytest.mark.parametrize("settings,error,message", [
    (dict(name="exact"), ValueError, "estimator must be one of"),
    (dict(name=None), TypeError, "estimator must be a str"),
    (dict(num_strata=0), ValueError, "num_strata"),
    (dict(elbo_samples=1.5), TypeError, "elbo_samples"),
    (dict(prompt_mask_prob=1.5), ValueError, "prompt_mask_prob"),
    (dict(mask_block_length=0), ValueError, "mask_block_length"),
    (dict(mask_block_choice="SPG"), ValueError, "mask_block_choice"),
])
def test_a_bad_setting_is_named_at_construction(settings, error, message):
    with pytest.raises(error, match=message):
        EstimatorSpec(**settings)
