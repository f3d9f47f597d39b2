"""gather_logprob and stratified_gather_logprob against the float64 reference."""
import pytest
import torch
from support import assert_no_worse_than_torch, assert_unchanged, bf16_ulp, plain_gather_logprob, snapshot

from daca_kernels import gather_logprob, reference, stratified_gather_logprob


def make_case(n, vocab, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * scale).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return logits, targets


CASES = [  # (N, V): N = 1, V not a power of two, a V above one interpreter block
    (1, 1000),
    (13, 1000),
    (4, 32003),
    (9, 257),
]


@pytest.mark.parametrize("n,vocab", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_entropy_match_reference(backend, poison_allocations, n, vocab, dtype, temperature):
    logits, targets = make_case(n, vocab, dtype, seed=n * vocab)
    before = snapshot(logits, targets)
    out, ent = gather_logprob(logits, targets, temperature=temperature, return_entropy=True)
    ref_out, ref_ent = reference.gather_logprob(logits.double(), targets, temperature=temperature, return_entropy=True)
    plain_out, plain_ent = plain_gather_logprob(logits, targets, temperature=temperature)
    assert out.dtype == torch.float32 and ent.dtype == torch.float32
    assert_no_worse_than_torch(out, plain_out, ref_out, 1e-5, "logprob")
    assert_no_worse_than_torch(ent, plain_ent, ref_ent, 1e-5, "entropy")
    assert_unchanged(before, logits, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradient_matches_reference(backend, poison_allocations, dtype, with_entropy):
    logits, targets = make_case(11, 1000, dtype, seed=7)
    g = torch.Generator().manual_seed(3)
    upstream = torch.randn(11, generator=g)
    upstream_ent = torch.randn(11, generator=g)

    def grad_of(fn, x):
        x = x.detach().clone().requires_grad_()
        result = fn(x)
        if with_entropy:
            loss = (result[0] * upstream).sum() + (result[1] * upstream_ent).sum()
        else:
            loss = (result[0] * upstream).sum()
        loss.backward()
        return x.grad

    fused = grad_of(lambda x: gather_logprob(x, targets, temperature=0.8, return_entropy=True), logits)
    ref = grad_of(lambda x: reference.gather_logprob(x, targets, temperature=0.8, return_entropy=True), logits.double())
    plain = grad_of(lambda x: plain_gather_logprob(x, targets, temperature=0.8), logits)
    assert fused.dtype == dtype and fused.shape == logits.shape
    tol = 1e-6 + (bf16_ulp(ref) if dtype == torch.bfloat16 else 1e-6)
    assert_no_worse_than_torch(fused, plain, ref, tol, "d logits")


def test_rows_with_repeats_select_and_accumulate(backend, poison_allocations):
    logits, _ = make_case(6, 1000, torch.float32, seed=11)
    rows = torch.tensor([4, 0, 4, 4, 2, 0, 5])
    targets = torch.tensor([3, 999, 3, 17, 0, 500, 42])
    upstream = torch.randn(7, generator=torch.Generator().manual_seed(5))
    x = logits.clone().requires_grad_()
    out = gather_logprob(x, targets, rows=rows, temperature=1.3)
    (out * upstream).sum().backward()
    xr = logits.double().requires_grad_()
    ref = reference.gather_logprob(xr, targets, rows, temperature=1.3)
    (ref * upstream.double()).sum().backward()
    plain_out, _ = plain_gather_logprob(logits, targets, rows, temperature=1.3)
    assert_no_worse_than_torch(out, plain_out, ref, 1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-6, rtol=1e-5)
    # Rows 1 and 3 are never selected: exactly zero gradient.
    assert torch.equal(x.grad[[1, 3]], torch.zeros(2, 1000))


def test_non_contiguous_logits_are_read_in_place(backend, poison_allocations):
    g = torch.Generator().manual_seed(2)
    full = torch.randn(3, 6, 2 * 500, generator=g)
    # Strided vocabulary and leading dims that cannot be flattened without a copy.
    logits = full[:, 1:, ::2]
    assert not logits.is_contiguous()
    targets = torch.randint(0, 500, (3, 5), generator=g)
    x = logits.detach().clone().requires_grad_()  # contiguous copy for the reference gradient
    view = full.clone().requires_grad_()
    out = gather_logprob(view[:, 1:, ::2], targets)
    assert out.shape == (3, 5)
    ref = reference.gather_logprob(x.double(), targets.reshape(-1)).view(3, 5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    out.sum().backward()
    reference.gather_logprob(x, targets.reshape(-1)).sum().backward()
    torch.testing.assert_close(view.grad[:, 1:, ::2], x.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(view.grad[:, 0], torch.zeros_like(view.grad[:, 0]))
    assert torch.equal(view.grad[..., 1::2], torch.zeros_like(view.grad[..., 1::2]))


@pytest.mark.parametrize(
    "make_view",
    [
        lambda base: base[: 4 * 7 * 40].view(4, 7, 40),  # contiguous
        lambda base: base[3 : 3 + 5 * 2 * 50].view(5, 2, 50)[:, 1, :33],  # sliced: row stride 100
        lambda base: base[: 6 * 40].view(6, 40).t()[:, :5].unsqueeze(0),  # leading size-1 dim, odd strides
        lambda base: base[: 3 * 1 * 24].view(3, 1, 24),  # an inner size-1 dim
        lambda base: base[: 16].view(1, 16),  # a single row
    ],
)
def test_row_starts_locate_every_row(make_view):
    from daca_kernels.kernels.logprob import row_starts

    base = torch.arange(2000, dtype=torch.float64)  # each element holds its own storage offset
    logits = make_view(base)
    rows = torch.randperm(logits[..., 0].numel(), generator=torch.Generator().manual_seed(0))
    starts, unit = row_starts(logits, rows)
    first_elements = logits[..., 0].reshape(-1)[rows].long() - logits.storage_offset()
    assert torch.equal(starts * unit, first_elements)


@pytest.mark.parametrize("with_rows", [False, True])
def test_gradcheck_float64(backend, with_rows):
    g = torch.Generator().manual_seed(1)
    # gradcheck runs the op twice per logit (interpreted on the triton backend): few logits, a
    # vocabulary that still leaves lanes of its block masked.
    logits = torch.randn(4, 13, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (5 if with_rows else 4,), generator=g)
    rows = torch.tensor([0, 3, 3, 1, 0]) if with_rows else None

    def fn(x):
        out, ent = gather_logprob(x, targets, rows=rows, temperature=0.9, return_entropy=True)
        return out, ent

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7)


def test_nan_row_gives_nan_only_there(backend):
    logits, targets = make_case(4, 300, torch.float32, seed=9)
    logits[2, 17] = float("nan")
    out = gather_logprob(logits, targets)
    assert out[2].isnan()
    assert torch.isfinite(out[[0, 1, 3]]).all()


def test_minus_inf_logits_are_defined(backend):
    logits, _ = make_case(3, 200, torch.float32, seed=4)
    logits[:, 50:] = float("-inf")  # e.g. a vocabulary restricted by masking
    targets = torch.tensor([3, 60, 49])
    out, ent = gather_logprob(logits, targets, return_entropy=True)
    ref, ref_ent = reference.gather_logprob(logits.double(), targets, return_entropy=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert out[1] == float("-inf")
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)


def test_empty_batch_gives_empty_result(backend):
    logits = torch.randn(0, 100, requires_grad=True)
    out, ent = gather_logprob(logits, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert out.shape == (0,) and ent.shape == (0,)
    out.sum().backward()
    assert logits.grad.shape == (0, 100)
    rows_out = gather_logprob(torch.randn(3, 100), torch.zeros(0, dtype=torch.long), rows=torch.zeros(0, dtype=torch.long))
    assert rows_out.shape == (0,)


def test_int32_ids_are_accepted(backend):
    logits, targets = make_case(5, 100, torch.float32, seed=1)
    a = gather_logprob(logits, targets.int(), rows=torch.arange(5, dtype=torch.int32))
    b = gather_logprob(logits, targets)
    assert torch.equal(a, b)


@pytest.mark.parametrize("shift", [False, True])
def test_stratified_gather_matches_reference(backend, poison_allocations, shift):
    g = torch.Generator().manual_seed(21)
    K, B, L, V = 3, 2, 7, 300
    logits = torch.randn(K, B, L, V, generator=g) * 2
    targets = torch.randint(0, V, (B, L), generator=g)
    strata = torch.randint(-1, K, (B, L), generator=g)
    if shift:
        strata[:, 0] = -1
    x = logits.clone().requires_grad_()
    out = stratified_gather_logprob(x, targets, strata, shift=shift)
    xr = logits.double().requires_grad_()
    ref = reference.stratified_gather_logprob(xr, targets, strata, shift=shift)
    assert out.shape == (B, L) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert torch.equal(out[strata < 0], torch.zeros_like(out[strata < 0]))
    weights = torch.randn(B, L, generator=g)
    (out * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-6, rtol=1e-5)


def test_stratified_gather_only_selected_copies_get_gradient(backend):
    K, B, L, V = 4, 1, 4, 50
    logits = torch.randn(K, B, L, V, requires_grad=True)
    strata = torch.tensor([[0, 1, 2, 3]])
    stratified_gather_logprob(logits, torch.zeros(B, L, dtype=torch.long), strata).sum().backward()
    for k in range(K):
        nonzero_positions = logits.grad[k, 0].abs().sum(-1).nonzero().flatten().tolist()
        assert nonzero_positions == [k]



@pytest.mark.parametrize("vocab", [257, 32003])
def test_out_of_range_ids_give_nan_without_a_host_read(backend, no_host_reads, vocab):
    # Targets and rows out of range, and a repeated row: NaN for those targets and for the gradient
    # rows they reach (their ids addressed as 0), the reference's values and gradients elsewhere; no
    # read out of bounds and no host read.
    logits, _ = make_case(6, vocab, torch.float32, seed=vocab)
    rows = torch.tensor([1, 2, 2, 9, -1, 5])
    targets = torch.tensor([3, 6, vocab, 1, 2, -7])
    good = torch.tensor([True, True, False, False, False, False])
    x = logits.detach().clone().requires_grad_()
    with no_host_reads():
        out = gather_logprob(x, targets, rows=rows)
        out.sum().backward()
    assert torch.isnan(out[~good]).all() and not torch.isnan(out[good]).any()
    nan_rows = torch.tensor([0, 2, 5])  # 9 and -1 address row 0; row 2 and 5 hold a bad target
    assert torch.isnan(x.grad[nan_rows]).all(dim=1).all()
    ref_x = logits.double().requires_grad_()
    ref = reference.gather_logprob(ref_x, targets[good], rows[good])
    ref.sum().backward()
    torch.testing.assert_close(out[good].double(), ref, rtol=0, atol=1e-5)
    kept = torch.tensor([1, 3, 4])  # row 1 selected once, 3 and 4 never: zero gradient
    torch.testing.assert_close(x.grad[kept].double(), ref_x.grad[kept], rtol=0, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_inplace_backward_writes_the_gradient_over_the_logits(backend, with_entropy):
    # The gradient of logits computed by a layer (not a leaf) is written over the logits and equals
    # the gradient of the default backward, and so does the layer's.
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, 12, generator=g)
    weight = torch.randn(1000, 12, generator=g, requires_grad=True)
    targets = torch.randint(0, 1000, (7,), generator=g)
    upstream, upstream_ent = torch.randn(7, generator=g), torch.randn(7, generator=g)

    def grad(inplace):
        logits = hidden @ weight.T
        logits.retain_grad()
        out = gather_logprob(logits, targets, temperature=0.9, return_entropy=True, inplace_backward=inplace)
        loss = (out[0] * upstream).sum() + ((out[1] * upstream_ent).sum() if with_entropy else 0)
        weight.grad = None
        loss.backward()
        return logits, weight.grad

    plain_logits, plain_weight_grad = grad(False)
    logits, weight_grad = grad(True)
    torch.testing.assert_close(logits.detach(), plain_logits.grad, rtol=0, atol=0)  # written over the logits
    torch.testing.assert_close(logits.grad, plain_logits.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight_grad, plain_weight_grad, rtol=0, atol=0)


def test_inplace_backward_needs_one_contiguous_row_per_target():
    logits, targets = make_case(4, 50, torch.float32, seed=1)
    with pytest.raises(ValueError, match="inplace_backward needs contiguous logits and rows=None"):
        gather_logprob(logits, targets, rows=torch.arange(4), inplace_backward=True)
    with pytest.raises(ValueError, match="inplace_backward needs contiguous logits"):
        gather_logprob(logits.T.contiguous().T, targets, inplace_backward=True)
    with pytest.raises(TypeError, match="inplace_backward"):
        gather_logprob(logits, targets, inplace_backward=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter at a GPU's launch settings")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_kernel_at_the_gpu_launch_settings(monkeypatch, dtype):
    # Tiles of 4,096 logits in lanes of 16 bytes, as on a GPU (the interpreter otherwise reads a
    # whole row per tile): full tiles and a partial last one, with the entropy.
    from daca_kernels.kernels import logprob

    monkeypatch.setattr(logprob, "row_block", lambda length, gpu_block: gpu_block)
    logits, targets = make_case(3, 9000, dtype, seed=11)
    out, stats, entropy = logprob.logprob_forward(logits, None, targets, 1 / 0.7, True)
    ref, ref_entropy = reference.gather_logprob(logits.double(), targets, temperature=0.7, return_entropy=True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    lse = torch.logsumexp(logits.double() / 0.7, -1)
    torch.testing.assert_close((stats[:, 0] + stats[:, 1]).double(), lse, rtol=0, atol=1e-5)


def test_out_of_range_targets_of_one_row_each_give_nan_from_the_kernel(backend, no_host_reads):
    # One row per target, ids guarded on the device: no guard is launched, the forward kernel
    # writes NaN as the log-prob and entropy of the ids outside [0, V) and the reference's values
    # elsewhere; the gradient rows of those ids are NaN.
    vocab = 1000
    logits, _ = make_case(5, vocab, torch.float32, seed=3)
    targets = torch.tensor([3, vocab, -1, 999, 2**40])
    good = torch.tensor([True, False, False, True, False])
    x = logits.detach().clone().requires_grad_()
    with no_host_reads():
        out, entropy = gather_logprob(x, targets, return_entropy=True)
        (out.sum() + entropy.nansum()).backward()
    assert torch.isnan(out[~good]).all() and torch.isnan(entropy[~good]).all()
    ref, ref_entropy = reference.gather_logprob(logits.double()[good], targets[good], return_entropy=True)
    torch.testing.assert_close(out[good].double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[good].double(), ref_entropy, rtol=0, atol=1e-5)
    assert torch.isnan(x.grad[~good]).all(dim=1).all() and not torch.isnan(x.grad[good]).any()
