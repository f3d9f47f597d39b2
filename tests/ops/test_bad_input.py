"""Bad input to the log-prob ops: a clear error naming the argument, inputs left untouched."""
import pytest
import torch
from support import assert_unchanged, snapshot

from daca_kernels import gather_logprob, linear_logprob, stratified_gather_logprob


def gather_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 50, generator=g), torch.randint(0, 50, (4,), generator=g)


def linear_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g), torch.randint(0, 50, (4,), generator=g)


GATHER_CASES = {
    "target == V": (lambda x, t: (x, t.clone().index_fill_(0, torch.tensor([2]), 50), {}), ValueError, r"targets must lie in \[0, 50\); targets\[2\] = 50"),
    "negative target": (lambda x, t: (x, t.clone().index_fill_(0, torch.tensor([0]), -1), {}), ValueError, r"targets\[0\] = -1"),
    "row out of range": (lambda x, t: (x, t, {"rows": torch.tensor([0, 1, 4, 2])}), ValueError, r"rows must lie in \[0, 4\)"),
    "negative row": (lambda x, t: (x, t, {"rows": torch.tensor([0, -1, 3, 2])}), ValueError, r"rows must lie"),
    "rows shape": (lambda x, t: (x, t, {"rows": torch.tensor([0, 1])}), ValueError, "rows must have the shape of targets"),
    "targets length": (lambda x, t: (x, t[:3], {}), ValueError, "targets must have shape"),
    "float targets": (lambda x, t: (x, t.float(), {}), TypeError, "targets must have dtype"),
    "integer logits": (lambda x, t: (x.long(), t, {}), TypeError, "logits must have dtype"),
    "not a tensor": (lambda x, t: (x.tolist(), t, {}), TypeError, "logits must be a torch.Tensor"),
    "device mismatch": (lambda x, t: (x, t.to("meta"), {}), ValueError, "targets is on meta but logits is on cpu"),
    "zero temperature": (lambda x, t: (x, t, {"temperature": 0.0}), ValueError, "temperature must be a finite number > 0"),
    "tensor temperature": (lambda x, t: (x, t, {"temperature": torch.tensor(0.5)}), TypeError, "temperature must be a Python float"),
    "empty vocabulary": (lambda x, t: (x[:, :0], t, {}), ValueError, "non-empty last"),
}


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_gather_logprob_rejects(backend, case):
    make, error, message = GATHER_CASES[case]
    logits, targets = gather_inputs()
    args = make(logits, targets)
    before = snapshot(logits, targets)
    with pytest.raises(error, match=message):
        gather_logprob(args[0], args[1], **args[2])
    assert_unchanged(before, logits, targets)


LINEAR_CASES = {
    "target == V": (lambda h, w, t: (h, w, t.clone().fill_(50), {}), ValueError, r"targets must lie in \[0, 50\)"),
    "negative target": (lambda h, w, t: (h, w, t.clone().fill_(-3), {}), ValueError, r"targets\[0\] = -3"),
    "hidden size": (lambda h, w, t: (h, w[:, :7], t, {}), ValueError, r"weight must have shape \[V, H\] with H = 8"),
    "targets length": (lambda h, w, t: (h, w, t[:2], {}), ValueError, r"targets must have shape \[N\]"),
    "bias length": (lambda h, w, t: (h, w, t, {"bias": torch.zeros(49)}), ValueError, r"bias must have shape \[V\]"),
    "dtype mismatch": (lambda h, w, t: (h, w.double(), t, {}), TypeError, "weight must have the dtype of hidden"),
    "hidden 3-D": (lambda h, w, t: (h[None], w, t, {}), ValueError, "hidden must be 2-D"),
    "bool targets": (lambda h, w, t: (h, w, t.bool(), {}), TypeError, "targets must have dtype"),
    "device mismatch": (lambda h, w, t: (h, w.to("meta"), t, {}), ValueError, "weight is on meta"),
    "chunk size": (lambda h, w, t: (h, w, t, {"chunk_size": 0}), ValueError, "chunk_size must be >= 1"),
    "negative temperature": (lambda h, w, t: (h, w, t, {"temperature": -1.0}), ValueError, "temperature"),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_logprob_rejects(backend, case):
    make, error, message = LINEAR_CASES[case]
    hidden, weight, targets = linear_inputs()
    args = make(hidden, weight, targets)
    before = snapshot(hidden, weight, targets)
    with pytest.raises(error, match=message):
        linear_logprob(args[0], args[1], args[2], **args[3])
    assert_unchanged(before, hidden, weight, targets)


def test_linear_logprob_empty_batch(backend):
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    out = linear_logprob(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


STRATIFIED_CASES = {
    "stratum >= K": (lambda s: s.clone().fill_(3), ValueError, r"strata must lie in \[-1, 3\)"),
    "stratum < -1": (lambda s: s.clone().fill_(-2), ValueError, r"strata must lie in \[-1, 3\)"),
    "shape": (lambda s: s[:, :4], ValueError, r"strata must have shape \[B, L\]"),
    "float strata": (lambda s: s.float(), TypeError, "strata must have dtype"),
}


@pytest.mark.parametrize("case", list(STRATIFIED_CASES))
def test_stratified_gather_rejects(backend, case):
    make, error, message = STRATIFIED_CASES[case]
    logits = torch.randn(3, 2, 5, 20)
    targets = torch.randint(0, 20, (2, 5))
    strata = torch.randint(-1, 3, (2, 5))
    before = snapshot(logits, targets, strata)
    with pytest.raises(error, match=message):
        stratified_gather_logprob(logits, targets, make(strata))
    assert_unchanged(before, logits, targets, strata)


def test_stratified_gather_shift_rejects_position_zero(backend):
    strata = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"strata\[:, 0\] must be -1 with shift=True"):
        stratified_gather_logprob(torch.randn(1, 1, 4, 10), torch.zeros(1, 4, dtype=torch.long), strata, shift=True)


def test_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="DACA_BACKEND='cuda-magic' is not one of triton, torch, reference"):
        gather_logprob(*gather_inputs())
