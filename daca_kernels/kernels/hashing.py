"""Triton twin of the PyTorch counter hash in ``daca_kernels.hashing``: murmur3_x86_32 over four
32-bit words.

Both implementations must stay bit-identical; ``tests/ops/test_hashing.py`` checks them against the
plain-Python specification in ``daca_kernels.reference.hashing``.
"""
import triton
import triton.language as tl


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix_word(h, k):
    k = k * 0xCC9E2D51
    k = _rotl32(k, 15) * 0x1B873593
    h = h ^ k
    return _rotl32(h, 13) * 5 + 0xE6546B64


@triton.jit
def hash4(seed, stream, a, b, c):
    """murmur3_32(seed, [stream, a, b, c]) on uint32 (arguments are cast to uint32)."""
    h = seed.to(tl.uint32)
    h = _mix_word(h, stream.to(tl.uint32))
    h = _mix_word(h, a.to(tl.uint32))
    h = _mix_word(h, b.to(tl.uint32))
    h = _mix_word(h, c.to(tl.uint32))
    h = h ^ 16
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def uniform_from_hash(h):
    """float32 uniform in (0, 1) from a uint32 hash (23 random bits), as the reference does."""
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
