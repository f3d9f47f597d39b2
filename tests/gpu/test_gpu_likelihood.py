"""The likelihood estimators on CUDA equal to the same estimators on CPU: values and parameter
gradients of one float64 tiny model on both devices (the masks are bit-identical, so only
rounding separates the two). gpu-marked; ``DACA_GPU_TESTS_ON_CPU=1`` runs the same bodies on CPU
(see ``gpu_device.py``).
"""
import pytest
import torch
from gpu_device import CPU, DEVICE, generator, tiny_lm_on_cpu_and_device

from daca_kernels import coupled_logprob, elbo_samples, one_step_logprob, stratified_logprob

pytestmark = pytest.mark.gpu

VOCAB, SEED = 61, 1234


def make_batch():
    """CPU ``(ids, completion_mask, attention_mask)`` ``[4, 24]``: ids never the mask id,
    completions from position 9 to ragged ends, left padding on rows 2 and 3."""
    ids = torch.randint(1, VOCAB - 1, (4, 24), generator=generator(0, CPU))
    positions = torch.arange(24)
    completion = (positions >= 9) & (positions < torch.tensor([[24], [17], [24], [21]]))
    attention_mask = (positions >= torch.tensor([[0], [0], [3], [1]])).long()
    return ids, completion, attention_mask


# name -> estimator(lm, ids, completion, attention_mask) -> per-token values (a tensor, or ElboSamples)
ESTIMATORS = {
    "one_step_prompt_masking": lambda lm, ids, c, am: one_step_logprob(
        lm, ids, c, seed=SEED, prompt_mask_prob=0.25, attention_mask=am
    ),
    "stratified_random_k3_row_offset": lambda lm, ids, c, am: stratified_logprob(
        lm, ids, c, num_strata=3, seed=SEED, attention_mask=am, row_offset=11
    ),
    "stratified_interleave_k4_checkpoint": lambda lm, ids, c, am: stratified_logprob(
        lm, ids, c, num_strata=4, seed=SEED, scheme="interleave", attention_mask=am, checkpoint=True
    ),
    "coupled": lambda lm, ids, c, am: coupled_logprob(lm, ids, c, seed=SEED, attention_mask=am),
    "elbo_samples": lambda lm, ids, c, am: elbo_samples(lm, ids, c, num_samples=3, seed=SEED, attention_mask=am),
    "elbo_samples_blocks_of_4": lambda lm, ids, c, am: elbo_samples(
        lm, ids, c, num_samples=2, seed=SEED, attention_mask=am, block_length=4
    ),
}


def values_and_grads(estimator, lm, inputs):
    """The estimator's per-token values (and, for ELBO samples, their masks and ratios) and the
    gradient of ``sum(values * weights)``, fixed random weights, with respect to every parameter."""
    result = estimator(lm, *inputs)
    values = result if isinstance(result, torch.Tensor) else result.logprob
    extras = [] if isinstance(result, torch.Tensor) else [result.mask, result.t]
    weights = torch.randn(values.shape, dtype=values.dtype, generator=generator(1, CPU)).to(values.device)
    grads = torch.autograd.grad((values * weights).sum(), list(lm.parameters()), allow_unused=True)
    return values.detach(), extras, grads


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_estimator_on_device_equals_cpu(estimator, shift):
    lm_cpu, lm_device = tiny_lm_on_cpu_and_device(vocab=VOCAB, seed=2, shift=shift, head_bias=shift)
    inputs = make_batch()
    cpu_values, cpu_extras, cpu_grads = values_and_grads(ESTIMATORS[estimator], lm_cpu, inputs)
    values, extras, grads = values_and_grads(ESTIMATORS[estimator], lm_device, [t.to(DEVICE) for t in inputs])

    assert values.device == DEVICE and values.dtype == torch.float64
    assert (cpu_values != 0).any()
    torch.testing.assert_close(values.to(CPU), cpu_values, rtol=1e-9, atol=1e-11)
    for extra, cpu_extra in zip(extras, cpu_extras, strict=True):
        assert torch.equal(extra.to(CPU), cpu_extra)
    assert sum(g is not None for g in cpu_grads) > 0
    for grad, cpu_grad in zip(grads, cpu_grads, strict=True):
        assert (grad is None) == (cpu_grad is None)
        if grad is not None:
            # Norm-wise: float64 rounding of two devices, far below any real difference.
            assert (grad.to(CPU) - cpu_grad).norm() <= 1e-8 * cpu_grad.norm() + 1e-12
