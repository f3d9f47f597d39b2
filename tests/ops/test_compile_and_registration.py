"""The ops are registered torch.library custom ops: opcheck passes and torch.compile traces them."""
import pytest
import torch

from daca_kernels import gather_logprob, linear_logprob


def test_opcheck_gather_logprob(backend):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (6,), generator=g)
    rows = torch.tensor([0, 4, 4, 1, 2, 3])
    torch.library.opcheck(torch.ops.daca.gather_logprob.default, (logits, targets, rows, 0.8, True, False, backend))
    torch.library.opcheck(torch.ops.daca.gather_logprob.default, (logits, targets[:5], None, 1.0, False, False, backend))
    grad_out, stats = torch.randn(5, generator=g), torch.randn(5, 2, generator=g)
    torch.library.opcheck(torch.ops.daca.gather_logprob_backward_.default,
                          (grad_out, None, logits.detach().clone(), targets[:5], stats, stats[:0, 0], 1.0, backend))


def test_opcheck_linear_logprob(backend):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 6, generator=g, requires_grad=True)
    weight = torch.randn(30, 6, generator=g, requires_grad=True)
    bias = torch.randn(30, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (7,), generator=g)
    for vocab_chunk in (0, 8):  # row chunks of 3; vocabulary chunks of 8 (the last one partial)
        torch.library.opcheck(torch.ops.daca.linear_logprob.default,
                              (hidden, weight, targets, bias, 1.3, True, 3, vocab_chunk, backend))


@pytest.mark.parametrize("compile_backend,backend", [("aot_eager", None), ("inductor", None), ("aot_eager", "torch"),
                                                     ("aot_eager", "reference")])
def test_torch_compile_fullgraph_traces_a_trainer_step(monkeypatch, compile_backend, backend):
    # With a per-call backend the variable is never read: an invalid one would raise otherwise.
    monkeypatch.setenv("DACA_BACKEND", "torch" if backend is None else "not-a-backend")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 8, generator=g, requires_grad=True)
    weight = torch.randn(64, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 64, (12,), generator=g)
    advantages = torch.randn(12, generator=g)

    def loss_fn(h, w):
        logp = linear_logprob(h.tanh(), w, targets, temperature=0.7, backend=backend)
        logits = (h @ w.T).view(3, 4, 64)
        logp2, ent = gather_logprob(logits, targets.view(3, 4), return_entropy=True, backend=backend)
        return -(logp * advantages).mean() - 0.1 * (logp2.flatten() + ent.flatten()).mean()

    compiled = torch.compile(loss_fn, fullgraph=True, backend=compile_backend)
    eager_loss = loss_fn(hidden, weight)
    eager_grads = torch.autograd.grad(eager_loss, (hidden, weight))
    compiled_loss = compiled(hidden, weight)
    compiled_grads = torch.autograd.grad(compiled_loss, (hidden, weight))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)
