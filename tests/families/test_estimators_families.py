"""The sampler gives a left-padded prompt of a bidirectional family double the completion of the prompt
alone. (The estimators' padding conformance is checked on the released files:
``tests/released/test_full_attention_estimators.py``.)"""
import pytest
import torch

from daca_kernels import rollout
from daca_kernels.models.masked_lm import MaskedLM
from families import dream, llada, llada_moe

DOUBLES = {"llada": llada, "llada_moe": llada_moe, "dream": dream}
PADS = (0, 2, 5)  # left padding of each row
PROMPT = 6


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    # The ops' kernels are checked against the references elsewhere, and the Triton interpreter would
    # make these whole-model runs minutes long.
    monkeypatch.setenv("DACA_BACKEND", "torch")


def make_prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 58, (len(PADS), PROMPT), generator=g)
    prompt_mask = torch.ones(ids.shape, dtype=torch.bool)
    for b, pad in enumerate(PADS):
        prompt_mask[b, :pad] = False
        ids[b, :pad] = 59  # a padding id that is not the mask id
    return ids, prompt_mask


@pytest.mark.parametrize("name", sorted(DOUBLES))
def test_greedy_rollout_of_left_padded_prompts_matches_each_prompt_alone(name):
    lm = MaskedLM.from_hf(DOUBLES[name].tiny(), mask_id=DOUBLES[name].MASK_ID)
    prompts, prompt_mask = make_prompts()
    kwargs = dict(gen_length=8, steps=8, block_length=4, temperature=0.0, seed=0)
    batch = rollout.generate(lm, prompts, prompt_mask=prompt_mask, **kwargs).sequences
    for b, pad in enumerate(PADS):
        alone = rollout.generate(lm, prompts[b:b + 1, pad:], **kwargs).sequences[0]
        assert torch.equal(batch[b, PROMPT:], alone[PROMPT - pad:]), f"row {b}"
