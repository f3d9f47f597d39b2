"""The sampler on CUDA: generate and branch equal to the CPU rollout token for token, and
confidence_delta (its DPS bookkeeping) against the float64 reference.

The tiny model is float64 on both devices with the same weights, so the two runs differ only by
rounding far below any near-tie of confidences or logits. gpu-marked; ``DACA_GPU_TESTS_ON_CPU=1``
runs the same bodies on CPU (see ``gpu_device.py``).
"""
import pytest
import torch
from gpu_device import CPU, DEVICE, generator, sized, tiny_lm_on_cpu_and_device
from support import assert_no_worse_than_torch

from daca_kernels import confidence_delta, reference
from daca_kernels.rollout import branch, generate

pytestmark = pytest.mark.gpu

VOCAB = 61  # the tiny model's; its mask id is the last id


def padded_prompts(batch=3, length=6):
    """CPU left-padded prompts (pad id 0) of lengths 6, 4 and 1, and their prompt mask."""
    ids = torch.randint(1, VOCAB - 1, (batch, length), generator=generator(3, CPU))
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b, pad in enumerate([0, 2, 5][:batch]):
        mask[b, :pad] = False
        ids[b, :pad] = 0
    return ids, mask


def assert_rollouts_equal(on_device, on_cpu, what):
    """Tokens and commit steps identical; confidences and step gains equal up to float64 rounding."""
    assert on_device.sequences.device == DEVICE
    assert torch.equal(on_device.sequences.to(CPU), on_cpu.sequences), f"{what}: sequences differ"
    assert torch.equal(on_device.commit_step.to(CPU), on_cpu.commit_step), f"{what}: commit steps differ"
    torch.testing.assert_close(on_device.commit_confidence.to(CPU), on_cpu.commit_confidence, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(on_device.step_gain.to(CPU), on_cpu.step_gain, rtol=1e-9, atol=1e-11)


# (model, gen_length, block_length, steps, temperature, remasking)
CASES = [
    ("plain", 12, 4, 6, 0.0, "low_confidence"),  # three blocks, two tokens a step
    ("shift-biased-head", 10, 5, 10, 0.0, "random"),  # Dream convention, one token a step
    ("plain", 8, 4, 12, 0.0, "low_confidence"),  # six steps for four tokens a block: some commit nothing
    ("biased-head", 12, 6, 4, 0.9, "low_confidence"),  # Gumbel noise from the counter hash
]
MODELS = {"plain": {}, "biased-head": {"head_bias": True}, "shift-biased-head": {"shift": True, "head_bias": True}}


@pytest.mark.parametrize("model,gen_length,block_length,steps,temperature,remasking", CASES)
def test_generate_and_branch_equal_the_cpu_rollout(model, gen_length, block_length, steps, temperature, remasking):
    lm_cpu, lm_device = tiny_lm_on_cpu_and_device(vocab=VOCAB, seed=1, **MODELS[model])
    prompt, prompt_mask = padded_prompts()
    kwargs = dict(
        gen_length=gen_length, steps=steps, block_length=block_length, temperature=temperature,
        remasking=remasking, seed=7, branch_steps=[1, steps - 2], branch_topk=8,
    )
    on_cpu = generate(lm_cpu, prompt, prompt_mask=prompt_mask, **kwargs)
    on_device = generate(lm_device, prompt.to(DEVICE), prompt_mask=prompt_mask.to(DEVICE), **kwargs)
    assert_rollouts_equal(on_device, on_cpu, "generate")
    assert on_device.nfe == on_cpu.nfe and on_device.step_gain.dtype == torch.float64
    assert torch.equal(on_device.attention_mask.to(CPU), on_cpu.attention_mask)

    # The plain reference sampler on the same device agrees as well.
    ref_kwargs = {k: v for k, v in kwargs.items() if k not in ("branch_steps", "branch_topk")}
    ref = reference.reference_generate(lm_device, prompt.to(DEVICE), prompt_mask=prompt_mask.to(DEVICE), **ref_kwargs)
    assert torch.equal(ref.sequences, on_device.sequences) and torch.equal(ref.commit_step, on_device.commit_step)
    torch.testing.assert_close(ref.step_gain, on_device.step_gain, rtol=1e-9, atol=1e-11)

    for state_device, state_cpu in zip(on_device.branches, on_cpu.branches, strict=True):
        assert state_device.step == state_cpu.step
        assert torch.equal(state_device.sequences.to(CPU), state_cpu.sequences)
        assert torch.equal(state_device.token_ids.to(CPU), state_cpu.token_ids)
        torch.testing.assert_close(state_device.logprobs.to(CPU), state_cpu.logprobs, rtol=1e-10, atol=1e-12)
    for index in range(len(on_cpu.branches)):
        filled_device = branch(on_device, index, 3, seed=5, temperature=1.0)
        filled_cpu = branch(on_cpu, index, 3, seed=5, temperature=1.0)
        assert torch.equal(filled_device.sequences.to(CPU), filled_cpu.sequences), "branch fillings differ"
        torch.testing.assert_close(filled_device.old_logprob.to(CPU), filled_cpu.old_logprob, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_confidence_delta_matches_reference(dtype):
    batch, length = 33, sized(3001, 700)  # several of the kernel's blocks a row on CUDA
    pair = torch.rand(2, length, batch, device=DEVICE, generator=generator(1)).to(dtype)
    current, previous = pair[0].T, pair[1].T  # [B, L], not contiguous
    still_masked = torch.rand(batch, length, device=DEVICE, generator=generator(2)) < 0.6
    still_masked[0], still_masked[1] = False, True
    current[~still_masked] = float("nan")  # never read
    previous[~still_masked] = float("nan")

    out = confidence_delta(current, previous, still_masked)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and out.shape == (batch,)
    ref = reference.confidence_delta(current, previous, still_masked)
    plain = torch.where(still_masked, current - previous, torch.zeros_like(current)).sum(dim=1)
    # A sum of L terms in float32 (float64): a few units per halving of the summation tree.
    magnitude = torch.where(still_masked, (current.double() - previous.double()).abs(), 0.0).sum(dim=1)
    acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    assert_no_worse_than_torch(out, plain, ref, 16 * acc_eps * magnitude, "confidence delta")
    assert out[0] == 0
