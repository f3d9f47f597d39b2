"""examples/d1_style_trainer.py: the library's sampler and ``linear_logprob`` inside a TRL ``GRPOTrainer``
subclass written in the style of d1's trainer. It trains, and its log-probabilities are those of d1's
full-logits computation (``log_softmax`` of ``model(...).logits`` and a gather) on the same masked input."""
import math

import pytest
import torch

pytest.importorskip("trl")
from tests.trl_setup import import_example  # noqa: E402


@pytest.fixture(scope="module")
def example():
    return import_example("d1_style_trainer")


@pytest.fixture(scope="module")
def trainer(example, tmp_path_factory):
    return example.main(output_dir=str(tmp_path_factory.mktemp("d1")), max_steps=2)


def test_the_example_trains(trainer):
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    assert all(math.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in steps)
    assert all(0 <= h["reward"] <= 1 for h in steps)


def test_its_log_probabilities_are_d1s_full_logits_computation(trainer):
    model = trainer.model.eval()
    trainer.p_mask_prompt = 0.0  # deterministic masking: every completion token, no prompt token
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 14, (4, 9), generator=generator)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :2] = 0  # a left-padded prompt
    attention_mask[1, 7:] = 0  # a completion that ended early
    keep = 4
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention_mask, keep,
                                                                         compute_entropy=True)
        noisy = ids.clone()
        noisy[:, -keep:] = trainer.mask_id
        keys = attention_mask.clone()
        keys[:, -keep:] = 1
        logits = model(input_ids=noisy, attention_mask=keys).logits[:, -keep:].float() / trainer.temperature
        full = torch.log_softmax(logits, dim=-1)
        expected = full.gather(-1, ids[:, -keep:, None]).squeeze(-1)
        expected_entropy = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, expected_entropy, rtol=1e-5, atol=1e-5)
