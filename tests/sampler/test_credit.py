"""Denoising Progress Scores: the confidence-delta reduction and the per-token weights."""
import pytest
import torch
from gpu_device import DEVICE
from support import assert_no_worse_than_torch, assert_unchanged, snapshot
from tiny_models import tiny_masked_lm

from daca_kernels import confidence_delta, reference
from daca_kernels.credit import dps_weights
from daca_kernels.rollout import Rollout, generate


def delta_inputs(batch, length, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    current = torch.rand(batch, length, generator=g, dtype=torch.float64).to(dtype)
    previous = torch.rand(batch, length, generator=g, dtype=torch.float64).to(dtype)
    still_masked = torch.rand(batch, length, generator=g) < 0.6
    # Entries outside the mask are stale in a sampler: they must never be read.
    current[~still_masked] = float("nan")
    previous[~still_masked] = float("inf")
    return current, previous, still_masked


@pytest.mark.parametrize("batch,length", [(1, 1), (3, 37), (5, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_confidence_delta_matches_reference(backend, poison_allocations, batch, length, dtype):
    current, previous, still_masked = delta_inputs(batch, length, dtype, seed=batch * length)
    before = snapshot(current, previous, still_masked)
    out = confidence_delta(current, previous, still_masked)
    assert_unchanged(before, current, previous, still_masked)
    assert out.dtype == dtype and out.shape == (batch,)
    ref = reference.confidence_delta(current, previous, still_masked)
    plain = torch.where(still_masked, current - previous, torch.zeros_like(current)).sum(1)
    assert_no_worse_than_torch(out, plain, ref, 1e-6 if dtype == torch.float32 else 1e-12, "confidence delta")


def test_confidence_delta_non_contiguous(backend):
    current, previous, still_masked = delta_inputs(40, 6, torch.float32, seed=1)
    out = confidence_delta(current.T, previous.T, still_masked.T)
    torch.testing.assert_close(out, reference.confidence_delta(current.T, previous.T, still_masked.T).float())
    assert torch.equal(confidence_delta(current[:, :0], previous[:, :0], still_masked[:, :0]), torch.zeros(40))


def test_confidence_delta_opcheck(backend):
    current, previous, still_masked = delta_inputs(3, 10, torch.float32, seed=2)
    torch.library.opcheck(torch.ops.daca.confidence_delta.default, (current.nan_to_num(), previous.nan_to_num(), still_masked, backend))


DELTA_CASES = {
    "shape": (lambda c, p, m: (c, p[:, 1:], m), ValueError, r"previous must have shape \[B, L\]"),
    "mask shape": (lambda c, p, m: (c, p, m[:1]), ValueError, r"still_masked must have shape \[B, L\]"),
    "dtype": (lambda c, p, m: (c, p.double(), m), TypeError, "previous must have the dtype of current"),
    "int mask": (lambda c, p, m: (c, p, m.long()), TypeError, "still_masked must have dtype"),
    "1-D": (lambda c, p, m: (c[0], p, m), ValueError, "current must be 2-D"),
    "device": (lambda c, p, m: (c, p, m.to("meta")), ValueError, "still_masked is on meta"),
}


@pytest.mark.parametrize("case", list(DELTA_CASES))
def test_confidence_delta_rejects(case):
    make, error, message = DELTA_CASES[case]
    with pytest.raises(error, match=message):
        confidence_delta(*make(*delta_inputs(3, 8, torch.float32, seed=0)))


@pytest.mark.gpu
def test_confidence_delta_cuda():
    current, previous, still_masked = (t.to(DEVICE) for t in delta_inputs(64, 4096, torch.float32, seed=3))
    out = confidence_delta(current, previous, still_masked)
    ref = reference.confidence_delta(current.cpu(), previous.cpu(), still_masked.cpu())
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def sampled(request):
    """A rollout and the reference sampler's full confidence history for the same inputs."""
    lm = tiny_masked_lm(seed=3)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 60, (3, 4), generator=g)
    kwargs = dict(gen_length=12, steps=8, block_length=6, temperature=0.8, seed=21)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DACA_BACKEND", "torch")
        rollout = generate(lm, prompt, **kwargs)
    return rollout, reference.reference_generate(lm, prompt, **kwargs)


def direct_weights(history, completion_mask, variant, scale, clip):
    """The DPS weights (``daca_kernels.credit``) from the stored per-step confidences ``c_s[j]`` ``[B, S, L]``."""
    commit_step = history.commit_step
    confidence_at_commit = history.confidences.gather(1, commit_step.clamp(min=0)[:, None]).squeeze(1)
    gain = reference.step_gain_from_history(history.confidences, commit_step)
    return reference.dps_weights(confidence_at_commit, commit_step, gain, completion_mask, variant, scale, clip)


@pytest.mark.parametrize("variant", ["progress", "self", "lookahead"])
@pytest.mark.parametrize("scale,clip", [(0.5, (0.2, 5.0)), (2.0, (0.5, 1.5)), (1.0, None)])
def test_weights_equal_direct_implementation(sampled, variant, scale, clip):
    rollout, history = sampled
    completion = rollout.completion_mask.clone()
    completion[1, -5:] = False  # e.g. tokens after the end of the answer do not count
    before = snapshot(rollout.commit_step, rollout.commit_confidence, rollout.step_gain, completion)
    weights = dps_weights(rollout, completion, variant=variant, scale=scale, clip=clip)
    assert_unchanged(before, rollout.commit_step, rollout.commit_confidence, rollout.step_gain, completion)
    expected = direct_weights(history, completion, variant, scale, clip)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-5)
    assert (weights[~completion] == 0).all()
    means = weights.double().sum(1) / completion.sum(1)
    torch.testing.assert_close(means, torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-6)
    assert weights[completion].std() > 0.01, "weights must differ between tokens"
    if clip is not None:
        w = weights[1][completion[1]]
        assert w.max() / w.min() <= clip[1] / clip[0] * (1 + 1e-6)


def test_scale_zero_gives_plain_grpo(sampled):
    rollout, _ = sampled
    for clip in [(0.2, 5.0), (2.0, 3.0), None]:
        weights = dps_weights(rollout, variant="progress", scale=0.0, clip=clip)
        assert torch.equal(weights, rollout.completion_mask.float())


def synthetic_rollout(commit_step, commit_confidence, step_gain):
    commit_step = torch.tensor(commit_step)
    return Rollout(
        sequences=torch.zeros_like(commit_step), commit_step=commit_step,
        commit_confidence=torch.tensor(commit_confidence), step_gain=torch.tensor(step_gain),
        attention_mask=None, prompt_length=1, nfe=0, branches=(), mask_id=0,
    )


def test_hand_computed_example():
    # Row 0: prompt, then tokens committed at steps 0, 0, 1 with confidences 0.9, 0.5, 0.6.
    rollout = synthetic_rollout([[-1, 0, 0, 1]], [[0.0, 0.9, 0.5, 0.6]], [[0.4, 0.0]])
    d = torch.tensor([0.1 + 0.2, 0.5 + 0.2, 0.4 + 0.0], dtype=torch.float64)
    z = (d - d.mean()) / (d.std(correction=0) + 1e-6)
    w = (1 + 0.5 * z).clamp(0.2, 5.0)
    expected = torch.cat([torch.zeros(1, dtype=torch.float64), w / w.mean()])
    torch.testing.assert_close(dps_weights(rollout)[0].double(), expected, rtol=1e-6, atol=1e-7)


def test_rows_with_one_or_no_completion_token():
    rollout = synthetic_rollout([[-1, 0, 1], [-1, 1, 0]], [[0.0, 0.3, 0.7], [0.0, 0.2, 0.9]], [[0.5, 0.0], [0.1, 0.0]])
    completion = torch.tensor([[False, False, True], [False, False, False]])
    weights = dps_weights(rollout, completion, scale=3.0)
    assert torch.equal(weights, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))


WEIGHT_CASES = {
    "variant": ({"variant": "entropy"}, ValueError, "variant must be one of"),
    "negative scale": ({"scale": -0.5}, ValueError, "scale must be a finite number >= 0"),
    "clip order": ({"clip": (2.0, 1.0)}, ValueError, "clip must satisfy 0 < low <= high"),
    "clip zero": ({"clip": (0.0, 1.0)}, ValueError, "clip must satisfy"),
    "clip type": ({"clip": 0.5}, TypeError, "clip must be a"),
    "mask dtype": ({"completion_mask": torch.ones(1, 4, dtype=torch.long)}, TypeError, "completion_mask must have dtype"),
    "mask shape": ({"completion_mask": torch.ones(1, 3, dtype=torch.bool)}, ValueError, "completion_mask must have shape"),
    "prompt selected": ({"completion_mask": torch.ones(1, 4, dtype=torch.bool)}, ValueError, "completion_mask must select only"),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_dps_weights_rejects(case):
    overrides, error, message = WEIGHT_CASES[case]
    rollout = synthetic_rollout([[-1, 0, 0, 1]], [[0.0, 0.9, 0.5, 0.6]], [[0.4, 0.0]])
    completion_mask = overrides.pop("completion_mask", None)
    with pytest.raises(error, match=message):
        dps_weights(rollout, completion_mask, **overrides)
    with pytest.raises(TypeError, match="rollout must be a Rollout"):
        dps_weights({"commit_step": rollout.commit_step})
