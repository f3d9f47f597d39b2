"""The counter-based hash is bit-identical in plain Python (the specification), PyTorch and Triton."""
import pytest
import torch
import triton
import triton.language as tl

from daca_kernels import hashing
from daca_kernels.kernels import hashing as triton_hashing
from daca_kernels.reference import hashing as spec


@triton.jit
def _hash_kernel(out_ptr, u_ptr, words_ptr, seed, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    w = words_ptr + offs * 4
    h = triton_hashing.hash4(seed, tl.load(w, mask=m), tl.load(w + 1, mask=m), tl.load(w + 2, mask=m), tl.load(w + 3, mask=m))
    tl.store(out_ptr + offs, h.to(tl.int64), mask=m)
    tl.store(u_ptr + offs, triton_hashing.uniform_from_hash(h), mask=m)


def test_published_murmur3_vectors():
    # Published murmur3_x86_32 test vectors (key bytes as little-endian words, seed).
    vectors = [(1, [], 0x514E28B7), (0, [0x00000000], 0x2362F9DE), (0, [0xFFFFFFFF], 0x76293B50),
               (0x9747B28C, [0x61616161], 0x5A97808A)]  # the last one is "aaaa"
    for seed, words, expected in vectors:
        assert spec.murmur3_32_words(seed, words) == expected
        assert int(hashing.murmur3_32(seed, words)) == expected


def _random_words(count: int, rows: int = 300) -> torch.Tensor:
    words = torch.randint(0, 2**32, (rows, count), generator=torch.Generator().manual_seed(count), dtype=torch.int64)
    words[:5] = torch.tensor([0, 2**32 - 1, 1, 2**31, 7][:count])[None, :].expand(5, count)
    return words


@pytest.mark.parametrize("count", [1, 3, 4, 5])
def test_torch_hash_of_any_word_count_matches_the_specification(count):
    words, seed = _random_words(count), 0x1234ABCD
    expected = torch.tensor([spec.murmur3_32_words(seed, w.tolist()) for w in words])
    assert torch.equal(hashing.murmur3_32(seed, list(words.T)), expected)


def _check_triton_kernel(kernel, words, seed, expected, expected_u):
    """The hashes and uniforms a test kernel computes from ``words`` (one row of words per hash),
    under the interpreter (no GPU here)."""
    if torch.cuda.is_available():
        return
    out = torch.empty(len(words), dtype=torch.int64)
    u = torch.empty(len(words), dtype=torch.float32)
    kernel[(1,)](out, u, words.to(torch.uint32).contiguous(), seed, len(words), BLOCK=512)
    assert torch.equal(out, expected)
    assert torch.equal(u, expected_u)


def test_torch_and_triton_match_the_specification():
    words, seed = _random_words(4), 0xDEADBEEF
    expected = torch.tensor([spec.murmur3_32_words(seed, w.tolist()) for w in words])
    expected_u = torch.tensor([spec.uniform(h) for h in expected.tolist()], dtype=torch.float32)
    assert torch.equal(hashing.hash4(seed, words[:, 0], words[:, 1], words[:, 2], words[:, 3]), expected)
    assert torch.equal(hashing.uniform_from_hash(expected), expected_u)
    # Python ints broadcast against tensors as words.
    assert torch.equal(hashing.hash4(seed, 7, words[:, 1], 3, words[:, 3]),
                       torch.tensor([spec.murmur3_32_words(seed, [7, w[1], 3, w[3]]) for w in words.tolist()]))
    _check_triton_kernel(_hash_kernel, words, seed, expected, expected_u)


@triton.jit
def _gumbel_hash_kernel(out_ptr, u_ptr, words_ptr, seed, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    w = words_ptr + offs * 3
    key = triton_hashing.hash3(seed, 4 + 0 * seed, tl.load(w, mask=m), tl.load(w + 1, mask=m))
    # As the sampling kernel forms it: token * WEYL_F1 + key * KEYED_F1 (the product distributed).
    token = tl.load(w + 2, mask=m).to(tl.uint32)
    h = triton_hashing.keyed_finish(token * triton_hashing.WEYL_F1 + key * triton_hashing.KEYED_F1)
    tl.store(out_ptr + offs, h.to(tl.int64), mask=m)
    tl.store(u_ptr + offs, triton_hashing.uniform_from_hash(h), mask=m)


def test_gumbel_hash_matches_the_specification_in_torch_and_triton():
    # (step, row id, token) words, the extremes included; the row key is murmur3 over three words.
    words, seed = _random_words(3), 0x0BADF00D
    keys = [spec.murmur3_32_words(seed, [hashing.STREAM_GUMBEL, step, row]) for step, row, _ in words.tolist()]
    expected = torch.tensor([spec.keyed_hash(k, w[2]) for k, w in zip(keys, words.tolist())])
    expected_u = torch.tensor([spec.uniform(h) for h in expected.tolist()], dtype=torch.float32)
    assert torch.equal(hashing.gumbel_hash(seed, words[:, 0], words[:, 1], words[:, 2]), expected)
    assert hashing.STREAM_GUMBEL == 4
    _check_triton_kernel(_gumbel_hash_kernel, words, seed, expected, expected_u)


def test_keyed_hash_is_a_bijection_of_the_token_under_a_key():
    # No two tokens of a row share a draw: distinct indices give distinct hashes (and the hashes of
    # consecutive tokens fill the 23-bit uniform grid evenly: a chi-square over 256 bins).
    key = spec.murmur3_32_words(7, [hashing.STREAM_GUMBEL, 3, 11])
    h = hashing.keyed_hash(key, torch.arange(1 << 18))
    assert h.unique().numel() == 1 << 18
    counts = torch.bincount((h >> 24).long(), minlength=256).double()
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum().item()
    assert chi2 < 255 + 5 * (2 * 255) ** 0.5  # five standard deviations above its mean


def test_uniforms_are_strictly_inside_the_unit_interval():
    u = hashing.uniform_from_hash(torch.tensor([0, 2**32 - 1, 255, 256]))
    assert (u > 0).all() and (u < 1).all()
    assert 0 < spec.uniform(0) < spec.uniform(2**32 - 1) < 1


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, True])
def test_seed32_rejects_bad_seeds(bad):
    with pytest.raises((ValueError, TypeError), match="seed must"):
        hashing.seed32(bad)
