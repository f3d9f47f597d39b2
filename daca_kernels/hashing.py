"""The project's counter-based random numbers: murmur3 (x86, 32-bit) over 32-bit words, in PyTorch.

Every random choice of the library (stratum keys, prompt masking, interleave offsets, mask ratios,
random remasking) is ``murmur3_32(seed32(seed), [stream, a, b, c])`` over the little-endian bytes
of the four words, so masks and samples are a pure function of ``(seed, stream, indices)``, and
the hashes are bit-identical across the PyTorch paths, the Triton interpreter and the GPU. The
Gumbel noise, one draw per vocabulary entry of every sampled row, uses a cheaper per-token hash
under a murmur3 row key ([`gumbel_hash`][daca_kernels.hashing.gumbel_hash]): a sampler pass over the vocabulary has a budget of
a few instructions per token, and murmur3 alone would take twice that. ``daca_kernels.kernels.hashing`` implements
these in Triton; ``tests/ops/test_hashing.py`` checks both against a plain-Python specification
and murmur3's published test vectors.

``seed32(seed)`` folds a Python int seed to 32 bits; the ``STREAM_*`` constants (the first word)
keep the uses apart. This module imports nothing of the project: the production code and the
references both draw their numbers from it.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
C1, C2 = 0xCC9E2D51, 0x1B873593
F1, F2 = 0x85EBCA6B, 0xC2B2AE35
ROUND_ADD = 0xE6546B64
WEYL = 0x9E3779B9  # 2**32 / golden ratio, odd: token ids spread over the 32-bit key space

# Streams: the first hashed word, one per use.
STREAM_STRATUM_KEY = 1
STREAM_PROMPT_MASK = 2
STREAM_INTERLEAVE_OFFSET = 3
STREAM_GUMBEL = 4
STREAM_MASK_RATIO = 5
STREAM_ELBO_MASK = 6
STREAM_RANDOM_REMASK = 7
STREAM_BLOCK_SELECT = 8


def seed32(seed: int) -> int:
    """Fold a non-negative Python int seed (up to 64 bits) into 32 bits."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0 or seed >= 1 << 64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    return (seed ^ (seed >> 32)) & MASK32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 on int64 without overflow: split c into 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) << 16)) & MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK32


def murmur3_32(seed: int, words) -> torch.Tensor:
    """``murmur3_x86_32`` of the little-endian bytes of ``words``, elementwise over broadcast tensors.

    ``seed`` is a 32-bit int (see [`seed32`][daca_kernels.hashing.seed32]); ``words`` is a sequence of ints or integer
    tensors with values in ``[0, 2**32)`` (ints go to the device of the first tensor). Returns
    int64 values in ``[0, 2**32)`` of the broadcast shape.
    """
    # A loop rather than next(generator, None), which torch 2.6's torch.compile cannot trace.
    device = None
    for w in words:
        if isinstance(w, torch.Tensor):
            device = w.device
            break
    words = torch.broadcast_tensors(*(torch.as_tensor(w, dtype=torch.int64, device=device) for w in words))
    h = torch.full_like(words[0], seed & MASK32) if words else torch.tensor(seed & MASK32, device=device)
    for k in words:
        k = _mul32(k & MASK32, C1)
        k = _mul32(_rotl32(k, 15), C2)
        h = h ^ k
        h = (_mul32(_rotl32(h, 13), 5) + ROUND_ADD) & MASK32
    h = h ^ (4 * len(words))
    h = h ^ (h >> 16)
    h = _mul32(h, F1)
    h = h ^ (h >> 13)
    h = _mul32(h, F2)
    return h ^ (h >> 16)


def derive_seed(seed: int, *parts: int) -> int:
    """A 32-bit seed for one use (``parts``: e.g. purpose, step, index; ints, taken mod 2**32) from a
    run's seed in ``[0, 2**64)``: nearby parts give unrelated seeds."""
    return int(murmur3_32(seed32(seed), parts))


def hash4(seed: int, stream, a, b, c) -> torch.Tensor:
    """``murmur3_32(seed, [stream, a, b, c])``: the four-word hash every random draw uses."""
    return murmur3_32(seed, (stream, a, b, c))


def keyed_hash(key, index) -> torch.Tensor:
    """The per-token hash under a 32-bit ``key``: ``k = (index * WEYL + key) mod 2**32``, then the
    middle of murmur3's finalizer, ``h = k * F1; h ^= h >> 13; h * F2`` (mod ``2**32``).

    A bijection of ``index`` (below ``2**32``) for a fixed key: no two tokens of a row share a draw.
    The top bits, the ones used ([`uniform_from_hash`][daca_kernels.hashing.uniform_from_hash]), depend on every bit of ``k``.
    ``key`` and ``index`` are ints or int64 tensors in ``[0, 2**32)`` (broadcast); returns int64 in
    ``[0, 2**32)``.
    """
    h = _mul32((torch.as_tensor(index, dtype=torch.int64) * WEYL + key) & MASK32, F1)
    return _mul32(h ^ (h >> 13), F2)


def gumbel_hash(seed: int, step, row_ids, tokens, stream: int = STREAM_GUMBEL) -> torch.Tensor:
    """The 32-bit hash behind the Gumbel noise of token ``tokens`` in row ``row_ids`` at ``step``:
    ``keyed_hash(murmur3_32(seed, [stream, step, row_id]), token)`` (broadcast; ``seed`` a 32-bit
    int, see [`seed32`][daca_kernels.hashing.seed32]; ``stream`` is ``STREAM_GUMBEL`` for the sampler's noise)."""
    return keyed_hash(murmur3_32(seed, (stream, step, row_ids)), tokens)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Map 32-bit hashes to float32 uniforms in the open interval (0, 1) (23 random bits, exact in fp32)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
