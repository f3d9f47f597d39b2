"""The reference loop's rollout options: ``kv_cache`` and ``threshold`` are checked by ``RunConfig`` and the
loop's own model (a bidirectional Llama) decodes with the cache, its first step of each block exact."""
import pytest
import torch

from daca_kernels.rollout import generate
from integration.config import RunConfig
from integration.model import ModelConfig, as_masked_lm, build_model
from integration.tasks import vocab


@pytest.mark.parametrize("options, name", [(dict(kv_cache="suffix"), "kv_cache"), (dict(threshold=1.5), "threshold"),
                                           (dict(threshold=1), "threshold")])
def test_bad_rollout_options_are_refused_by_name(options, name):
    with pytest.raises(ValueError, match="^" + name):
        RunConfig(**options)


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
