"""Plain-Python specification of the project's counter hash: murmur3_x86_32 over 32-bit words.

[`daca_kernels.hashing`][daca_kernels.hashing] (PyTorch) and [`daca_kernels.kernels.hashing`][daca_kernels.kernels.hashing] (Triton)
must give
exactly these numbers; this module shares no code with either, so a mistake in one of them does not
hide in the specification. Written one word at a time on Python ints, for reading.
"""
from __future__ import annotations

_MASK32 = 0xFFFFFFFF


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def murmur3_32_words(seed: int, words) -> int:
    """murmur3_x86_32 with 32-bit ``seed`` of the little-endian bytes of the 32-bit ``words``."""
    h = seed & _MASK32
    for k in words:
        k = (k * 0xCC9E2D51) & _MASK32
        k = _rotl32(k, 15)
        k = (k * 0x1B873593) & _MASK32
        h ^= k
        h = _rotl32(h, 13)
        h = (h * 5 + 0xE6546B64) & _MASK32
    h ^= 4 * len(words)  # the key length in bytes
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h


def keyed_hash(key: int, index: int) -> int:
    """The per-token hash of ``index`` under the 32-bit ``key`` (the Gumbel noise's, under a murmur3
    row key): ``k = index * 0x9E3779B9 + key``, ``h = k * 0x85EBCA6B``, ``h ^= h >> 13``,
    ``h * 0xC2B2AE35``, all mod 2**32."""
    k = (index * 0x9E3779B9 + key) & _MASK32
    h = (k * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    return (h * 0xC2B2AE35) & _MASK32


def uniform(h: int) -> float:
    """The uniform in (0, 1) of a 32-bit hash: its top 23 bits ``k`` give ``(k + 1/2) / 2**23``."""
    return ((h >> 9) + 0.5) / 2**23
