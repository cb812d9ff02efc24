"""Stochastic rounding of fp32 values to bf16, with random bits that are a function of where the
element is, not of a generator's state.

bf16 is fp32 with the low 16 bits dropped. Rounding x to nearest loses any update smaller than half
a bf16 step (2^-8 of |x|): at a learning rate of 1e-5 Adam moves a weight by ~1e-5 per step, far
below the step of a weight of 0.02 (1.2e-4), so a bf16 weight without an fp32 master copy never
moves. Stochastic rounding rounds up with probability (low 16 bits) / 2^16 and down otherwise, so
E[SR(x)] = x exactly and small updates accumulate in expectation.

The 16 random bits of an element are ``hash(key, offset)``: ``key`` a 64-bit value that the caller
derives from (seed, the tensor's identity, the step) and ``offset`` the element's index in its
tensor. No generator state exists to save or restore: a run resumed from a checkpoint at step t draws
the same bits as one that never stopped, and a data-parallel shard of a tensor draws exactly the
bits that the unsharded tensor draws at the same elements. The hash is two rounds of Chris Wellons'
``lowbias32`` (full avalanche) computed in int64 without overflow (32 x 16-bit partial products), so
CPU and CUDA, eager and compiled, give the same bits.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_LOWBIAS32 = (0x7FEB352D, 0x846CA68B)
_STREAM_H2_SALT = 0x9E3779B9


def _mul32(x, constant: int):
    """(x * constant) mod 2^32 for x in [0, 2^32) (tensor or int), exactly, in int64."""
    lo, hi = constant & 0xFFFF, constant >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, _LOWBIAS32[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _LOWBIAS32[1])
    return x ^ (x >> 16)


_STREAM_START = (0x243F6A88, 0x85A308D3)  # two independent chains (digits of pi)


def stream_key(*words: int) -> tuple[int, int]:
    """A 64-bit key, as two 32-bit words, from non-negative integers (seed, tensor identity,
    step, ...), on the host."""
    return stream_key_from(_STREAM_START, *words)


def stream_key_from(prefix: tuple[int, int], *words: int) -> tuple[int, int]:
    """``stream_key`` of the words that made ``prefix`` (a key) followed by ``words``: a tensor's
    (seed, stream, index) are hashed once and each step's number finishes the key (on the device, in
    ``adam_triton``, for a step below 2^32: one 32-bit word)."""
    h1, h2 = prefix
    for w in words:
        if w < 0:
            raise ValueError(f"stream_key takes non-negative integers, got {w}")
        while True:  # words of any size, 32 bits at a time
            h1 = _mix32(h1 ^ (w & _MASK32))
            h2 = _mix32(((h2 + (w & _MASK32)) & _MASK32) ^ _STREAM_H2_SALT)
            w >>= 32
            if not w:
                break
    return h1, h2


MAX_ELEMENTS = 2**32  # elements are indexed with 32 bits


def random_bits16(key: tuple[int, int], offset: int, numel: int, device: torch.device) -> torch.Tensor:
    """16 random bits (int32 in [0, 2^16)) for elements ``offset .. offset + numel - 1`` of the
    stream ``key`` (``stream_key``'s 64 bits as two 32-bit words; offset + numel <= 2^32)."""
    k1, k2 = key
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    h = _mix32(_mix32((index + k1) & _MASK32) ^ k2)
    return (h >> 16).to(torch.int32)


def stochastic_round_bf16(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` -> bf16, rounding away from zero when ``bits16`` < the 16 bits dropped.

    Finite values round to one of their two bf16 neighbours (the largest ones up to ±inf with the
    probability that says); inf and NaN are kept."""
    bits = x.view(torch.int32)
    finite = torch.isfinite(x)
    toward_zero = bits & -0x10000
    # the magnitude bits sit below the sign bit: adding one bf16 step moves away from zero (and
    # cannot overflow int32 for finite values: 0x7F7F0000 + 0x10000 is +inf's pattern)
    away = (bits16 < (bits & 0xFFFF)) & finite
    rounded = torch.where(away, toward_zero + 0x10000, toward_zero).view(torch.float32)
    return torch.where(finite, rounded, x).to(torch.bfloat16)
