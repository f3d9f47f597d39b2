"""linear_logprob against the float64 reference (full logits, log_softmax, gather)."""
import pytest
import torch

from daca_kernels import linear_logprob, reference
from support import (
    assert_no_worse_than_torch,
    assert_unchanged,
    bf16_ulp,
    plain_linear_logprob,
    run_with_grads,
    snapshot,
)


def make_case(n, hidden_size, vocab, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 4).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype) if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, bias, targets


@pytest.mark.parametrize(
    "n,hidden_size,vocab,chunk_size",
    [(1, 16, 1000, None), (21, 16, 1000, 8), (5, 12, 3001, 2), (33, 8, 257, None)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_reference(backend, poison_allocations, n, hidden_size, vocab, chunk_size, dtype, with_bias):
    hidden, weight, bias, targets = make_case(n, hidden_size, vocab, dtype, seed=n + vocab, with_bias=with_bias)
    g = torch.Generator().manual_seed(1)
    upstream, upstream_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    temperature = 0.9
    before = snapshot(hidden, weight, bias, targets)

    (out, ent), grads = run_with_grads(
        lambda h, w, b: linear_logprob(h, w, targets, bias=b, temperature=temperature, return_entropy=True, chunk_size=chunk_size),
        (hidden, weight, bias), (upstream, upstream_ent),
    )
    (ref_out, ref_ent), ref_grads = run_with_grads(
        lambda h, w, b: reference.linear_logprob(h, w, targets, b, temperature, return_entropy=True),
        (hidden.double(), weight.double(), None if bias is None else bias.double()), (upstream.double(), upstream_ent.double()),
    )
    (plain_out, plain_ent), plain_grads = run_with_grads(
        lambda h, w, b: plain_linear_logprob(h, w, b, targets, temperature),
        (hidden, weight, bias), (upstream.to(dtype), upstream_ent.to(dtype)),
    )
    assert_unchanged(before, hidden, weight, bias, targets)
    assert out.dtype == torch.float32
    assert_no_worse_than_torch(out, plain_out, ref_out, 2e-5, "logprob")
    assert_no_worse_than_torch(ent, plain_ent, ref_ent, 2e-5, "entropy")
    for name, f, p, r in zip(("d hidden", "d weight", "d bias"), grads, plain_grads, ref_grads):
        if r is None:
            continue
        assert f.dtype == dtype
        tol = 1e-5 + (bf16_ulp(r) if dtype == torch.bfloat16 else 2e-6 * (1 + r.abs()))
        assert_no_worse_than_torch(f, p, r, tol, name)


def test_only_requested_gradients_are_computed(backend):
    hidden, weight, bias, targets = make_case(6, 8, 100, torch.float32, seed=0, with_bias=True)
    weight.requires_grad_()
    linear_logprob(hidden, weight, targets, bias=bias).sum().backward()
    assert weight.grad is not None and hidden.grad is None and bias.grad is None


def test_gradcheck_float64(backend):
    hidden, weight, bias, targets = make_case(5, 4, 23, torch.float64, seed=3, with_bias=True)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]

    def fn(h, w, b):
        return linear_logprob(h, w, targets, bias=b, temperature=1.1, return_entropy=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)


def test_chunking_does_not_change_the_result(backend):
    hidden, weight, bias, targets = make_case(19, 8, 300, torch.float64, seed=5, with_bias=True)
    whole = linear_logprob(hidden, weight, targets, bias=bias, chunk_size=19)
    for chunk in (1, 4, 7, 100):
        torch.testing.assert_close(linear_logprob(hidden, weight, targets, bias=bias, chunk_size=chunk), whole)
