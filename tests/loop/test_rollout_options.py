"""The reference loop's rollout options: ``kv_cache`` and ``threshold`` are checked by ``RunConfig`` and the
loop's own model (a bidirectional Llama) decodes with the cache, its first step of each block exact."""
import pytest
import torch
from distributed_gradients import tiny_config

from daca_kernels.rollout import generate
from integration.config import RunConfig
from integration.model import ModelConfig, as_masked_lm, build_model
from integration.tasks import vocab
from integration.trainer import Trainer


@pytest.mark.parametrize("options, name", [
    (dict(kv_cache="suffix"), "kv_cache"), (dict(threshold=1.5), "threshold"), (dict(threshold=1), "threshold"),
    (dict(sampling_importance_sampling_cap=0.0), "sampling_importance_sampling_cap"),
    (dict(sampling_importance_sampling_mode="token"), "sampling_importance_sampling_mode"),
    (dict(sampling_importance_sampling_correction=True, objective="spg", estimator="elbo"),
     "sampling_importance_sampling_correction")])
def test_bad_rollout_options_are_refused_by_name(options, name):
    with pytest.raises(ValueError, match="^" + name):
        RunConfig.from_flat(**options)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_the_loops_model_decodes_with_the_cache(mode):
    lm = as_masked_lm(build_model(ModelConfig(), seed=0).eval())
    prompts = torch.randint(len(vocab.SPECIAL_TOKENS), vocab.size, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    options = dict(gen_length=8, block_length=4, seed=0, prompt_mask=mask)
    one_step = generate(lm, prompts, steps=2, kv_cache=mode, **options)
    assert torch.equal(one_step.sequences, generate(lm, prompts, steps=2, **options).sequences)
    cached = generate(lm, prompts, steps=8, kv_cache=mode, **options)
    assert cached.forward_tokens < generate(lm, prompts, steps=8, **options).forward_tokens
    assert RunConfig(kv_cache=mode, threshold=0.9).kv_cache == mode


@pytest.mark.parametrize("correction", [False, True])
def test_the_loop_logs_the_gap_of_cached_rollouts_and_corrects_them_when_asked(tmp_path, correction, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")
    # Two layers: with one, the cached keys of the prefix do not depend on the block being decoded (no gap).
    config = tiny_config(kv_cache="prefix", block_length=2, sampling_importance_sampling_correction=correction,
                         model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))
    trainer = Trainer(config, tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    batch = trainer.collect(0)
    assert batch.sampling["sampling/logp_gap_abs_mean"] > 1e-3
    plain = Trainer(config.replace(sampling_importance_sampling_correction=False), tmp_path / "plain",
                    cache_dir=tmp_path / "cache", progress=False).collect(0)
    assert torch.equal(batch.rollout.sequences, plain.rollout.sequences)
    assert torch.equal(batch.weights, plain.weights) != correction  # the DPS weights, times the correction's
    record = trainer.run()[-1]
    assert record["sampling/truncated_fraction"] >= 0.0 and ("gap_seconds" in record) != correction
