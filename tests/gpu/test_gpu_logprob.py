"""The log-prob ops on CUDA against their float64 references: outputs and gradients, every dtype.

gather_logprob, stratified_gather_logprob, linear_logprob and linear_topk_logprob at LLaDA's
vocabulary and at awkward shapes, checked with the project's rule
``|fused - ref| <= |plain torch same dtype - ref| + tol`` elementwise. gpu-marked; with
``DACA_GPU_TESTS_ON_CPU=1`` the same bodies run on CPU under the interpreter at small sizes, as a
check of the tests themselves (see ``gpu_device.py``).
"""
import pytest
import torch
from gpu_device import DEVICE, generator, huge_logits, llada_vocab, randn, sized
from support import assert_no_worse_than_torch, plain_gather_logprob, plain_linear_logprob, run_with_grads, ulp

from daca_kernels import gather_logprob, linear_logprob, linear_topk_logprob, reference, stratified_gather_logprob

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def value_tol(dtype):
    """Relative tolerance on log-probabilities and entropies, which the kernels accumulate in
    float32 (float64 for float64 inputs)."""
    return 1e-10 if dtype == torch.float64 else 2e-6


def grad_tol(ref, dtype, sensitivity=0.0):
    """Tolerance on a gradient stored at ``dtype``: the float32 (float64) arithmetic before its
    rounding, relative to ``|ref| + sensitivity`` (see ``lse_sensitivity``), plus the rounding to
    ``dtype`` (a unit in the last place; the absolute part covers half-precision subnormals)."""
    if dtype == torch.float64:
        return 1e-13 + 1e-10 * (ref.abs() + sensitivity)
    arithmetic = 1e-8 + 2e-6 * (ref.abs() + sensitivity)
    return arithmetic if dtype == torch.float32 else arithmetic + 1e-7 + ulp(ref, dtype)


def lse_sensitivity(rows_of, base, weights):
    """``|d/dx sum_n weights[n] * logsumexp(rows_of(x)[n])|`` at ``x = base`` in float64: each
    logit's softmax probability times the weights of the targets that read its row.

    The size of the terms a ``d logits`` entry sums: ``-p g`` and, with an entropy gradient,
    ``-p (log p + H) g_H``. They can cancel (the entry is then much smaller than its terms), so a
    float32 computation is a few float32 units of the terms off, not of the entry; plain PyTorch
    orders the same arithmetic differently and may land closer on a given entry. ``rows_of(x)``
    returns the selected rows, already divided by the temperature.
    """
    x = base.detach().double().requires_grad_()
    (grad,) = torch.autograd.grad((torch.logsumexp(rows_of(x), dim=-1) * weights).sum(), x)
    return grad.abs()


def upstream_grads(n, dtype, seed):
    """Random upstream gradients that are exact at ``dtype``, so the plain path sees the same ones."""
    g = generator(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return [torch.randn(n, device=DEVICE, generator=g).to(dtype).to(acc) for _ in range(2)]


def gather_case(name, dtype):
    """``(base, view, targets, rows, temperature)``: the op reads ``view(base)``; the gradient is
    taken with respect to ``base``."""
    vocab = llada_vocab()
    g = generator(7)
    if name == "llada-vocab":
        n = sized(67, 6)
        base = randn(n, vocab, seed=1, scale=4.0, dtype=dtype)
        return base, lambda x: x, torch.randint(0, vocab, (n,), device=DEVICE, generator=g), None, 0.9
    if name == "one-row-odd-vocab":
        vocab = sized(32_001, 517)
        base = randn(1, vocab, seed=2, scale=3.0, dtype=dtype)
        return base, lambda x: x, torch.randint(0, vocab, (1,), device=DEVICE, generator=g), None, 1.0
    if name == "strided-3d":
        # [L, B, 2V] read as [B, L, V] with strided rows and a vocabulary stride of 2; V odd.
        vocab, batch, length = sized(50_257, 257), 3, 5
        base = randn(length, batch, 2 * vocab, seed=3, scale=3.0, dtype=dtype)
        targets = torch.randint(0, vocab, (batch, length), device=DEVICE, generator=g)
        return base, lambda x: x.transpose(0, 1)[..., ::2], targets, None, 1.7
    if name == "repeated-rows":
        num_rows, n = sized(40, 8), sized(90, 14)
        base = randn(num_rows, vocab, seed=4, scale=3.0, dtype=dtype)
        rows = torch.randint(0, num_rows - 2, (n,), device=DEVICE, generator=g)  # the last two rows unused
        rows[: n // 3] = rows[n // 3 : 2 * (n // 3)]  # every row of the first third repeated
        return base, lambda x: x, torch.randint(0, vocab, (n,), device=DEVICE, generator=g), rows, 0.7
    raise ValueError(name)


def sensitivity_weights(upstreams):
    """``|g| + 2 |g_H|`` per target for ``lse_sensitivity``: the entropy's gradient
    ``-p (log p + H) g_H`` depends on the log-sum-exp twice (through ``p`` and through ``log p``)."""
    return sum(u.double().abs() * (1 + i) for i, u in enumerate(upstreams))


@pytest.mark.parametrize("case", ["llada-vocab", "one-row-odd-vocab", "strided-3d", "repeated-rows"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_logprob_matches_reference(case, dtype):
    base, view, targets, rows, temperature = gather_case(case, dtype)
    with_entropy = case != "one-row-odd-vocab"  # also the backward without an entropy gradient
    upstreams = upstream_grads(targets.numel(), dtype, seed=5)[: 1 + with_entropy]

    def fused(x):
        result = gather_logprob(view(x), targets, rows=rows, temperature=temperature, return_entropy=with_entropy)
        return tuple(t.reshape(-1) for t in result) if with_entropy else (result.reshape(-1),)

    def ref(x):
        result = reference.gather_logprob(view(x), targets.reshape(-1), rows, temperature, return_entropy=True)
        return result[: 1 + with_entropy]

    def plain(x):
        return plain_gather_logprob(view(x), targets, rows, temperature)[: 1 + with_entropy]

    outs, (grad,) = run_with_grads(fused, (base,), upstreams)
    ref_outs, (ref_grad,) = run_with_grads(ref, (base.double(),), [u.double() for u in upstreams])
    plain_outs, (plain_grad,) = run_with_grads(plain, (base,), [u.to(dtype) for u in upstreams])

    assert outs[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    if case == "strided-3d":
        assert gather_logprob(view(base), targets).shape == targets.shape
    for name, out, plain_out, ref_out in zip(("logprob", "entropy"), outs, plain_outs, ref_outs):
        assert_no_worse_than_torch(out, plain_out, ref_out, value_tol(dtype) * (1 + ref_out.abs()), name)
    assert grad.dtype == dtype and grad.device == base.device

    def rows_of(x):
        logits = view(x)
        flat = logits.reshape(-1, logits.shape[-1])
        return (flat if rows is None else flat[rows]) / temperature

    sensitivity = lse_sensitivity(rows_of, base, sensitivity_weights(upstreams))
    assert_no_worse_than_torch(grad, plain_grad, ref_grad, grad_tol(ref_grad, dtype, sensitivity), "d logits")
    if rows is not None:
        assert (grad[-2:] == 0).all(), "rows no target selects get zero gradient"


@pytest.mark.parametrize("repeated", [False, True])
def test_gather_logprob_beyond_2_31_elements(repeated):
    """Rows whose element offsets exceed 2**31 (int64 offsets), forward and backward, against a
    float64 reference on the selected rows only. Memory: the bfloat16 logits and their gradient,
    4.3 GB each (under 10 GB in all)."""
    logits = huge_logits(seed=51)
    num_rows, vocab = logits.shape
    last = [num_rows - 1, num_rows - 3, num_rows - 18]  # offsets above 2**31 on CUDA
    rows = torch.tensor(last + [num_rows * 16 // 17, 5] + (last[:2] if repeated else []), device=DEVICE)
    targets = torch.randint(0, vocab, rows.shape, device=DEVICE, generator=generator(52))
    upstreams = upstream_grads(rows.numel(), torch.bfloat16, seed=53)

    leaf = logits.requires_grad_()
    out, ent = gather_logprob(leaf, targets, rows=rows, temperature=0.9, return_entropy=True)
    (grad,) = torch.autograd.grad((out * upstreams[0]).sum() + (ent * upstreams[1]).sum(), leaf)

    selected, inverse = torch.unique(rows, return_inverse=True)
    sub = logits.detach()[selected]
    (ref_out, ref_ent), (ref_grad,) = run_with_grads(
        lambda x: reference.gather_logprob(x, targets, inverse, 0.9, return_entropy=True),
        (sub.double(),), [u.double() for u in upstreams],
    )
    (plain_out, plain_ent), (plain_grad,) = run_with_grads(
        lambda x: plain_gather_logprob(x, targets, inverse, 0.9), (sub,), [u.to(torch.bfloat16) for u in upstreams]
    )
    assert_no_worse_than_torch(out, plain_out, ref_out, value_tol(torch.bfloat16) * (1 + ref_out.abs()), "logprob")
    assert_no_worse_than_torch(ent, plain_ent, ref_ent, value_tol(torch.bfloat16) * (1 + ref_ent.abs()), "entropy")
    sensitivity = lse_sensitivity(lambda x: x[inverse] / 0.9, sub, sensitivity_weights(upstreams))
    tol = grad_tol(ref_grad, torch.bfloat16, sensitivity)
    assert_no_worse_than_torch(grad[selected], plain_grad, ref_grad, tol, "d logits")
    low, high = torch.aminmax(grad, dim=1)  # per row: no temporary of the gradient's size
    unselected = torch.ones(num_rows, dtype=torch.bool, device=DEVICE)
    unselected[selected] = False
    assert (low[unselected] == 0).all() and (high[unselected] == 0).all(), "unselected rows get zero gradient"


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stratified_gather_logprob_matches_reference(shift, dtype):
    num_strata, batch, length, vocab = 3, 2, 11, llada_vocab()
    logits = randn(num_strata, batch, length, vocab, seed=11, scale=3.0, dtype=dtype)
    g = generator(12)
    targets = torch.randint(0, vocab, (batch, length), device=DEVICE, generator=g)
    strata = torch.randint(-1, num_strata, (batch, length), device=DEVICE, generator=g)
    if shift:
        strata[:, 0] = -1
    (weights,) = upstream_grads(batch * length, dtype, seed=13)[:1]
    weights = weights.view(batch, length)

    def plain(x):
        # The same selection in plain PyTorch at the input dtype: every copy's log-softmax.
        logp = torch.log_softmax(x / 1.1, dim=-1)
        if shift:
            logp = torch.cat([torch.zeros_like(logp[:, :, :1]), logp[:, :, :-1]], dim=2)
        per_copy = logp.gather(-1, targets.expand(num_strata, -1, -1).unsqueeze(-1)).squeeze(-1)
        chosen = per_copy.gather(0, strata.clamp(min=0)[None]).squeeze(0)
        return (torch.where(strata >= 0, chosen, torch.zeros_like(chosen)),)

    (out,), (grad,) = run_with_grads(
        lambda x: (stratified_gather_logprob(x, targets, strata, shift=shift, temperature=1.1),), (logits,), [weights]
    )
    (ref,), (ref_grad,) = run_with_grads(
        lambda x: (reference.stratified_gather_logprob(x, targets, strata, shift, 1.1),), (logits.double(),), [weights.double()]
    )
    (plain_out,), (plain_grad,) = run_with_grads(plain, (logits,), [weights.to(dtype)])
    assert out.shape == (batch, length) and (out[strata < 0] == 0).all()
    assert_no_worse_than_torch(out, plain_out, ref, value_tol(dtype) * (1 + ref.abs()), "logprob")
    b, i = (strata >= 0).nonzero(as_tuple=True)
    sensitivity = lse_sensitivity(lambda x: x[strata[b, i], b, i - int(shift)] / 1.1, logits, weights[b, i].double().abs())
    assert_no_worse_than_torch(grad, plain_grad, ref_grad, grad_tol(ref_grad, dtype, sensitivity), "d logits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided_hidden", [False, True])
@pytest.mark.parametrize("row_chunks", [True, False])  # False: the default, vocabulary chunks on CUDA
def test_linear_logprob_matches_reference(dtype, strided_hidden, row_chunks):
    n, h, vocab = sized(130, 9), sized(256, 16), llada_vocab()
    # The op reads hidden = view(base): every other column of base, or all of a contiguous base.
    base = randn(n, 2 * h if strided_hidden else h, seed=21, dtype=dtype)
    view = (lambda x: x[:, ::2]) if strided_hidden else (lambda x: x)
    weight = randn(vocab, h, seed=22, scale=3 / h**0.5, dtype=dtype)
    bias = randn(vocab, seed=23, dtype=dtype)
    targets = torch.randint(0, vocab, (n,), device=DEVICE, generator=generator(24))
    upstreams = upstream_grads(n, dtype, seed=25)
    chunk = sized(48, 4) if row_chunks else None  # 48 does not divide n

    (out, ent), grads = run_with_grads(
        lambda x, w, b: linear_logprob(view(x), w, targets, bias=b, temperature=0.8, return_entropy=True, chunk_size=chunk),
        (base, weight, bias), upstreams,
    )
    (ref_out, ref_ent), ref_grads = run_with_grads(
        lambda x, w, b: reference.linear_logprob(view(x), w, targets, b, 0.8, return_entropy=True),
        (base.double(), weight.double(), bias.double()), [u.double() for u in upstreams],
    )
    (plain_out, plain_ent), plain_grads = run_with_grads(
        lambda x, w, b: plain_linear_logprob(view(x), w, b, targets, 0.8), (base, weight, bias), [u.to(dtype) for u in upstreams]
    )
    assert_no_worse_than_torch(out, plain_out, ref_out, value_tol(dtype) * (1 + ref_out.abs()), "logprob")
    assert_no_worse_than_torch(ent, plain_ent, ref_ent, value_tol(dtype) * (1 + ref_ent.abs()), "entropy")
    for name, grad, plain_grad, ref_grad in zip(("d hidden", "d weight", "d bias"), grads, plain_grads, ref_grads):
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        # An entry sums n (or V) float32 (float64) products, each at most about max |ref|.
        summed = ref_grad.abs().max() * (1e-13 if dtype == torch.float64 else 1e-6)
        assert_no_worse_than_torch(grad, plain_grad, ref_grad, grad_tol(ref_grad, dtype) + summed, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_linear_topk_logprob_matches_reference(dtype):
    n, h, vocab, k, mask_id = sized(50, 6), sized(128, 16), llada_vocab(), 8, llada_vocab() - 128
    hidden = randn(n, h, seed=31, dtype=dtype)
    weight = randn(vocab, h, seed=32, scale=3 / h**0.5, dtype=dtype)
    bias = randn(vocab, seed=33, dtype=dtype)
    bias[mask_id] = 40.0  # the mask id would be every row's top token if it were not excluded
    ids, logprobs = linear_topk_logprob(hidden, weight, k=k, bias=bias, mask_id=mask_id, chunk_size=sized(16, 4))
    assert ids.shape == (n, k) and ids.dtype == torch.int64 and (ids != mask_id).all()
    assert logprobs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)

    ref_logits = reference.linear_logits(hidden.double(), weight.double(), bias.double())
    ref_ids, ref_values = reference.topk_logprob(ref_logits, k, mask_id)
    plain_logits = hidden @ weight.T + bias
    plain_logits[:, mask_id] = float("-inf")
    plain_values = torch.log_softmax(plain_logits, dim=1).topk(k, dim=1).values
    assert_no_worse_than_torch(logprobs, plain_values, ref_values, value_tol(dtype) * (1 + ref_values.abs()), "top-k log-probs")
    # The chosen ids are the top k of the float64 distribution (near-ties may swap neighbours).
    ref_logp = torch.log_softmax(ref_logits.index_fill(1, ref_ids.new_tensor([mask_id]), float("-inf")), dim=1)
    torch.testing.assert_close(ref_logp.gather(1, ids), ref_values, rtol=1e-5, atol=1e-5)


def test_compiled_trainer_step():
    hidden = randn(64, 128, seed=41).requires_grad_()
    weight = randn(1000, 128, seed=42).requires_grad_()
    targets = torch.randint(0, 1000, (64,), device=DEVICE, generator=generator(43))

    def loss_fn(h, w):
        return -linear_logprob(h.tanh(), w, targets).mean() - gather_logprob(h @ w.T, targets).mean()

    compiled = torch.compile(loss_fn, fullgraph=True)
    torch.testing.assert_close(compiled(hidden, weight), loss_fn(hidden, weight))
