"""sample_step and sample_step_linear against the float64 reference (Gumbel-max + noise-free confidence)."""
import math

import pytest
import torch
from gpu_device import DEVICE, generator, llada_vocab, mask_id_for
from support import assert_same_samples, assert_unchanged, assert_valid_step, reference_scores, snapshot

from daca_kernels import reference, sample_step, sample_step_linear
from daca_kernels.hashing import STREAM_GUMBEL, seed32
from daca_kernels.kernels import sampling
from daca_kernels.ops import chunked_sampling
from daca_kernels.ops.sample_step import score_scales


def make_logits(n, vocab, dtype, seed, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * spread).to(dtype)


CASES = [(1, 37), (6, 1000), (3, 3001)]


@pytest.mark.parametrize("n,vocab", CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(backend, poison_allocations, n, vocab, temperature, dtype):
    logits = make_logits(n, vocab, dtype, seed=n + vocab)
    mask_id = vocab // 3
    logits[:, mask_id] = logits.max() + 5  # would win every row if it were not excluded
    row_ids = torch.randint(0, 2**32, (n,), generator=torch.Generator().manual_seed(1))
    before = snapshot(logits, row_ids)
    tokens, confidence, entropy = sample_step(
        logits, temperature=temperature, seed=11, step=5, row_ids=row_ids, mask_id=mask_id, return_entropy=True
    )
    assert_unchanged(before, logits, row_ids)
    assert confidence.dtype == torch.float32 and entropy.dtype == torch.float32
    assert_valid_step(tokens, confidence, entropy, logits.double(), logits, temperature, 11, 5, row_ids, mask_id)


def test_float64_logits_give_float64_results(backend):
    logits = make_logits(4, 300, torch.float64, seed=3)
    tokens, confidence, entropy = sample_step(logits, temperature=1.0, seed=2, step=0, return_entropy=True)
    assert confidence.dtype == torch.float64 and entropy.dtype == torch.float64
    ref_tokens, ref_conf, ref_entropy = reference.sample_step(logits, 1.0, 2, 0, return_entropy=True)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(confidence, ref_conf, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)


def test_non_contiguous_rows_and_columns(backend):
    big = make_logits(10, 2 * 501, torch.float32, seed=4)
    logits = big[::3, ::2]  # strided rows and columns, V = 501
    assert not logits.is_contiguous()
    tokens, confidence = sample_step(logits, temperature=1.3, seed=7, step=2, mask_id=0)
    ref_tokens, ref_conf = reference.sample_step(logits.contiguous(), 1.3, 7, 2, mask_id=0)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(confidence, ref_conf, rtol=1e-5, atol=1e-7)


def test_backends_agree_token_for_token(monkeypatch):
    logits = make_logits(5, 777, torch.float32, seed=8)
    row_ids = torch.tensor([3, 99, 2**32 - 1, 0, 12345])
    results = {}
    for name in ("triton", "torch", "reference"):
        monkeypatch.setenv("DACA_BACKEND", name)
        results[name] = sample_step(logits, temperature=0.9, seed=2**40 + 5, step=17, row_ids=row_ids, mask_id=776)
    for name in ("torch", "reference"):
        assert torch.equal(results[name][0], results["triton"][0]), name
        torch.testing.assert_close(results[name][1], results["triton"][1], rtol=2e-6, atol=1e-7)


def test_noise_depends_only_on_seed_step_and_row_id(backend):
    row = make_logits(1, 400, torch.float32, seed=9)
    logits = row.expand(4, 400)  # one row read four times (row stride 0)
    same_id = sample_step(logits, temperature=2.0, seed=1, step=3, row_ids=torch.tensor([8, 8, 8, 8]))[0]
    assert (same_id == same_id[0]).all()
    alone = sample_step(row, temperature=2.0, seed=1, step=3, row_ids=torch.tensor([8]))[0]
    assert alone.item() == same_id[0].item()
    draws = {
        sample_step(row, temperature=2.0, seed=seed, step=step, row_ids=torch.tensor([row_id]))[0].item()
        for seed, step, row_id in [(1, 3, 8), (2, 3, 8), (1, 4, 8), (1, 3, 9), (5, 0, 0), (6, 1, 2)]
    }
    assert len(draws) > 1, "seed, step and row id must all change the noise"
    again = sample_step(logits, temperature=2.0, seed=1, step=3, row_ids=torch.tensor([8, 9, 10, 11]))[0]
    assert torch.equal(again, sample_step(logits, temperature=2.0, seed=1, step=3, row_ids=torch.tensor([8, 9, 10, 11]))[0])


def test_gumbel_max_samples_softmax_at_temperature(monkeypatch):
    # Distribution check on the torch path (the noise formula is shared with the kernel, see
    # test_backends_agree_token_for_token): frequencies of 40,000 draws within 5 sigma.
    monkeypatch.setenv("DACA_BACKEND", "torch")
    base = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, 3.0]])
    temperature, n = 1.7, 40000
    tokens, confidence = sample_step(base.expand(n, 6), temperature=temperature, seed=123, step=0, mask_id=5)
    expected = torch.softmax(base[0, :5] / temperature, dim=0).double()
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[5] == 0
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts[:5] / n - expected).abs() <= 5 * sigma).all(), (counts[:5] / n, expected)
    untempered = torch.softmax(base[0, :5], dim=0)
    torch.testing.assert_close(confidence, untempered[tokens])


def test_argmax_ties_go_to_the_lowest_id(backend):
    logits = torch.tensor([
        [0.0, 2.0, 1.0, 2.0, 2.0],
        [5.0, 5.0, 5.0, 5.0, 5.0],
        [1.0, 3.0, 3.0, -1.0, 0.0],
    ])
    tokens, confidence = sample_step(logits, temperature=0.0, seed=0, step=0)
    assert tokens.tolist() == [1, 0, 1]
    tokens, confidence = sample_step(logits, temperature=0.0, seed=0, step=0, mask_id=1)
    assert tokens.tolist() == [3, 0, 2]
    torch.testing.assert_close(confidence[1], torch.tensor(0.25))


def test_several_vocabulary_blocks(backend):
    # V just above the widest block any path uses (2**15 under the interpreter): the running
    # maxima, ties and log-sum-exp must carry across blocks, the last block holding one id.
    vocab = 2**15 + 1
    logits = make_logits(3, vocab, torch.float32, seed=12, spread=1.0)
    logits[0, vocab - 1] = 9.0  # the maximum is alone in the last block
    logits[1, [7, 2**15 - 3, vocab - 1]] = 8.0  # a tie across blocks: the lowest id wins
    logits[2, 2**15 + 0] = 30.0  # the second block rescales the first block's sums
    tokens, confidence, entropy = sample_step(logits, temperature=0.0, seed=0, step=0, return_entropy=True)
    assert tokens.tolist() == [vocab - 1, 7, 2**15]
    assert_valid_step(tokens, confidence, entropy, logits.double(), logits, 0.0, 0, 0, None, None)
    tokens, confidence, entropy = sample_step(logits, temperature=1.1, seed=4, step=9, mask_id=vocab - 1, return_entropy=True)
    assert_valid_step(tokens, confidence, entropy, logits.double(), logits, 1.1, 4, 9, None, vocab - 1)


def test_zero_rows(backend):
    tokens, confidence = sample_step(torch.randn(0, 50), temperature=1.0, seed=0, step=0, mask_id=3)
    assert tokens.shape == (0,) and confidence.shape == (0,)


def test_nan_row_gives_nan_confidence(backend):
    logits = make_logits(3, 64, torch.float32, seed=5)
    logits[1, 10] = float("nan")
    _, confidence = sample_step(logits, temperature=0.0, seed=0, step=0)
    assert torch.isnan(confidence[1]) and torch.isfinite(confidence[[0, 2]]).all()


def make_head(n, hidden_size, vocab, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 3 / hidden_size**0.5).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype) if with_bias else None
    return hidden, weight, bias


@pytest.mark.parametrize("n,hidden_size,vocab,chunk_size", [(1, 16, 1000, None), (7, 8, 301, 3)])
@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_linear_form_matches_reference(backend, poison_allocations, n, hidden_size, vocab, chunk_size, dtype, with_bias, temperature):
    hidden, weight, bias = make_head(n, hidden_size, vocab, dtype, seed=n, with_bias=with_bias)
    hidden.requires_grad_()
    row_ids = torch.arange(n) * 1000 + 7
    before = snapshot(hidden, weight, bias)
    tokens, confidence, entropy = sample_step_linear(
        hidden, weight, bias=bias, temperature=temperature, seed=3, step=1, row_ids=row_ids, mask_id=vocab - 1,
        return_entropy=True, chunk_size=chunk_size,
    )
    assert_unchanged(before, hidden, weight, bias)
    assert not confidence.requires_grad
    ref_logits = reference.linear_logits(hidden.detach().double(), weight.double(), None if bias is None else bias.double())
    plain_logits = hidden.detach() @ weight.T + (0 if bias is None else bias)
    assert_valid_step(tokens, confidence, entropy, ref_logits, plain_logits, temperature, 3, 1, row_ids, vocab - 1)


def test_opcheck(backend):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 33, generator=g)
    row_ids = torch.tensor([0, 5, 9, 2])
    torch.library.opcheck(torch.ops.daca.sample_step.default, (logits, row_ids, 0.8, 12, 3, 7, True, backend))
    torch.library.opcheck(torch.ops.daca.sample_step.default, (logits, None, 0.0, 0, 0, -1, False, backend))
    hidden, weight = torch.randn(5, 6, generator=g), torch.randn(33, 6, generator=g)
    torch.library.opcheck(
        torch.ops.daca.sample_step_linear.default, (hidden, weight, torch.randn(33, generator=g), None, 1.0, 4, 2, 0, True, 2, backend)
    )


STEP_CASES = {
    "negative temperature": ({"temperature": -0.1}, ValueError, "temperature must be a finite number >= 0"),
    "tensor temperature": ({"temperature": torch.tensor(1.0)}, TypeError, "temperature must be a Python float"),
    "nan temperature": ({"temperature": float("nan")}, ValueError, "temperature must be"),
    "negative seed": ({"seed": -1}, ValueError, "seed must lie in"),
    "float seed": ({"seed": 1.0}, TypeError, "seed must be an int"),
    "negative step": ({"step": -1}, ValueError, "step must be in"),
    "huge step": ({"step": 2**32}, ValueError, "step must be in"),
    "mask id = V": ({"mask_id": 50}, ValueError, r"mask_id must be in \[0, 50\)"),
    "row id too large": ({"row_ids": torch.tensor([0, 1, 2**32, 3])}, ValueError, r"row_ids must lie in \[0, 4294967296\); row_ids\[2\]"),
    "negative row id": ({"row_ids": torch.tensor([0, -1, 2, 3])}, ValueError, r"row_ids\[1\] = -1"),
    "row ids length": ({"row_ids": torch.tensor([0, 1])}, ValueError, "row_ids must have shape"),
    "float row ids": ({"row_ids": torch.zeros(4)}, TypeError, "row_ids must have dtype"),
    "row ids device": ({"row_ids": torch.zeros(4, dtype=torch.long, device="meta")}, ValueError, "row_ids is on meta"),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_sample_step_rejects(backend, case):
    overrides, error, message = STEP_CASES[case]
    logits = make_logits(4, 50, torch.float32, seed=0)
    kwargs = {"temperature": 1.0, "seed": 0, "step": 0, **overrides}
    before = snapshot(logits)
    with pytest.raises(error, match=message):
        sample_step(logits, **kwargs)
    assert_unchanged(before, logits)


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda x: x[0], ValueError, "logits must be 2-D"),
        (lambda x: x.long(), TypeError, "logits must have dtype"),
        (lambda x: x[:, :0], ValueError, "non-empty last"),
        (lambda x: x.tolist(), TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_sample_step_rejects_bad_logits(make, error, message):
    with pytest.raises(error, match=message):
        sample_step(make(make_logits(4, 50, torch.float32, seed=0)), temperature=0.0, seed=0, step=0)


def test_mask_id_needs_another_candidate():
    with pytest.raises(ValueError, match="mask_id leaves no candidate"):
        sample_step(torch.zeros(2, 1), temperature=0.0, seed=0, step=0, mask_id=0)


LINEAR_CASES = {
    "hidden size": (lambda h, w: (h, w[:, :7], {}), ValueError, r"weight must have shape \[V, H\] with H = 8"),
    "dtype mismatch": (lambda h, w: (h, w.double(), {}), TypeError, "weight must have the dtype of hidden"),
    "bias length": (lambda h, w: (h, w, {"bias": torch.zeros(49)}), ValueError, r"bias must have shape \[V\]"),
    "hidden 1-D": (lambda h, w: (h[0], w, {}), ValueError, "hidden must be 2-D"),
    "device": (lambda h, w: (h, w.to("meta"), {}), ValueError, "weight is on meta"),
    "chunk size": (lambda h, w: (h, w, {"chunk_size": 0}), ValueError, "chunk_size must be >= 1"),
    "row ids": (lambda h, w: (h, w, {"row_ids": torch.tensor([0, 1, 2, 2**33])}), ValueError, "row_ids must lie in"),
    "temperature": (lambda h, w: (h, w, {"temperature": -2.0}), ValueError, "temperature must be"),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_sample_step_linear_rejects(backend, case):
    make, error, message = LINEAR_CASES[case]
    hidden, weight, _ = make_head(4, 8, 50, torch.float32, seed=0, with_bias=False)
    h, w, overrides = make(hidden, weight)
    kwargs = {"temperature": 1.0, "seed": 0, "step": 0, **overrides}
    before = snapshot(hidden, weight)
    with pytest.raises(error, match=message):
        sample_step_linear(h, w, **kwargs)
    assert_unchanged(before, hidden, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_matches_torch_path(monkeypatch, dtype):
    g = generator(0)
    n, vocab = 64, llada_vocab()
    mask_id = mask_id_for(vocab)
    logits = (torch.randn(n, vocab, generator=g, device=DEVICE) * 3).to(dtype)
    row_ids = torch.randint(0, 2**32, (n,), generator=g, device=DEVICE)
    out = {}
    for name in ("triton", "torch"):
        monkeypatch.setenv("DACA_BACKEND", name)
        out[name] = sample_step(logits, temperature=0.8, seed=1, step=4, row_ids=row_ids, mask_id=mask_id, return_entropy=True)
    tokens = out["triton"][0].cpu()
    mismatch = tokens != out["torch"][0].cpu()
    # GPU log/exp are not bit-identical to the CPU path's: only near-ties may differ.
    assert mismatch.sum() <= 1
    assert_valid_step(tokens, out["triton"][1].cpu(), out["triton"][2].cpu(), logits.cpu().double(), logits.cpu(), 0.8, 1, 4, row_ids.cpu(), mask_id)
    assert math.isfinite(out["triton"][1].sum().item())


@pytest.mark.parametrize("linear", [False, True])
def test_out_of_range_row_ids_give_no_token_without_a_host_read(backend, no_host_reads, linear):
    # Guarded on the device (as on CUDA): a row id outside [0, 2**32) gives token -1 and NaN, the
    # other rows their tokens of a valid call; no host read.
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 16, generator=g), torch.randn(300, 16, generator=g)
    row_ids = torch.tensor([7, -1, 2**32, 9, 11])
    good = torch.tensor([True, False, False, True, True])

    def call(h, ids):
        kwargs = dict(temperature=0.8, seed=3, step=2, row_ids=ids, return_entropy=True)
        return sample_step_linear(h, weight, **kwargs) if linear else sample_step(h @ weight.T, **kwargs)

    with no_host_reads():
        tokens, confidence, entropy = call(hidden, row_ids)
    assert (tokens[~good] == -1).all() and torch.isnan(confidence[~good]).all() and torch.isnan(entropy[~good]).all()
    want = call(hidden[good], row_ids[good])
    assert torch.equal(tokens[good], want[0])
    for got, expected in zip((confidence, entropy), want[1:]):  # another batch shape rounds the matmul otherwise
        torch.testing.assert_close(got[good], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the fast noise with tl.log2 under the interpreter")
@pytest.mark.parametrize("temperature,dtype", [(0.6, torch.bfloat16), (1.0, torch.float32), (1.8, torch.bfloat16)])
def test_fast_noise_kernel_samples_gumbel_maxima(temperature, dtype):
    # The GPU's noise formula (daca_kernels.kernels.gumbel, tl.log2 for the hardware logarithm):
    # candidates are maxima of the exact float64 scores up to a near-tie and equal the exact
    # kernel's elsewhere; the mask id in the middle of a row (its own tile) and in the last one.
    for vocab, mask_id in [(3001, 1500), (5000, 4999)]:
        logits = make_logits(8, vocab, dtype, seed=vocab, spread=2.0)
        row_ids = torch.randint(0, 2**32, (8,), generator=torch.Generator().manual_seed(vocab))
        call = (logits, row_ids, *score_scales(temperature), seed32(21), 3, STREAM_GUMBEL, mask_id, True)
        tokens, confidence, entropy = sampling.sample_step_forward(*call, fast_noise=True)
        exact = sampling.sample_step_forward(*call, fast_noise=False)
        assert_valid_step(tokens, confidence, entropy, logits.double(), logits, temperature, 21, 3, row_ids, mask_id)
        assert_same_samples(tokens, exact[0], reference_scores(logits, temperature, 21, 3, row_ids, mask_id), "fast noise")
        torch.testing.assert_close(confidence, exact[1], rtol=0, atol=0, msg="the noise never touches the confidence")


def test_every_token_is_drawn_alike_from_flat_logits(monkeypatch):
    # The per-token hash must not favour token ids: 60,000 rows of 256 equal logits draw each id
    # with probability 1/256 (a chi-square over the ids, five standard deviations).
    monkeypatch.setenv("DACA_BACKEND", "torch")
    n, vocab = 60000, 256
    tokens = sample_step(torch.zeros(1, vocab).expand(n, vocab), temperature=1.0, seed=99, step=1)[0]
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = n / vocab
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < (vocab - 1) + 5 * (2 * (vocab - 1)) ** 0.5, chi2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bfloat16_rows_read_as_32_bit_pairs_or_not_agree(backend, temperature):
    # Contiguous bfloat16 rows that start on 16 bytes are read two tokens per 32-bit load in full
    # tiles (a power-of-two vocabulary gives full tiles under the interpreter too); the same rows
    # at an odd offset too, after a prologue up to their first token on 16 bytes. Same candidates;
    # the softmax sums group the tokens from that token, so confidence and entropy agree to rounding.
    vocab = 4096
    wide = make_logits(5, vocab + 1, torch.bfloat16, seed=31)
    aligned, offset = wide[:, :vocab].contiguous(), wide[:, 1:]
    offset.copy_(aligned)
    assert aligned.data_ptr() % 4 == 0 and offset.data_ptr() % 4 == 2
    results = [sample_step(x, temperature=temperature, seed=3, step=1, mask_id=17, return_entropy=True)
               for x in (aligned, offset)]
    assert torch.equal(results[0][0], results[1][0])
    for got, expected in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert_valid_step(*results[0], aligned.double(), aligned, temperature, 3, 1, None, 17)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter at a GPU's launch settings")
@pytest.mark.parametrize("dtype,fast_noise", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True),
                                              (torch.float32, False)])
def test_kernel_at_the_gpu_launch_settings(monkeypatch, dtype, fast_noise):
    # Tiles of 2,048 tokens in lanes of 16 bytes, as on a GPU (the interpreter otherwise reads a
    # whole row per tile): full tiles before and after the mask id's tile, or the mask id in the
    # last, partial tile; argmax, T < 1 and T > 1. Without the fast noise the candidates are the
    # PyTorch path's, bit for bit.
    monkeypatch.setattr(sampling, "row_block", lambda length, gpu_block: gpu_block)
    for vocab, mask_id in [(7000, 3000), (6200, 6199)]:
        logits = make_logits(4, vocab, dtype, seed=vocab, spread=2.0)
        logits[:, mask_id] = logits.max() + 5
        row_ids = torch.randint(0, 2**32, (4,), generator=torch.Generator().manual_seed(vocab))
        for temperature in (0.0, 0.7, 1.6):
            call = (logits, row_ids, *score_scales(temperature), seed32(8), 2, STREAM_GUMBEL, mask_id, True)
            tokens, confidence, entropy = sampling.sample_step_forward(*call, fast_noise=fast_noise)
            assert_valid_step(tokens, confidence, entropy, logits.double(), logits, temperature, 8, 2, row_ids, mask_id)
            if not fast_noise:
                assert torch.equal(tokens, chunked_sampling.sample_step_forward(*call)[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter at a GPU's launch settings")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_at_the_gpu_launch_settings_on_rows_not_on_16_bytes(monkeypatch, dtype):
    # Rows one token past 16 bytes with an odd row stride: each row starts at another offset, so its
    # prologue up to 16 bytes holds another number of tokens (the mask id in it, in a full tile or
    # in the last one). Tiles of 2,048 tokens as on a GPU; the PyTorch path's candidates, bit for bit.
    monkeypatch.setattr(sampling, "row_block", lambda length, gpu_block: gpu_block)
    vocab = 6001
    wide = make_logits(8, vocab + 1, dtype, seed=12, spread=2.0)
    logits = wide[:, 1:]
    assert len({(logits.data_ptr() + i * logits.stride(0) * logits.element_size()) % 16 for i in range(8)}) > 1
    row_ids = torch.arange(8) * 977
    for mask_id in (2, 3000, 6000):
        logits[:, mask_id] = logits.max() + 5
        for temperature in (0.0, 0.7, 1.6):
            call = (logits, row_ids, *score_scales(temperature), seed32(8), 2, STREAM_GUMBEL, mask_id, True)
            tokens, confidence, entropy = sampling.sample_step_forward(*call, fast_noise=False)
            assert_valid_step(tokens, confidence, entropy, logits.double(), logits, temperature, 8, 2, row_ids,
                              mask_id)
            assert torch.equal(tokens, chunked_sampling.sample_step_forward(*call)[0])


def test_a_huge_temperature_never_picks_the_mask_id(backend):
    # 1 / T rounds to 0 in float32 at T = 1e300: the mask id's -inf logit must not become NaN and win.
    logits = make_logits(3, 300, torch.float32, seed=5)
    logits[:, 7] = 50.0
    tokens, confidence = sample_step(logits, temperature=1e300, seed=2, step=0, mask_id=7)
    assert (tokens != 7).all() and ((tokens >= 0) & (tokens < 300)).all()
    assert torch.isfinite(confidence).all()
