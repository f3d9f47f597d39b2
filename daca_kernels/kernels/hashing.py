"""Triton twin of the PyTorch counter hashes in ``daca_kernels.hashing``: murmur3_x86_32 over three
or four 32-bit words, and the per-token ``keyed_hash`` of the Gumbel noise (``keyed_finish`` of
the word a kernel forms with one addition per token).

Both implementations must stay bit-identical; ``tests/ops/test_hashing.py`` checks them against the
plain-Python specification in ``daca_kernels.reference.hashing``.
"""
import triton
import triton.language as tl

WEYL = tl.constexpr(0x9E3779B9)
KEYED_F1 = tl.constexpr(0x85EBCA6B)
# WEYL * KEYED_F1 mod 2**32: a token's word times KEYED_F1 is token * WEYL_F1 + key * KEYED_F1.
WEYL_F1 = tl.constexpr((0x9E3779B9 * 0x85EBCA6B) & 0xFFFFFFFF)


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
def _finalize(h, nbytes: tl.constexpr):
    h = h ^ nbytes
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def hash3(seed, stream, a, b):
    """murmur3_32(seed, [stream, a, b]) on uint32 (arguments are cast to uint32)."""
    h = _mix_word(seed.to(tl.uint32), stream.to(tl.uint32))
    h = _mix_word(h, a.to(tl.uint32))
    return _finalize(_mix_word(h, b.to(tl.uint32)), 12)


@triton.jit
def hash4(seed, stream, a, b, c):
    """murmur3_32(seed, [stream, a, b, c]) on uint32 (arguments are cast to uint32)."""
    h = _mix_word(seed.to(tl.uint32), stream.to(tl.uint32))
    h = _mix_word(h, a.to(tl.uint32))
    h = _mix_word(h, b.to(tl.uint32))
    return _finalize(_mix_word(h, c.to(tl.uint32)), 16)


@triton.jit
def keyed_finish(h):
    """``keyed_hash`` from ``h = (index * WEYL + key) * KEYED_F1`` (uint32, mod 2**32): ``(h ^ (h >>
    13)) * 0xC2B2AE35``. Products distribute over the sum, so a loop over consecutive indices forms
    ``h`` with one addition per element: ``index * WEYL_F1`` plus ``key * KEYED_F1``."""
    return (h ^ (h >> 13)) * 0xC2B2AE35



@triton.jit
def uniform_from_hash(h):
    """float32 uniform ``(k + 1/2) / 2**23`` in (0, 1) from the top 23 bits ``k`` of a uint32 hash, as
    the reference does: the bits become the mantissa of ``1 + k / 2**23`` and ``1 - 2**-24`` is
    subtracted, exactly (no integer-to-float conversion)."""
    return ((h >> 9) + 0x3F800000).to(tl.float32, bitcast=True) - 0.999999940395355224609375
