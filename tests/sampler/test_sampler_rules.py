"""``generate(..., sampler=...)``: each rule's options object gives exactly the rollout of the same
options as flat keywords, on a full-attention model (LLaDA's and Dream's rules) and a block-causal one
(the SDAR double); mixing the two forms, an unknown keyword and a sampler of the wrong kind are errors
naming the argument."""
import dataclasses

import pytest
import torch
from families import sdar
from tiny_models import tiny_masked_lm

from daca_kernels.models.masked_lm import MaskedLM
from daca_kernels.rollout import BlockSampler, DreamSampler, LLaDASampler, generate

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")


@pytest.fixture(scope="module")
def lm():
    return tiny_masked_lm(seed=5)


@pytest.fixture(scope="module")
def block_lm():
    return MaskedLM.from_hf(sdar.tiny(seed=1).eval())


def prompts(lm, batch=2, length=5):
    ids = torch.randint(0, lm.mask_id, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :2] = False
    return ids, mask


def assert_same(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), field.name  # the same computation replayed: exact
        elif field.name != "branches":
            assert x == y, field.name


@pytest.mark.parametrize("sampler", [
    LLaDASampler(block_length=4, remasking="random"),
    LLaDASampler(block_length=4, threshold=0.5, tokens_per_step=2),
    DreamSampler(alg="entropy", top_p=0.9, top_k=7, eps=0.01),
])
def test_a_sampler_object_equals_its_flat_keywords(lm, sampler):
    ids, mask = prompts(lm)
    flat = {**dataclasses.asdict(sampler), "rule": sampler.rule}
    common = dict(gen_length=8, steps=None if getattr(sampler, "tokens_per_step", None) else 4, seed=9,
                  temperature=0.7, prompt_mask=mask)
    assert_same(generate(lm, ids, sampler=sampler, **common), generate(lm, ids, **common, **flat))


def test_a_block_sampler_equals_its_flat_keywords(block_lm):
    ids, mask = prompts(block_lm)
    sampler = BlockSampler(top_k=5, threshold=0.3, kv_cache=False)
    common = dict(gen_length=8, steps=2, seed=4, temperature=0.8, prompt_mask=mask)
    assert_same(generate(block_lm, ids, sampler=sampler, **common),
                generate(block_lm, ids, **common, **dataclasses.asdict(sampler)))


def test_bad_samplers(lm, block_lm):
    ids, _ = prompts(lm)
    common = dict(gen_length=4, steps=2, seed=0)
    with pytest.raises(ValueError, match="^sampler: give the rule's options in sampler or as keywords"):
        generate(lm, ids, sampler=LLaDASampler(), block_length=2, **common)
    with pytest.raises(ValueError, match="^sampler: a full-attention lm is decoded with LLaDASampler or DreamSampler"):
        generate(lm, ids, sampler=BlockSampler(), **common)
    with pytest.raises(ValueError, match="^sampler: a block-causal lm is decoded with BlockSampler"):
        generate(block_lm, ids, sampler=DreamSampler(), **common)
    with pytest.raises(TypeError, match="^sampler must be a LLaDASampler, DreamSampler or BlockSampler"):
        generate(lm, ids, sampler={"block_length": 2}, **common)
    with pytest.raises(TypeError, match="unexpected keyword argument 'blocklength'"):
        generate(lm, ids, blocklength=2, **common)
