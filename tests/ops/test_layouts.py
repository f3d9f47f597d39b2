"""Every public op honours every layout of every tensor argument.

Hypothesis draws, for each tensor argument of each op, a layout (contiguous, strided with a gap
filled with poison, transposed, at a storage offset behind poison, expanded along a dimension)
and, for index arguments, int32 or int64. The op's result on those views must equal its result
on contiguous copies of the same values (exactly for integers and for the sampler's choices) and
match the float64 reference under the accuracy rule, values and gradients, on the Triton
interpreter and on the chunked PyTorch path. Inputs must come back unmodified.

Poison (NaN for floats, the largest valid id for indices, the negation for flags) sits in every
gap a wrong stride would read, so a kernel that ignores a stride gives a wrong answer here.
"""
from __future__ import annotations

import pytest
import torch
from properties import HealthCheck, Phase, given, settings, st
from support import (
    assert_no_worse_than_torch,
    assert_unchanged,
    assert_valid_step,
    plain_gather_logprob,
    plain_linear_logprob,
    snapshot,
    ulp,
)

from daca_kernels import (
    confidence_delta,
    gather_logprob,
    linear_logprob,
    linear_topk_logprob,
    reference,
    sample_step,
    sample_step_linear,
    stratified_gather_logprob,
    stratified_mask,
)

LAYOUTS = ("contiguous", "strided", "transposed", "offset", "expanded")
# Derandomized: CI draws the same examples on every machine; no shrinking (a failure prints its draws).
EXAMPLES = settings(
    max_examples=25, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _poison_like(values: torch.Tensor, shape) -> torch.Tensor:
    if values.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    if values.is_floating_point():
        return torch.full(shape, float("nan"), dtype=values.dtype)
    return torch.full(shape, int(values.max()) if values.numel() else 0, dtype=values.dtype)


def laid_out(values: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    """A tensor equal to ``values`` (for ``"expanded"``: to ``values`` with every slice along
    ``dim`` replaced by the first) in the given memory layout, gaps filled with poison."""
    dim = dim % max(values.dim(), 1)
    if layout == "contiguous" or values.dim() == 0:
        return values.clone()
    if layout == "strided":
        shape = list(values.shape)
        shape[dim] *= 2
        base = _poison_like(values, shape)
        if values.dtype == torch.bool:
            base = ~values.repeat_interleave(2, dim)
        view = base.narrow(dim, 0, shape[dim]).unflatten(dim, (values.shape[dim], 2)).select(dim + 1, 0)
        view.copy_(values)
        return view
    if layout == "transposed":
        if values.dim() < 2:
            return laid_out(values, "strided", dim)
        other = (dim + 1) % values.dim()
        return values.transpose(dim, other).contiguous().transpose(dim, other)
    if layout == "offset":
        pad = 5
        flat = _poison_like(values, (values.numel() + 2 * pad,))
        view = flat[pad : pad + values.numel()].view(values.shape)
        view.copy_(values)
        return view
    if layout == "expanded":
        if values.shape[dim] == 0:
            return values.clone()
        return values.narrow(dim, 0, 1).clone().expand(values.shape)
    raise AssertionError(layout)


@st.composite
def layouts(draw):
    return draw(st.sampled_from(LAYOUTS)), draw(st.integers(0, 3))


def index_dtype(draw):
    return draw(st.sampled_from((torch.int64, torch.int32)))


def _generator(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def _grad(output: torch.Tensor, inputs: list[torch.Tensor], weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((output * weights).sum(), inputs)


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", request.param)
    return request.param


@EXAMPLES
@given(data=st.data())
def test_gather_logprob_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    num_rows, vocab = draw(st.integers(1, 6)), draw(st.integers(2, 37))
    with_rows = draw(st.booleans())
    n = draw(st.integers(1, 8)) if with_rows else num_rows
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
    temperature = draw(st.sampled_from((1.0, 0.7)))
    logits = laid_out(torch.randn(num_rows, vocab, generator=g).to(dtype), *draw(layouts())).requires_grad_()
    targets = laid_out(torch.randint(0, vocab, (n,), generator=g).to(index_dtype(draw)), *draw(layouts()))
    rows = None
    if with_rows:
        rows = laid_out(torch.randint(0, num_rows, (n,), generator=g).to(index_dtype(draw)), *draw(layouts()))
    before = snapshot(logits, targets, rows)

    out, entropy = gather_logprob(logits, targets, rows=rows, temperature=temperature, return_entropy=True)
    upstream = torch.randn(n, generator=g)
    (d_logits,) = _grad(out + 0.5 * entropy, [logits], upstream)
    assert_unchanged(before, logits, targets, rows)

    x64 = logits.detach().contiguous().double().requires_grad_()
    ref, ref_entropy = reference.gather_logprob(
        x64, targets.contiguous(), None if rows is None else rows.contiguous(), temperature, True
    )
    (ref_d,) = _grad(ref + 0.5 * ref_entropy, [x64], upstream.double())
    xp = logits.detach().contiguous().float().requires_grad_()
    plain, plain_entropy = plain_gather_logprob(xp, targets.long(), None if rows is None else rows.long(), temperature)
    (plain_d,) = _grad(plain + 0.5 * plain_entropy, [xp], upstream)
    assert_no_worse_than_torch(out, plain, ref, 1e-5 * (1 + ref.abs()), "logprob")
    assert_no_worse_than_torch(entropy, plain_entropy, ref_entropy, 1e-5 * (1 + ref_entropy.abs()), "entropy")
    # d logits is stored in the logits' dtype: one unit in its last place on top.
    assert_no_worse_than_torch(d_logits, plain_d, ref_d, ulp(ref_d, dtype) + 1e-6, "d logits")


@EXAMPLES
@given(data=st.data())
def test_linear_logprob_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    n, hidden_size, vocab = draw(st.integers(1, 7)), draw(st.integers(1, 9)), draw(st.integers(2, 33))
    with_bias = draw(st.booleans())
    chunk_size = draw(st.sampled_from((None, 1, 3)))
    hidden = laid_out(torch.randn(n, hidden_size, generator=g), *draw(layouts())).requires_grad_()
    weight = laid_out(torch.randn(vocab, hidden_size, generator=g), *draw(layouts())).requires_grad_()
    bias = laid_out(torch.randn(vocab, generator=g), *draw(layouts())).requires_grad_() if with_bias else None
    targets = laid_out(torch.randint(0, vocab, (n,), generator=g).to(index_dtype(draw)), *draw(layouts()))
    before = snapshot(hidden, weight, bias, targets)

    out = linear_logprob(hidden, weight, targets, bias=bias, temperature=0.9, chunk_size=chunk_size)
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    upstream = torch.randn(n, generator=g)
    grads = _grad(out, inputs, upstream)
    assert_unchanged(before, hidden, weight, bias, targets)

    ref_inputs = [t.detach().contiguous().double().requires_grad_() for t in inputs]
    ref = reference.linear_logprob(ref_inputs[0], ref_inputs[1], targets.contiguous(), ref_inputs[2] if with_bias else None, 0.9, False)
    ref_grads = _grad(ref, ref_inputs, upstream.double())
    plain_inputs = [t.detach().contiguous().requires_grad_() for t in inputs]
    plain, _ = plain_linear_logprob(plain_inputs[0], plain_inputs[1], plain_inputs[2] if with_bias else None, targets.long(), 0.9)
    plain_grads = _grad(plain, plain_inputs, upstream)
    assert_no_worse_than_torch(out, plain, ref, 1e-5, "logprob")
    for name, got, p, r in zip(("d hidden", "d weight", "d bias"), grads, plain_grads, ref_grads):
        assert_no_worse_than_torch(got, p, r, 1e-5 * (1 + r.abs()), name)


@EXAMPLES
@given(data=st.data())
def test_stratified_gather_logprob_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    k, batch, length, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(2, 5)), draw(st.integers(2, 19))
    shift = draw(st.booleans())
    logits = laid_out(torch.randn(k, batch, length, vocab, generator=g), *draw(layouts())).requires_grad_()
    targets = laid_out(torch.randint(0, vocab, (batch, length), generator=g).to(index_dtype(draw)), *draw(layouts()))
    strata = torch.randint(-1, k, (batch, length), generator=g)
    if shift:
        strata[:, 0] = -1
    strata = laid_out(strata.to(index_dtype(draw)), *draw(layouts()))
    if shift and (strata[:, 0] >= 0).any():  # an expanded layout may copy a stratum to position 0
        strata = strata.contiguous()
        strata[:, 0] = -1
    before = snapshot(logits, targets, strata)

    out = stratified_gather_logprob(logits, targets, strata, shift=shift)
    upstream = torch.randn(batch, length, generator=g)
    (d_logits,) = _grad(out, [logits], upstream)
    assert_unchanged(before, logits, targets, strata)

    x64 = logits.detach().contiguous().double().requires_grad_()
    ref = reference.stratified_gather_logprob(x64, targets.contiguous(), strata.contiguous(), shift)
    (ref_d,) = _grad(ref, [x64], upstream.double())
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_logits.double(), ref_d, rtol=1e-5, atol=1e-5)


@EXAMPLES
@given(data=st.data())
def test_sample_step_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    n, vocab = draw(st.integers(1, 6)), draw(st.integers(3, 41))
    temperature = draw(st.sampled_from((0.0, 0.6, 1.0, 1.7)))
    mask_id = draw(st.sampled_from((None, 0, vocab - 1)))
    logits = laid_out(torch.randn(n, vocab, generator=g), *draw(layouts()))
    row_ids = None
    if draw(st.booleans()):
        row_ids = laid_out(torch.randint(0, 2**31 - 1, (n,), generator=g).to(index_dtype(draw)), *draw(layouts()))
    before = snapshot(logits, row_ids)

    tokens, confidence, entropy = sample_step(
        logits, temperature=temperature, seed=5, step=2, row_ids=row_ids, mask_id=mask_id, return_entropy=True
    )
    assert_unchanged(before, logits, row_ids)
    contiguous_ids = None if row_ids is None else row_ids.contiguous()
    again = sample_step(logits.contiguous(), temperature=temperature, seed=5, step=2, row_ids=contiguous_ids, mask_id=mask_id)
    assert torch.equal(tokens, again[0])
    assert_valid_step(tokens, confidence, entropy, logits.double(), logits.contiguous(), temperature, 5, 2,
                      None if row_ids is None else row_ids.long(), mask_id)


@EXAMPLES
@given(data=st.data())
def test_linear_sampling_and_topk_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    n, hidden_size, vocab = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(3, 29))
    hidden = laid_out(torch.randn(n, hidden_size, generator=g), *draw(layouts()))
    weight = laid_out(torch.randn(vocab, hidden_size, generator=g), *draw(layouts()))
    bias = laid_out(torch.randn(vocab, generator=g), *draw(layouts())) if draw(st.booleans()) else None
    row_ids = laid_out(torch.randint(0, 1000, (n,), generator=g).to(index_dtype(draw)), *draw(layouts()))
    before = snapshot(hidden, weight, bias, row_ids)

    tokens, confidence, entropy = sample_step_linear(
        hidden, weight, bias=bias, temperature=0.8, seed=3, step=1, row_ids=row_ids, mask_id=1, return_entropy=True,
        chunk_size=2,
    )
    ids, logprobs = linear_topk_logprob(hidden, weight, k=2, bias=bias, mask_id=1)
    assert_unchanged(before, hidden, weight, bias, row_ids)
    full = reference.linear_logits(hidden.contiguous().double(), weight.contiguous().double(),
                                   None if bias is None else bias.contiguous().double())
    plain = reference.linear_logits(hidden.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous())
    assert_valid_step(tokens, confidence, entropy, full, plain, 0.8, 3, 1, row_ids.long(), 1)
    ref_ids, ref_logprobs = reference.topk_logprob(full, 2, 1)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, rtol=1e-5, atol=1e-5)
    # Ids may swap only between (near-)equal probabilities.
    without_mask = full.index_fill(1, torch.tensor([1]), float("-inf")).log_softmax(1)
    torch.testing.assert_close(without_mask.gather(1, ids), ref_logprobs, rtol=1e-5, atol=1e-5)


@EXAMPLES
@given(data=st.data())
def test_stratified_mask_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    num_strata = draw(st.integers(1, 4))
    input_ids = laid_out(torch.randint(0, 50, (batch, length), generator=g).to(index_dtype(draw)), *draw(layouts()))
    maskable = laid_out(torch.rand(batch, length, generator=g) < 0.7, *draw(layouts()))
    # A prompt lies outside maskable; an expanded layout may repeat a slice into it, which is refused.
    prompt = laid_out((torch.rand(batch, length, generator=g) < 0.5) & ~maskable, *draw(layouts())) if draw(st.booleans()) else None
    scheme = draw(st.sampled_from(("random", "interleave")))
    before = snapshot(input_ids, maskable, prompt)
    if prompt is not None and bool((prompt & maskable).any()):
        with pytest.raises(ValueError, match="prompt must not overlap maskable"):
            stratified_mask(input_ids, maskable, num_strata, 11, 99, scheme=scheme, prompt=prompt, prompt_mask_prob=0.4)
        assert_unchanged(before, input_ids, maskable, prompt)
        return

    got = stratified_mask(input_ids, maskable, num_strata, 11, 99, scheme=scheme, prompt=prompt, prompt_mask_prob=0.4)
    assert_unchanged(before, input_ids, maskable, prompt)
    ref_strata, ref_copies = reference.stratified_mask(
        input_ids.contiguous(), maskable.contiguous(), num_strata, 11, 99, scheme,
        (~maskable if prompt is None else prompt).contiguous(), 0.4, 0,
    )
    assert torch.equal(got.strata, ref_strata)
    assert torch.equal(got.input_ids, ref_copies)


@EXAMPLES
@given(data=st.data())
def test_confidence_delta_any_layout(path, data):
    draw = data.draw
    g = _generator(draw)
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 20))
    current = laid_out(torch.rand(batch, length, generator=g), *draw(layouts()))
    previous = laid_out(torch.rand(batch, length, generator=g), *draw(layouts()))
    still_masked = laid_out(torch.rand(batch, length, generator=g) < 0.5, *draw(layouts()))
    before = snapshot(current, previous, still_masked)

    out = confidence_delta(current, previous, still_masked)
    assert_unchanged(before, current, previous, still_masked)
    ref = reference.confidence_delta(current.contiguous().double(), previous.contiguous().double(), still_masked.contiguous())
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_layouts_are_what_they_claim():
    """The helper really produces the layouts the property tests rely on."""
    values = torch.arange(12.0).view(3, 4)
    assert laid_out(values, "contiguous", 0).is_contiguous()
    strided = laid_out(values, "strided", 1)
    assert strided.stride() == (8, 2) and torch.equal(strided, values)
    transposed = laid_out(values, "transposed", 0)
    assert not transposed.is_contiguous() and torch.equal(transposed, values)
    offset = laid_out(values, "offset", 0)
    assert offset.storage_offset() == 5 and torch.equal(offset, values)
    expanded = laid_out(values, "expanded", 0)
    assert expanded.stride(0) == 0 and torch.equal(expanded, values[:1].expand(3, 4))
    ids = laid_out(torch.tensor([3, 1, 2]), "strided", 0)
    assert ids.stride() == (2,) and ids.tolist() == [3, 1, 2]


# The reported one-line cases, kept as plain regression tests beside the properties above.


def test_strided_and_expanded_int64_targets(path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 11, generator=g)
    ids = torch.randint(0, 11, (5, 7), generator=g)
    for targets in (torch.randint(0, 11, (10,), generator=g)[::2], ids[:, 3], torch.tensor([3]).expand(5)):
        expected = torch.log_softmax(x.double(), -1)[torch.arange(5), targets]
        torch.testing.assert_close(gather_logprob(x, targets).double(), expected, rtol=1e-6, atol=1e-6)
    h, w = torch.randn(5, 4, generator=g), torch.randn(11, 4, generator=g)
    expected = torch.log_softmax(h.double() @ w.double().T, -1)[torch.arange(5), ids[:, 2]]
    torch.testing.assert_close(linear_logprob(h, w, ids[:, 2]).double(), expected, rtol=1e-6, atol=1e-6)


def test_strided_rows_backward_writes_only_selected_rows(path):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 11, generator=g, requires_grad=True)
    rows = torch.tensor([0, 7, 1, 7, 2, 7, 3, 7, 4, 7])[::2]
    targets = torch.randint(0, 11, (5,), generator=g)
    (d,) = torch.autograd.grad(gather_logprob(x, targets, rows=rows).sum(), x)
    x64 = x.detach().double().requires_grad_()
    (d_ref,) = torch.autograd.grad(torch.log_softmax(x64, -1)[rows, targets].sum(), x64)
    torch.testing.assert_close(d.double(), d_ref, rtol=1e-6, atol=1e-6)


def test_expanded_logits_rows(path):
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, 11, generator=g)
    targets = torch.randint(0, 11, (5,), generator=g)
    expected = torch.log_softmax(row.double(), -1)[0, targets]
    torch.testing.assert_close(gather_logprob(row.expand(5, 11), targets).double(), expected, rtol=1e-6, atol=1e-6)


def test_int32_row_ids_and_tiny_temperature(path):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 13, generator=g)
    ids64 = torch.tensor([0, 5, 2**31 - 1, 7, 9, 123])
    tokens64, _ = sample_step(logits, temperature=1.0, seed=1, step=0, row_ids=ids64)
    tokens32, _ = sample_step(logits, temperature=1.0, seed=1, step=0, row_ids=ids64.to(torch.int32))
    assert torch.equal(tokens32, tokens64)
    for temperature in (1e-45, 1e-30, 1e-8):
        tokens, _ = sample_step(logits, temperature=temperature, seed=1, step=0)
        assert torch.equal(tokens, logits.argmax(1)), temperature
    tokens, _ = sample_step(logits, temperature=1e300, seed=1, step=0)
    assert ((tokens >= 0) & (tokens < 13)).all()


@pytest.mark.parametrize("name", ["gather_logprob", "linear_logprob", "sample_step"])
def test_reference_backend_traces_with_fullgraph(monkeypatch, name):
    monkeypatch.setenv("DACA_BACKEND", "reference")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 9, generator=g)
    w = torch.randn(9, 9, generator=g)
    targets = torch.randint(0, 9, (4,), generator=g)
    row_ids = torch.arange(4)
    fn = {
        "gather_logprob": lambda x, t: gather_logprob(x, t),
        "linear_logprob": lambda x, t: linear_logprob(x, w, t),
        "sample_step": lambda x, t: sample_step(x, temperature=0.5, seed=1, step=0, row_ids=t)[0],
    }[name]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    arg = row_ids if name == "sample_step" else targets
    torch.testing.assert_close(compiled(x, arg), fn(x, arg))
    with pytest.raises(ValueError, match="targets|row_ids"):
        compiled(x, arg - 5)
