"""sample_step and sample_step_linear on CUDA against the float64 reference and the CPU path.

The Gumbel noise is a counter hash of ``(seed, step, row id, token)``, so CUDA and CPU draw the same
candidates: identical at temperature 0, and at a temperature only near-ties of the float64 score
(CUDA's ``log`` need not round as the CPU's does) may go either way. Confidences are checked with the
project's rule against the float64 softmax. gpu-marked; ``DACA_GPU_TESTS_ON_CPU=1`` runs the same
bodies on CPU at small sizes (see ``gpu_device.py``).
"""
import pytest
import torch
from gpu_device import CPU, DEVICE, generator, huge_logits, llada_vocab, mask_id_for, randn, sized
from support import assert_same_samples, assert_valid_step, reference_scores

from daca_kernels import reference, sample_step, sample_step_linear

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SEED, STEP = 2**40 + 17, 9


def assert_cpu_agrees(tokens, confidence, cpu_result, scores, exact):
    """The CPU path's candidates equal CUDA's (``exact``, or up to near-ties of the float64
    ``scores``), and so do the confidences where the candidates are equal."""
    cpu_tokens, cpu_confidence = (t.to(tokens.device) for t in cpu_result[:2])
    if exact:
        assert torch.equal(tokens, cpu_tokens), "argmax candidates differ from the CPU path"
    else:
        assert_same_samples(tokens, cpu_tokens, scores, "CUDA vs CPU path")
    same = tokens == cpu_tokens
    torch.testing.assert_close(confidence[same], cpu_confidence[same], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_step_matches_reference_and_cpu(dtype, temperature):
    n, vocab = sized(48, 5), llada_vocab()
    mask_id = mask_id_for(vocab)
    logits = randn(n, vocab, seed=1, scale=3.0, dtype=dtype)
    logits[:, mask_id] = logits.max() + 5  # the mask id would win every row if it were not excluded
    row_ids = torch.randint(0, 2**32, (n,), device=DEVICE, generator=generator(2))
    kwargs = dict(temperature=temperature, seed=SEED, step=STEP, mask_id=mask_id, return_entropy=True)

    tokens, confidence, entropy = sample_step(logits, row_ids=row_ids, **kwargs)
    assert tokens.device == logits.device
    assert confidence.dtype == entropy.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_valid_step(tokens, confidence, entropy, logits.double(), logits, temperature, SEED, STEP, row_ids, mask_id)

    cpu = sample_step(logits.to(CPU), row_ids=row_ids.to(CPU), **kwargs)
    scores = reference_scores(logits, temperature, SEED, STEP, row_ids, mask_id)
    assert_cpu_agrees(tokens, confidence, cpu, scores, exact=temperature == 0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_step_beyond_2_31_elements(temperature):
    """Rows whose element offsets exceed 2**31 (int64 offsets), checked on a few rows near the end
    and elsewhere. Memory: the bfloat16 logits, 4.3 GB."""
    logits = huge_logits(seed=61)
    num_rows, vocab = logits.shape
    mask_id = mask_id_for(vocab)
    kwargs = dict(temperature=temperature, seed=SEED, step=STEP, mask_id=mask_id)
    tokens, confidence, entropy = sample_step(logits, return_entropy=True, **kwargs)
    assert tokens.shape == (num_rows,)
    rows = torch.tensor([num_rows - 1, num_rows - 2, num_rows - 18, num_rows // 2, 0], device=DEVICE)
    picked = logits[rows]  # default row ids: a row's noise is that of its index
    assert_valid_step(
        tokens[rows], confidence[rows], entropy[rows], picked.double(), picked, temperature, SEED, STEP, rows, mask_id
    )
    cpu = sample_step(picked.to(CPU), row_ids=rows.to(CPU), **kwargs)
    scores = reference_scores(picked, temperature, SEED, STEP, rows, mask_id)
    assert_cpu_agrees(tokens[rows], confidence[rows], cpu, scores, exact=temperature == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_step_awkward_rows(dtype):
    # Strided rows and vocabulary (V odd), default row ids, no mask id; then a single row.
    vocab = sized(50_257, 257)
    base = randn(2 * sized(20, 4), 3 * vocab, seed=3, scale=2.0, dtype=dtype)
    for logits in (base[::2, ::3], base[5:6, :vocab]):
        assert logits.shape[1] == vocab
        tokens, confidence, entropy = sample_step(logits, temperature=1.3, seed=4, step=0, return_entropy=True)
        assert_valid_step(tokens, confidence, entropy, logits.double(), logits, 1.3, 4, 0, None, None)
        cpu = sample_step(logits.to(CPU), temperature=1.3, seed=4, step=0)
        row_ids = torch.arange(logits.shape[0], device=DEVICE)
        assert_cpu_agrees(tokens, confidence, cpu, reference_scores(logits, 1.3, 4, 0, row_ids, None), exact=False)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_step_linear_matches_reference_and_cpu(dtype, temperature):
    n, h, vocab = sized(100, 7), sized(256, 16), llada_vocab()
    mask_id = mask_id_for(vocab)
    hidden = randn(n, h, seed=5, dtype=dtype)
    weight = randn(vocab, h, seed=6, scale=3 / h**0.5, dtype=dtype)
    bias = randn(vocab, seed=7, dtype=dtype)
    bias[mask_id] = 40.0  # the mask id would win every row if it were not excluded
    row_ids = torch.arange(n, device=DEVICE) * 1000 + 3
    kwargs = dict(bias=bias, temperature=temperature, seed=SEED, step=STEP, mask_id=mask_id, return_entropy=True)

    tokens, confidence, entropy = sample_step_linear(hidden, weight, row_ids=row_ids, chunk_size=sized(32, 3), **kwargs)
    ref_logits = reference.linear_logits(hidden.double(), weight.double(), bias.double())
    plain_logits = hidden @ weight.T + bias
    assert_valid_step(tokens, confidence, entropy, ref_logits, plain_logits, temperature, SEED, STEP, row_ids, mask_id)

    on_cpu = {**kwargs, "bias": bias.to(CPU)}
    cpu = sample_step_linear(hidden.to(CPU), weight.to(CPU), row_ids=row_ids.to(CPU), **on_cpu)
    # CUDA and CPU form the logits with different matmuls: near-ties may differ even at temperature 0.
    scores = reference_scores(ref_logits, temperature, SEED, STEP, row_ids, mask_id)
    assert_cpu_agrees(tokens, confidence, cpu, scores, exact=False)
