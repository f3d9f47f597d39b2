"""The comparison commands' reporting: variants, tables and plots from real (tiny) runs."""
import pytest
from distributed_gradients import tiny_config

# integration.compare draws its charts with matplotlib (the integration extra), imported at module level.
pytest.importorskip("matplotlib", reason="matplotlib is not installed (the integration extra)")

from daca_kernels.presets import ABLATIONS, ADVANTAGES, METHODS, OBJECTIVE_VARIANTS, PRESETS
from integration.compare import plot_curves, run_comparison, summary_table
from integration.compare_objectives import objectives_table, plot_task, variants_for
from integration.config import describe_advantages, describe_settings, describe_variants, preset_settings, shared_advantages, task_config


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")


def test_every_base_has_a_daca_variant_with_dps():
    variants = variants_for(task_config("sort"))
    assert list(variants) == [name for base in OBJECTIVE_VARIANTS for name in (base, f"{base}+DACA")]
    for base in OBJECTIVE_VARIANTS:
        assert variants[f"{base}+DACA"]["dps"] and not variants[base].get("dps")
        assert variants[base]["objective"] == variants[f"{base}+DACA"]["objective"]
        # The base's peer's advantages, kept by its DACA variant: only the likelihood and the token weights differ.
        assert (variants[base]["advantage_scale"], variants[base]["leave_one_out"]) == tuple(ADVANTAGES[base].values())
        assert shared_advantages({name: variants[name] for name in (base, f"{base}+DACA")}) is not None
    assert "mask_block_length" not in variants["spg"]
    assert variants_for(task_config("sort", block_length=3))["spg"]["mask_block_length"] == 3
    assert describe_settings(METHODS["daca-grpo"]) == "grpo, stratified K=4, DPS"


def test_the_settings_name_the_advantages_where_they_differ():
    assert [describe_advantages(preset_settings(name)) for name in ("diffu-grpo", "coupled", "bgpo")] == [
        "A = r - mean", "A = r - others' mean", "A = (r - mean) / std"]
    assert describe_advantages({"advantage_scale": "batch"}) == "A = (r - mean) / batch std"
    methods = {name: preset_settings(name) for name in METHODS}
    assert shared_advantages(methods) == "A = r - mean"
    assert describe_variants(methods) == {name: describe_settings(settings) for name, settings in methods.items()}
    mixed = describe_variants({name: preset_settings(name) for name in ("grpo", "bgpo")})
    assert mixed == {"grpo": "grpo, one_step, prompt p=0.15, A = r - mean", "bgpo": "bgpo, elbo n=4, A = (r - mean) / std"}


def test_ablations_take_daca_apart():
    daca, plain = METHODS["daca-grpo"], METHODS["diffu-grpo"]
    assert ABLATIONS["sml-only"] == {k: v for k, v in daca.items() if k != "dps"}
    assert ABLATIONS["dps-only"] == {**plain, "dps": True}
    assert ABLATIONS["elbo-mc"]["elbo_samples"] == daca["num_strata"]  # the forward passes of SML
    for name, settings in ABLATIONS.items():
        assert PRESETS[name] == settings
        task_config("sort", **settings)  # a valid run configuration


def test_reports_of_real_runs(torch_backend, tmp_path):
    base = tiny_config(steps=2, eval_every=1)
    variants = {name: preset_settings(name) for name in ("grpo", "grpo+DACA")}
    results = run_comparison(base, variants, [0, 1], tmp_path / "runs", tmp_path / "cache", progress=False)
    assert set(results) == set(variants) and all(set(r) == {0, 1} for r in results.values())
    table = summary_table(results, variants)
    assert table.count("\n") == 3 and "grpo, stratified K=4, DPS" in table
    assert plot_curves(results, tmp_path / "curves.png", "title").stat().st_size > 0
    full = {base: results[base if base == "grpo" else "grpo"] for base in OBJECTIVE_VARIANTS}
    full.update({f"{base}+DACA": results["grpo+DACA"] for base in OBJECTIVE_VARIANTS})
    rows = objectives_table({"sort": full}).splitlines()
    assert len(rows) == 2 + len(OBJECTIVE_VARIANTS) and rows[2].startswith("| sort | grpo | A = r - mean |")
    assert plot_task("sort", full, tmp_path / "task.png").stat().st_size > 0
