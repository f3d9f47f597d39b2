"""The log-prob ops on CUDA through the compiled Triton kernels (run whenever a GPU is present)."""
import pytest
import torch

from daca_kernels import gather_logprob, linear_logprob, reference
from support import assert_no_worse_than_torch, bf16_ulp

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [32000, 126464, 152064])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_logprob_cuda_matches_reference(vocab, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(67, vocab, device="cuda", generator=g) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (67,), device="cuda", generator=g)
    upstream = torch.randn(67, device="cuda", generator=g)
    out, ent = gather_logprob(logits, targets, temperature=0.9, return_entropy=True)
    (grad,) = torch.autograd.grad((out * upstream).sum() + ent.sum(), logits)

    x64 = logits.detach().double().requires_grad_()
    ref_out, ref_ent = reference.gather_logprob(x64, targets, temperature=0.9, return_entropy=True)
    (ref_grad,) = torch.autograd.grad((ref_out * upstream.double()).sum() + ref_ent.sum(), x64)
    xp = logits.detach().requires_grad_()
    logp = torch.log_softmax(xp / 0.9, -1)
    plain_out = logp.gather(1, targets[:, None]).squeeze(1)
    plain_ent = -(logp.exp() * logp).sum(-1)
    (plain_grad,) = torch.autograd.grad((plain_out * upstream.to(dtype)).sum() + plain_ent.sum(), xp)

    assert_no_worse_than_torch(out, plain_out, ref_out, 1e-5, "logprob")
    assert_no_worse_than_torch(ent, plain_ent, ref_ent, 1e-4, "entropy")
    tol = 1e-7 + (bf16_ulp(ref_grad) if dtype == torch.bfloat16 else 1e-7)
    assert_no_worse_than_torch(grad, plain_grad, ref_grad, tol, "d logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_logprob_cuda_matches_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, v = 300, 512, 126464
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5 * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    out = linear_logprob(hidden, weight, targets, chunk_size=64)
    dh, dw = torch.autograd.grad(out.sum(), (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = reference.linear_logprob(h64, w64, targets)
    rdh, rdw = torch.autograd.grad(ref.sum(), (h64, w64))
    hp, wp = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    plain = torch.log_softmax(hp @ wp.T, -1).gather(1, targets[:, None]).squeeze(1)
    pdh, pdw = torch.autograd.grad(plain.sum(), (hp, wp))
    assert_no_worse_than_torch(out, plain, ref, 1e-4, "logprob")
    ulp = bf16_ulp if dtype == torch.bfloat16 else (lambda r: 1e-6 * r.abs())
    assert_no_worse_than_torch(dh, pdh, rdh, 1e-5 + ulp(rdh), "d hidden")
    assert_no_worse_than_torch(dw, pdw, rdw, 1e-5 + ulp(rdw), "d weight")


def test_compiled_trainer_step_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(64, 128, device="cuda", generator=g, requires_grad=True)
    weight = torch.randn(1000, 128, device="cuda", generator=g, requires_grad=True)
    targets = torch.randint(0, 1000, (64,), device="cuda", generator=g)

    def loss_fn(h, w):
        return -linear_logprob(h.tanh(), w, targets).mean() - gather_logprob(h @ w.T, targets).mean()

    compiled = torch.compile(loss_fn, fullgraph=True)
    torch.testing.assert_close(compiled(hidden, weight), loss_fn(hidden, weight))
