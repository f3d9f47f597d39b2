"""The counter-based hash is bit-identical in plain Python, PyTorch and Triton."""
import pytest
import torch
import triton
import triton.language as tl

from daca_kernels.kernels.hashing import hash4, uniform_from_hash
from daca_kernels.reference import hashing


@triton.jit
def _hash_kernel(out_ptr, u_ptr, words_ptr, seed, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    w = words_ptr + offs * 4
    h = hash4(seed, tl.load(w, mask=m), tl.load(w + 1, mask=m), tl.load(w + 2, mask=m), tl.load(w + 3, mask=m))
    tl.store(out_ptr + offs, h.to(tl.int64), mask=m)
    tl.store(u_ptr + offs, uniform_from_hash(h), mask=m)


def test_published_murmur3_vectors():
    # Published murmur3_x86_32 test vectors (key bytes as little-endian words, seed).
    assert hashing.murmur3_32_words(1, []) == 0x514E28B7
    assert hashing.murmur3_32_words(0, [0x00000000]) == 0x2362F9DE
    assert hashing.murmur3_32_words(0, [0xFFFFFFFF]) == 0x76293B50
    assert hashing.murmur3_32_words(0x9747B28C, [0x61616161]) == 0x5A97808A  # "aaaa"


def test_torch_and_triton_match_the_specification():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (300, 4), generator=g, dtype=torch.int64)
    words[:5] = torch.tensor([0, 2**32 - 1, 1, 2**31])[None, :].expand(5, 4)
    seed = 0xDEADBEEF
    expected = torch.tensor([hashing.murmur3_32_words(seed, w.tolist()) for w in words])
    got_torch = hashing.hash4(seed, words[:, 0], words[:, 1], words[:, 2], words[:, 3])
    assert torch.equal(got_torch, expected)
    if not torch.cuda.is_available():
        out = torch.empty(300, dtype=torch.int64)
        u = torch.empty(300, dtype=torch.float32)
        _hash_kernel[(1,)](out, u, words.to(torch.uint32).contiguous(), seed, 300, BLOCK=512)
        assert torch.equal(out, expected)
        assert torch.equal(u, hashing.uniform_from_hash(expected))


def test_uniforms_are_strictly_inside_the_unit_interval():
    u = hashing.uniform_from_hash(torch.tensor([0, 2**32 - 1, 255, 256]))
    assert (u > 0).all() and (u < 1).all()


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, True])
def test_seed32_rejects_bad_seeds(bad):
    with pytest.raises((ValueError, TypeError), match="seed must"):
        hashing.seed32(bad)
