"""``DiffusionOptions``: the diffusion settings declared once, inherited by the TRL config and held by
the reference loop's ``RunConfig``, with one set of checks."""
import dataclasses

import pytest

from daca_kernels.diffusion_options import PRESET_DEFAULTS, DiffusionOptions
from daca_kernels.likelihood import EstimatorSpec
from daca_kernels.rl_step import StepOptions

pytest.importorskip("trl")
from daca_kernels.trl import DiffusionGRPOConfig  # noqa: E402
from integration.config import RunConfig, task_config  # noqa: E402


def names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_options_are_declared_once():
    own = names(DiffusionOptions)
    assert own <= names(DiffusionGRPOConfig)
    assert not own & names(RunConfig), "RunConfig holds them in `diffusion`, not beside it"
    for name in own:  # inherited, not redeclared: the field is DiffusionOptions' own object
        config_field = DiffusionGRPOConfig.__dataclass_fields__[name]
        assert config_field is DiffusionOptions.__dataclass_fields__[name], name
    assert dataclasses.fields(DiffusionGRPOConfig)[0].name == "output_dir"  # TRL's positional order kept


def test_unset_settings_take_the_preset_then_the_defaults(tmp_path):
    options = DiffusionOptions()
    assert {name: getattr(options, name) for name in PRESET_DEFAULTS} == PRESET_DEFAULTS
    config = DiffusionGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], preset="daca-grpo",
                                 num_strata=2)
    assert (config.estimator, config.num_strata, config.dps) == ("stratified", 2, True)
    assert DiffusionOptions(estimator="elbo", elbo_samples=3).estimator_spec() == EstimatorSpec("elbo", elbo_samples=3)
    assert DiffusionOptions(dps_clip=[1, 2]).dps_options() == dict(variant="progress", scale=0.5, clip=(1.0, 2.0))
    assert DiffusionOptions(dps_clip=None).dps_options()["clip"] is None


@pytest.mark.parametrize("settings,error,message", [
    (dict(objective="ppo"), ValueError, "objective must be one of"),
    (dict(estimator="exact"), ValueError, "estimator must be one of"),
    (dict(objective="bgpo", estimator="one_step"), ValueError, "estimator must be one of stratified, elbo"),
    (dict(num_strata=0), ValueError, "num_strata"),
    (dict(dps=1), TypeError, "dps must be a bool"),
    (dict(dps_clip=[5.0, 0.2]), ValueError, "dps_clip must be"),
    (dict(dispo_fillings=1), ValueError, "dispo_fillings"),
    (dict(dispo_branch_fraction=1.0), ValueError, "dispo_branch_fraction"),
    (dict(spg_bound="upper"), ValueError, "spg_bound must be one of"),
    (dict(objective="spg", estimator="elbo", sampling_importance_sampling_correction=True), ValueError,
     "sampling_importance_sampling_correction is only meaningful"),
])
def test_one_check_for_every_config(settings, error, message, tmp_path):
    """The same error from the options alone, the TRL config and the loop's config."""
    with pytest.raises(error, match=message):
        DiffusionOptions(**settings)
    with pytest.raises(error, match=message):
        DiffusionGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **settings)
    with pytest.raises(error, match=message):
        task_config("sort", **settings)


def test_the_loop_takes_the_options_by_name_and_keeps_them_through_a_checkpoint():
    config = task_config("sudoku4", objective="bgpo", estimator="stratified", num_strata=3, dps=True, lr=3e-4)
    assert config.diffusion == DiffusionOptions(objective="bgpo", estimator="stratified", num_strata=3, dps=True)
    assert config.replace(num_strata=2, steps=5).diffusion.num_strata == 2
    assert config.replace(steps=5).diffusion is config.diffusion
    assert RunConfig.from_dict(config.to_dict()) == config
    flat = {k: v for k, v in config.to_dict().items() if k != "diffusion"} | dataclasses.asdict(config.diffusion)
    assert RunConfig.from_dict(flat) == config  # a checkpoint of a flat config
    options = StepOptions.from_config(config.diffusion)
    assert options.estimator == EstimatorSpec("stratified", num_strata=3) and options.objective == "bgpo"
    with pytest.raises(TypeError, match="diffusion must be a DiffusionOptions"):
        RunConfig(diffusion={"objective": "grpo"})
