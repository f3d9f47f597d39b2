"""linear_logprob against the float64 reference (full logits, log_softmax, gather)."""
from functools import partial

import pytest
import torch
from support import (
    assert_no_worse_than_torch,
    assert_unchanged,
    bf16_ulp,
    plain_linear_logprob,
    run_with_grads,
    snapshot,
)

from daca_kernels import linear_logprob, reference
from daca_kernels.ops.dispatch import resolve_backend


def make_case(n, hidden_size, vocab, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 4).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype) if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, bias, targets


def _matches_reference(fn, hidden, weight, bias, targets, temperature, seed):
    """Run ``fn(h, w, b) -> (logprob, entropy)`` with random upstream gradients, check values and
    gradients against the float64 reference (no worse than plain torch in the input dtype) and that the
    inputs are unchanged; returns ``fn``'s ``(logprob, entropy)``."""
    dtype, n = hidden.dtype, hidden.shape[0]
    g = torch.Generator().manual_seed(seed)
    upstream, upstream_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    before = snapshot(hidden, weight, bias, targets)
    (out, ent), grads = run_with_grads(fn, (hidden, weight, bias), (upstream, upstream_ent))
    (ref_out, ref_ent), ref_grads = run_with_grads(
        lambda h, w, b: reference.linear_logprob(h, w, targets, b, temperature, return_entropy=True),
        (hidden.double(), weight.double(), None if bias is None else bias.double()), (upstream.double(), upstream_ent.double()),
    )
    (plain_out, plain_ent), plain_grads = run_with_grads(
        lambda h, w, b: plain_linear_logprob(h, w, b, targets, temperature),
        (hidden, weight, bias), (upstream.to(dtype), upstream_ent.to(dtype)),
    )
    assert_unchanged(before, hidden, weight, bias, targets)
    assert_no_worse_than_torch(out, plain_out, ref_out, 2e-5, "logprob")
    assert_no_worse_than_torch(ent, plain_ent, ref_ent, 2e-5, "entropy")
    for name, f, p, r in zip(("d hidden", "d weight", "d bias"), grads, plain_grads, ref_grads):
        if r is None:
            continue
        assert f.dtype == dtype
        tol = 1e-5 + (bf16_ulp(r) if dtype == torch.bfloat16 else 2e-6 * (1 + r.abs()))
        assert_no_worse_than_torch(f, p, r, tol, name)
    return out, ent


@pytest.mark.parametrize(
    "n,hidden_size,vocab,chunk_size",
    [(1, 16, 1000, None), (21, 16, 1000, 8), (5, 12, 3001, 2), (33, 8, 257, None)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_reference(backend, poison_allocations, n, hidden_size, vocab, chunk_size, dtype, with_bias):
    hidden, weight, bias, targets = make_case(n, hidden_size, vocab, dtype, seed=n + vocab, with_bias=with_bias)
    out, _ = _matches_reference(
        lambda h, w, b: linear_logprob(h, w, targets, bias=b, temperature=0.9, return_entropy=True, chunk_size=chunk_size),
        hidden, weight, bias, targets, 0.9, seed=1,
    )
    assert out.dtype == torch.float32


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


def vocabulary_chunked(h, w, b, *, targets, temperature, vocab_chunk):
    """``(log-prob, entropy)`` of ``linear_logprob`` through vocabulary chunks of ``vocab_chunk``
    head rows (the path CUDA takes for wide heads), on any device."""
    out, _, entropy = torch.ops.daca.linear_logprob(h, w, targets, b, temperature, True, 64, vocab_chunk,
                                                    resolve_backend(h.device))
    return out, entropy


@pytest.mark.parametrize(
    "n,hidden_size,vocab,vocab_chunk",
    # N = 1; V not a multiple of the chunk; a one-entry last chunk; one chunk wider than V.
    [(1, 16, 1000, 256), (21, 16, 1000, 384), (7, 12, 3001, 1000), (5, 8, 257, 512)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_vocabulary_chunks_match_reference(backend, poison_allocations, n, hidden_size, vocab, vocab_chunk, dtype,
                                           with_bias):
    hidden, weight, bias, targets = make_case(n, hidden_size, vocab, dtype, seed=n + vocab + 7, with_bias=with_bias)
    last = vocab - 1 - (vocab - 1) % vocab_chunk  # the first id of the last (partial) chunk
    targets[::2] = torch.arange(vocab - 1, last - 1, -1)[: len(targets[::2])].clamp(min=last)
    targets[1::3] = torch.arange(len(targets[1::3])) % vocab_chunk  # the first chunk too
    out, ent = _matches_reference(
        partial(vocabulary_chunked, targets=targets, temperature=0.7, vocab_chunk=vocab_chunk),
        hidden, weight, bias, targets, 0.7, seed=2,
    )
    assert out.dtype == torch.float32 and ent.dtype == torch.float32


def test_vocabulary_chunks_agree_with_row_chunks_in_float64(backend):
    hidden, weight, bias, targets = make_case(13, 8, 301, torch.float64, seed=9, with_bias=True)
    targets[:3] = torch.tensor([300, 299, 0])
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    upstream = torch.randn(13, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def run(fn):
        out, ent = fn(*leaves)
        return [out, ent, *torch.autograd.grad((upstream * out).sum() - ent.sum(), leaves)]

    rows = run(lambda h, w, b: linear_logprob(h, w, targets, bias=b, temperature=1.3, return_entropy=True, chunk_size=4))
    for vocab_chunk in (64, 301):  # five chunks, the last of 45 entries; one chunk
        chunked = run(partial(vocabulary_chunked, targets=targets, temperature=1.3, vocab_chunk=vocab_chunk))
        for a, b in zip(chunked, rows):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64_vocabulary_chunks(monkeypatch):
    monkeypatch.setenv("DACA_BACKEND", "torch")  # the interpreted kernels are covered against the reference above
    hidden, weight, bias, targets = make_case(3, 4, 13, torch.float64, seed=3, with_bias=True)
    targets[0] = 12  # in the last chunk, of 6 entries
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    fn = partial(vocabulary_chunked, targets=targets, temperature=1.1, vocab_chunk=7)
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)


def test_the_vocabulary_chunk_keeps_the_working_set_within_five_percent_of_the_logits():
    from daca_kernels.ops.linear_logprob import MIN_VOCAB_CHUNK, default_vocab_chunk, plan_vocab_chunk

    vocab, hidden_size = 126_464, 4096  # LLaDA's head
    chunk = default_vocab_chunk(vocab, hidden_size, torch.bfloat16)
    assert chunk == 2816 and chunk % 256 == 0
    # Per row: float32 logits and bfloat16 d logits of the chunk, the float32 d hidden beyond its bfloat16 gradient.
    assert chunk * (4 + 2) + (4 - 2) * hidden_size <= 0.05 * 4 * vocab < (chunk + 256) * (4 + 2) + (4 - 2) * hidden_size
    assert default_vocab_chunk(vocab, hidden_size, torch.float32) == 0.05 * vocab // 256 * 256
    assert default_vocab_chunk(32_000, 4096, torch.bfloat16) == MIN_VOCAB_CHUNK  # the floor
    hidden, weight = torch.zeros(100, hidden_size), torch.zeros(vocab, hidden_size)
    assert plan_vocab_chunk(hidden, weight, None) == 0  # CPU: row chunks


@pytest.mark.parametrize("vocab_chunk", [0, 96])
def test_out_of_range_targets_give_nan_without_a_host_read(backend, no_host_reads, vocab_chunk):
    # Guarded on the device (as on CUDA), through row chunks (0) and vocabulary chunks: a target out
    # of range gives NaN and NaN gradients, the other rows the values of a valid call; no host read.
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 8, generator=g, requires_grad=True)
    weight = torch.randn(300, 8, generator=g, requires_grad=True)
    targets = torch.tensor([4, 300, 7, -2, 299])
    good = torch.tensor([True, False, True, False, True])
    with no_host_reads():
        out, _, entropy = torch.ops.daca.linear_logprob(hidden, weight, targets, None, 1.0, True, 64, vocab_chunk, backend)
        out.sum().backward()
    assert torch.isnan(out[~good]).all() and torch.isnan(entropy[~good]).all() and not torch.isnan(out[good]).any()
    assert torch.isnan(hidden.grad[~good]).all() and torch.isnan(weight.grad).any()
    want = linear_logprob(hidden[good].detach(), weight.detach(), targets[good])
    torch.testing.assert_close(out[good], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias,entropy_grad,strided", [(False, False, False), (True, True, True),
                                                             (False, True, True), (True, False, False)])
def test_the_fused_kernel_writes_the_d_logits_of_a_head_slice(dtype, with_bias, entropy_grad, strided):
    # The backward's kernel for half-precision heads (Triton): the logits of head rows lo:hi and their
    # d logits in one pass (the targets, ids of the whole head, offset by lo in the kernel), against
    # float64 d logits of the whole head sliced. Edges on every side:
    # 37 rows, a 302-wide slice, H = 72 (none a multiple of the tiles), targets in and out of the slice.
    from daca_kernels.kernels.linear_logprob import head_dlogits

    n, h, vocab, lo, hi, temperature = 37, 72, 700, 128, 430, 0.8
    hidden, weight, bias, targets = make_case(n, h, vocab, dtype, seed=11, with_bias=with_bias)
    targets[:4] = torch.tensor([lo, hi - 1, lo - 1, hi])
    if strided:  # rows and columns of hidden with strides other than (H, 1)
        hidden = torch.stack([hidden, hidden], -1).transpose(0, 1).contiguous().transpose(0, 1)[..., 0]
        assert hidden.stride() == (2, 2 * n)
    g = torch.Generator().manual_seed(12)
    grad_out, grad_entropy = torch.randn(n, generator=g), torch.randn(n, generator=g)
    z = (hidden.double() @ weight.double().T + (0 if bias is None else bias.double())) / temperature
    logp = torch.log_softmax(z, -1)
    p, entropy = logp.exp(), -(logp.exp() * logp).sum(-1)
    want = grad_out.double()[:, None] * (torch.nn.functional.one_hot(targets, vocab) - p)
    if entropy_grad:
        want -= grad_entropy.double()[:, None] * p * (logp + entropy[:, None])
    want = want[:, lo:hi] / temperature
    row_max = z.max(-1).values
    stats = torch.stack([row_max, (z - row_max[:, None]).exp().sum(-1).log()], -1).float()
    out_dtype = torch.float32 if with_bias else dtype
    dlogits = torch.full((n, hi - lo), float("nan"), dtype=out_dtype)
    before = snapshot(hidden, weight, bias, targets)
    head_dlogits(hidden, weight[lo:hi], None if bias is None else bias[lo:hi], targets, grad_out,
                 grad_entropy if entropy_grad else None, stats, entropy.float(), 1.0 / temperature, dlogits,
                 target_offset=lo)
    assert_unchanged(before, hidden, weight, bias, targets)
    rtol = 1e-5 if out_dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(dlogits.double(), want, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias,return_entropy,strided", [(False, False, True), (True, True, False)])
def test_the_fused_kernel_writes_the_statistics_of_each_block_of_a_head_slice(dtype, with_bias, return_entropy,
                                                                             strided):
    # The forward's kernel for half-precision heads (Triton): the softmax statistics of every block of
    # BLOCK_V columns of the logits of head rows lo:hi, against float64 ones of the same blocks.
    from daca_kernels.kernels.linear_logprob import BLOCK_V, head_stats

    n, h, vocab, lo, hi, temperature = 37, 72, 700, 128, 430, 0.8
    hidden, weight, bias, targets = make_case(n, h, vocab, dtype, seed=13, with_bias=with_bias)
    local = (targets - lo).clamp(0, hi - lo - 1)
    local[:3] = torch.tensor([0, hi - lo - 1, BLOCK_V])  # the first and last column, a block's first
    if strided:
        hidden = torch.stack([hidden, hidden], -1).transpose(0, 1).contiguous().transpose(0, 1)[..., 0]
    z = (hidden.double() @ weight[lo:hi].double().T + (0 if bias is None else bias[lo:hi].double())) / temperature
    before = snapshot(hidden, weight, bias, targets)
    outs, maxima, logs, entropies = head_stats(hidden, weight[lo:hi], None if bias is None else bias[lo:hi], local + lo,
                                               1.0 / temperature, return_entropy, target_offset=lo)
    assert_unchanged(before, hidden, weight, bias, targets)
    blocks = z.split(BLOCK_V, dim=1)  # float32 logits summed over H = 72: errors of a few 1e-6
    assert outs.shape == maxima.shape == logs.shape == (len(blocks), n) and outs.dtype == torch.float32
    assert entropies.shape == ((len(blocks), n) if return_entropy else (0, n))
    for b, block in enumerate(blocks):
        logp = torch.log_softmax(block, -1)
        torch.testing.assert_close(maxima[b].double(), block.max(-1).values, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(logs[b].double(), (block - block.max(-1, keepdim=True).values).exp().sum(-1).log(),
                                   rtol=1e-5, atol=2e-5)
        if return_entropy:
            torch.testing.assert_close(entropies[b].double(), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=2e-5)
        holds = local // BLOCK_V == b
        torch.testing.assert_close(outs[b, holds].double(), logp[holds, (local % BLOCK_V)[holds]], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_the_chunk_merge_kernel_folds_block_statistics_as_the_torch_merge(return_entropy):
    # Three chunks of blocks of statistics folded one launch at a time into the rows' running state
    # give the whole head's log-prob, statistics and entropy, as the PyTorch merge of all blocks does.
    from daca_kernels.kernels.linear_logprob import BLOCK_V, STATE, merge_chunk
    from daca_kernels.ops.linear_logprob import _merge_blocks

    g = torch.Generator().manual_seed(4)
    n, chunks = 37, [(0, 300), (300, 556), (556, 700)]  # 3, 2 and 2 blocks; a partial block in the first
    blocks = [-(-(hi - lo) // BLOCK_V) for lo, hi in chunks]
    planes = 4 if return_entropy else 3
    parts = [torch.randn(planes, b, n, generator=g) * 3 for b in blocks]
    for p in parts:
        p[2] = p[2].abs()  # log-sum-exp above the block's maximum: >= 0
        if return_entropy:
            p[3] = p[3].abs()
    targets = torch.randint(0, 700, (n,), generator=g)
    targets[:3] = torch.tensor([299, 300, 699])  # the edges of the chunks
    out, stats = torch.empty(n), torch.empty(n, 2)
    entropy, state = torch.empty(n if return_entropy else 0), torch.empty(len(STATE), n)
    for (lo, hi), p in zip(chunks, parts):
        merge_chunk(p, targets, lo, hi, state, out, stats, entropy, lo == 0)
    # The same blocks merged at once by the PyTorch merge, each target in its block of the whole head.
    block_of = torch.tensor([sum(blocks[:c]) + (t - chunks[c][0]) // BLOCK_V
                             for t in targets.tolist() for c in [next(i for i, (lo, hi) in enumerate(chunks)
                                                                     if lo <= t < hi)]])
    merged = torch.cat(parts, 1)
    want = _merge_blocks(merged[0], merged[1], merged[2], merged[3] if return_entropy else merged.new_empty(0, n),
                         block_of, return_entropy)
    torch.testing.assert_close(out, want[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(stats[:, 0], want[1], rtol=0, atol=0)
    torch.testing.assert_close(stats[:, 1], want[2], rtol=0, atol=2e-6)
    if return_entropy:
        torch.testing.assert_close(entropy, want[3], rtol=0, atol=1e-5)
