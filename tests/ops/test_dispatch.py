"""The per-call ``backend=`` of every public op: it overrides ``DACA_BACKEND``, runs the path it
names (watched through the kernels it loads and the reference functions it calls), gives what the
environment variable gives, and a bad value is a ValueError naming ``backend``."""
import pytest
import torch

import daca_kernels
from daca_kernels.ops import dispatch, reference_backend
from daca_kernels.ops.dispatch import BACKENDS

MASK_ID = 36


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(37, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(37, generator=g, dtype=torch.float64)
    logits = torch.randn(3, 5, 37, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, 37, (3, 5), generator=g)
    return g, hidden, weight, bias, logits, targets


def _gather(backend):
    _, _, _, _, logits, targets = _inputs(0)
    return daca_kernels.gather_logprob(logits, targets, temperature=0.7, return_entropy=True, backend=backend)


def _stratified_gather(backend):
    g, _, _, _, _, targets = _inputs(1)
    logits = torch.randn(2, 3, 5, 37, generator=g, dtype=torch.float64)
    strata = torch.randint(-1, 2, (3, 5), generator=g)
    return daca_kernels.stratified_gather_logprob(logits, targets, strata, temperature=0.9, backend=backend)


def _linear(backend):
    g, hidden, weight, bias, _, _ = _inputs(2)
    targets = torch.randint(0, 37, (6,), generator=g)
    return daca_kernels.linear_logprob(hidden, weight, targets, bias=bias, temperature=1.3, return_entropy=True,
                                       chunk_size=4, backend=backend)


def _topk(backend):
    _, hidden, weight, bias, _, _ = _inputs(3)
    return daca_kernels.linear_topk_logprob(hidden, weight, k=3, bias=bias, mask_id=MASK_ID, backend=backend)


def _sample(backend):
    _, _, _, _, logits, _ = _inputs(4)
    return daca_kernels.sample_step(logits[0], temperature=0.8, seed=5, step=2, row_ids=torch.tensor([3, 9, 4, 0, 7]),
                                    mask_id=MASK_ID, return_entropy=True, backend=backend)


def _sample_linear(backend):
    _, hidden, weight, bias, _, _ = _inputs(5)
    return daca_kernels.sample_step_linear(hidden, weight, bias=bias, temperature=1.5, seed=2**40 + 3, step=1,
                                           mask_id=MASK_ID, return_entropy=True, chunk_size=4, backend=backend)


def _confidence_delta(backend):
    g = torch.Generator().manual_seed(6)
    current, previous = torch.rand(3, 7, generator=g, dtype=torch.float64), torch.rand(3, 7, generator=g, dtype=torch.float64)
    return daca_kernels.confidence_delta(current, previous, torch.rand(3, 7, generator=g) < 0.6, backend=backend)


def _stratified_mask(backend):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 90, (3, 11), generator=g)
    maskable = torch.rand(3, 11, generator=g) < 0.6
    result = daca_kernels.stratified_mask(ids, maskable, 3, 9, 99, prompt_mask_prob=0.3, row_offset=4, backend=backend)
    return result.strata, result.input_ids


# Public op -> (call, the Triton kernel module it loads on the "triton" backend, or None: no kernel).
OPS = {
    "gather_logprob": (_gather, "logprob"),
    "stratified_gather_logprob": (_stratified_gather, "logprob"),
    "linear_logprob": (_linear, "logprob"),
    "linear_topk_logprob": (_topk, None),
    "sample_step": (_sample, "sampling"),
    "sample_step_linear": (_sample_linear, "sampling"),
    "confidence_delta": (_confidence_delta, "dps"),
    "stratified_mask": (_stratified_mask, "stratified_mask"),
}
# The function of ops/reference_backend.py each op reaches on the "reference" backend.
REFERENCE_OF = {"stratified_gather_logprob": "gather_logprob"}


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def test_every_public_op_is_covered():
    public = {name for name in daca_kernels.ops.__all__ if name[0].islower()}
    assert public == OPS.keys()


@pytest.fixture
def watched(monkeypatch):
    """Records the kernel modules loaded and the reference functions called."""
    seen = {"kernels": [], "references": []}
    load = dispatch.triton_module

    def watch_load(name, device):
        seen["kernels"].append(name)
        return load(name, device)

    monkeypatch.setattr(dispatch, "triton_module", watch_load)
    for op in set(OPS) - set(REFERENCE_OF):
        function = getattr(reference_backend, op)

        def watch_call(*args, _op=op, _function=function):
            seen["references"].append(_op)
            return _function(*args)

        monkeypatch.setattr(reference_backend, op, watch_call)
    return seen


@pytest.mark.parametrize("requested", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_backend_argument_overrides_the_environment(monkeypatch, watched, op, requested):
    call, kernel = OPS[op]
    monkeypatch.setenv("DACA_BACKEND", requested)
    from_environment = _outputs(call(None))
    for other in BACKENDS:
        if other == requested:
            continue
        monkeypatch.setenv("DACA_BACKEND", other)
        watched["kernels"].clear()
        watched["references"].clear()
        from_argument = _outputs(call(requested))
        assert len(from_argument) == len(from_environment)
        for a, b in zip(from_argument, from_environment):
            assert torch.equal(a, b)
        expected_kernels = {kernel} if requested == "triton" and kernel else set()
        assert set(watched["kernels"]) == expected_kernels, (other, watched)
        assert watched["references"] == ([REFERENCE_OF.get(op, op)] if requested == "reference" else []), other


@pytest.mark.parametrize("op", OPS)
def test_the_backends_agree(op):
    call, _ = OPS[op]
    results = {name: _outputs(call(name)) for name in BACKENDS}
    for name in ("triton", "torch"):
        for a, b in zip(results[name], results["reference"]):
            if a.is_floating_point():
                torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-9)
            else:
                assert torch.equal(a, b), name


@pytest.mark.parametrize("bad", ["cuda", "Torch", "", 1, ("torch",)])
@pytest.mark.parametrize("op", OPS)
def test_a_bad_backend_is_a_value_error_naming_it(op, bad):
    with pytest.raises(ValueError, match="^backend must be one of 'triton', 'torch', 'reference'"):
        OPS[op][0](bad)


def test_none_follows_the_environment_and_then_the_device(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("DACA_BACKEND", raising=False)
    assert dispatch.resolve_backend(cpu) == ("triton" if dispatch.interpreter_on() else "torch")
    monkeypatch.setenv("DACA_BACKEND", " Reference ")
    assert dispatch.resolve_backend(cpu) == "reference"
    assert dispatch.resolve_backend(cpu, "torch") == "torch"
    monkeypatch.setenv("DACA_BACKEND", "cuda-magic")
    assert dispatch.resolve_backend(cpu, "torch") == "torch"  # an explicit backend never reads the variable
    with pytest.raises(ValueError, match="DACA_BACKEND='cuda-magic'"):
        dispatch.resolve_backend(cpu)
