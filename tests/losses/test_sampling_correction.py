"""The sampling correction of ``daca_kernels.rl_step``: the truncated importance weights of an
approximate rollout's committed tokens, multiplied into the token weights, give the float64 loss
computed by hand; an exact rollout's weights are 1 (its loss the uncorrected one); the options are
checked by name."""
import math

import pytest
import torch
from support import assert_close_reduced
from tiny_models import tiny_masked_lm

from daca_kernels.rl_step import (
    StepBatch,
    StepOptions,
    chunk_normaliser,
    objective_loss,
    old_values,
    sampling_importance_weights,
)
from daca_kernels.rollout import generate, rescore_commits
from integration.model import ModelConfig, as_masked_lm, build_model
from integration.tasks import vocab

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")

ROWS, PROMPT, GEN = 3, 2, 6


def synthetic(seed: int = 0):
    """Committed answer tokens with gaps of both signs (some past the cap), a token left masked inside
    the answer (commit step -1), answers ending early, DPS-like weights."""
    g = torch.Generator().manual_seed(seed)
    length = PROMPT + GEN
    commit_step = torch.randint(0, GEN, (ROWS, length), generator=g)
    commit_step[:, :PROMPT] = -1
    commit_step[0, PROMPT + 1] = -1
    loss_mask = commit_step >= 0
    loss_mask[0, PROMPT + 1] = True
    loss_mask[1, PROMPT + 3:] = False
    target = -3 * torch.rand(ROWS, length, generator=g, dtype=torch.float64)
    sampling = target + 1.5 * torch.randn(ROWS, length, generator=g, dtype=torch.float64)
    dps = 0.5 + torch.rand(ROWS, length, generator=g, dtype=torch.float64)
    return target, sampling, commit_step, loss_mask, dps


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_the_weights_and_metrics_by_hand(mode):
    target, sampling, commit_step, loss_mask, _ = synthetic()
    cap = 1.5
    options = StepOptions(sampling_importance_sampling_correction=True, sampling_importance_sampling_mode=mode,
                          sampling_importance_sampling_cap=cap)
    weights, metrics = sampling_importance_weights(target, sampling, commit_step, loss_mask, options)
    want = torch.ones(ROWS, PROMPT + GEN, dtype=torch.float64)
    gaps, truncated = [], 0
    for b in range(ROWS):
        tokens = [i for i in range(PROMPT + GEN) if loss_mask[b, i] and commit_step[b, i] >= 0]
        row = sum(float(target[b, i] - sampling[b, i]) for i in tokens)
        for i in tokens:
            log_ratio = row if mode == "sequence_truncate" else float(target[b, i] - sampling[b, i])
            want[b, i] = min(math.exp(log_ratio), cap)
            truncated += math.exp(log_ratio) > cap
            gaps.append(abs(float(target[b, i] - sampling[b, i])))
    assert weights.dtype == torch.float64 and not weights.requires_grad
    torch.testing.assert_close(weights, want, rtol=1e-12, atol=0.0)
    assert 0 < truncated < len(gaps)
    torch.testing.assert_close(metrics["sampling/logp_gap_abs_mean"].double(), torch.tensor(sum(gaps) / len(gaps),
                                                                                        dtype=torch.float64))
    assert float(metrics["sampling/truncated_fraction"]) == pytest.approx(truncated / len(gaps))
    counted = loss_mask & (commit_step >= 0)
    assert float(metrics["sampling/importance_weight_mean"]) == pytest.approx(float(want[counted].mean()), rel=1e-6)


def test_the_corrected_loss_equals_a_float64_reference():
    """DAPO, off-policy (clipped ratios), DPS weights times the correction: the loss by hand."""
    lm = tiny_masked_lm(vocab=29, hidden=16, dtype=torch.float64, seed=1)
    target, sampling, commit_step, loss_mask, dps = synthetic(1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, lm.mask_id, loss_mask.shape, generator=g)
    completion = commit_step.new_zeros(loss_mask.shape, dtype=torch.bool)
    completion[:, PROMPT:] = True
    advantages = torch.tensor([0.8, -1.2, 0.5], dtype=torch.float64)
    options = StepOptions(estimator="one_step", loss_type="dapo", epsilon=0.2, sampling_importance_sampling_cap=2.0,
                          sampling_importance_sampling_correction=True)
    weights, _ = sampling_importance_weights(target, sampling, commit_step, loss_mask, options)
    batch = StepBatch(ids, None, completion, loss_mask, advantages, generation_length=GEN, token_weights=dps * weights)
    seed = 5
    current = old_values(lm, options, batch, seed)
    old = current + 0.3 * torch.randn(current.shape, generator=g, dtype=torch.float64)
    loss, _ = objective_loss(lm, options, batch, seed, chunk_normaliser(loss_mask.sum()), old=old)

    total = 0.0
    for b in range(ROWS):
        for i in range(PROMPT + GEN):
            if not loss_mask[b, i]:
                continue
            ratio = math.exp(float(current[b, i] - old[b, i]))
            w = min(math.exp(float(target[b, i] - sampling[b, i])), 2.0) if commit_step[b, i] >= 0 else 1.0
            a = float(advantages[b])
            total -= float(dps[b, i]) * w * min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
    want = torch.tensor(total / int(loss_mask.sum()), dtype=torch.float64)
    assert_close_reduced(loss, want, n=int(loss_mask.sum()), what="corrected loss")
    plain, _ = objective_loss(lm, options, StepBatch(ids, None, completion, loss_mask, advantages, GEN, token_weights=dps),
                              seed, chunk_normaliser(loss_mask.sum()), old=old)
    assert abs(float(plain.detach()) - total / int(loss_mask.sum())) > 1e-3  # the correction changed the loss


def test_an_exact_rollouts_weights_are_one_and_a_cached_rollouts_are_not():
    lm = as_masked_lm(build_model(ModelConfig(), seed=0).eval())
    prompts = torch.randint(len(vocab.SPECIAL_TOKENS), vocab.size, (4, 5), generator=torch.Generator().manual_seed(0))
    options = StepOptions(estimator="stratified", sampling_importance_sampling_correction=True)
    settings = dict(gen_length=8, steps=8, block_length=2, temperature=1.0, seed=3)
    for kv_cache in (None, "prefix"):
        rollout = generate(lm, prompts, kv_cache=kv_cache, **settings)
        loss_mask = rollout.answer_mask(vocab.eos_id)
        weights, metrics = sampling_importance_weights(rescore_commits(lm, rollout), rollout.commit_logprob,
                                                       rollout.commit_step, loss_mask, options)
        gap = float(metrics["sampling/logp_gap_abs_mean"])
        if kv_cache is not None:
            assert gap > 1e-3 and not torch.allclose(weights, torch.ones_like(weights))
            continue
        assert gap < 1e-5
        torch.testing.assert_close(weights, torch.ones_like(weights), rtol=0.0, atol=1e-5)
        batch = dict(input_ids=rollout.sequences, attention_mask=None, completion_mask=rollout.completion_mask,
                     loss_mask=loss_mask, advantages=torch.tensor([1.0, -0.5, 0.3, -0.8]), generation_length=8)
        normaliser = chunk_normaliser(loss_mask.sum())
        corrected, _ = objective_loss(lm, options, StepBatch(**batch, token_weights=weights), 7, normaliser)
        plain, _ = objective_loss(lm, options, StepBatch(**batch), 7, normaliser)
        assert_close_reduced(corrected, plain, n=int(loss_mask.sum()), what="exact rollout's corrected loss")


@pytest.mark.parametrize("options, name, error", [
    (dict(sampling_importance_sampling_correction=1), "sampling_importance_sampling_correction", TypeError),
    (dict(sampling_importance_sampling_mode="token_mask"), "sampling_importance_sampling_mode", ValueError),
    (dict(sampling_importance_sampling_cap=0.0), "sampling_importance_sampling_cap", ValueError),
    (dict(sampling_importance_sampling_cap=float("nan")), "sampling_importance_sampling_cap", ValueError),
    (dict(sampling_importance_sampling_correction=True, objective="bgpo", estimator="elbo"),
     "sampling_importance_sampling_correction", ValueError),
    (dict(sampling_importance_sampling_correction=True, objective="spg", estimator="elbo"),
     "sampling_importance_sampling_correction", ValueError),
])
def test_bad_options_are_refused_by_name(options, name, error):
    with pytest.raises(error, match="^" + name):
        StepOptions(**options)
