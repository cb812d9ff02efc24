"""Token digests: every cached sample is bound to the tokens its teacher read.

A teacher row at position t is the teacher's distribution after tokens[0..t] of its sample, so rows
are only worth distilling from where the student reads those same tokens. Each sample of a cache
carries, in its shard's binding record (binding.py), two digests of its token window taken as
little-endian uint32 ids:

    digest   16 hex digits: BLAKE2b-64 of the whole window. The key a run finds a sample's rows by
             (``megatron_kd.megatron.kd_data``): any run whose samples hold the same tokens reads
             them, whatever path, split, seed, batch or length gave it those samples.
    blocks   8 hex digits per block of ``block_tokens(seq_length)`` tokens (BLAKE2b-32 of each
             block, ``BLOCKS`` of them at most): where a window differs from the one the teacher
             read, the first differing block names the positions.

Hashing a 32K-token window costs about 0.2 ms of one core; the records grow by about 530 bytes
per sample.
"""

from __future__ import annotations

import hashlib

import numpy as np

BLOCKS = 64
"""Block digests per sample (at most): 512 hex digits, whatever the sequence length."""
MIN_BLOCK = 16


def block_tokens(seq_length: int) -> int:
    """Tokens per block digest: the window in ``BLOCKS`` blocks, no block under ``MIN_BLOCK`` tokens."""
    return max(MIN_BLOCK, -(-int(seq_length) // BLOCKS))


def _ids(tokens) -> np.ndarray:
    """Token ids [..., seq] (a tensor on any device, an array or a list) as little-endian uint32."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(tokens).astype("<u4", copy=False))


def sample_digest(tokens) -> str:
    """The digest of one window of token ids [seq]."""
    return hashlib.blake2b(_ids(tokens).tobytes(), digest_size=8).hexdigest()


def block_digests(tokens) -> str:
    """The block digests of one window [seq], concatenated."""
    ids = _ids(tokens)
    step = block_tokens(len(ids))
    return "".join(hashlib.blake2b(ids[a:a + step].tobytes(), digest_size=4).hexdigest()
                   for a in range(0, len(ids), step))


def token_entries(tokens) -> list[list[str]]:
    """[digest, blocks] of each window of ``tokens`` [n, seq]: what a binding record stores per row."""
    ids = _ids(tokens)
    if ids.ndim != 2:
        raise ValueError(f"tokens must be [samples, seq_length], got shape {ids.shape}")
    return [[sample_digest(row), block_digests(row)] for row in ids]


def valid_entry(entry, seq_length: int) -> bool:
    """Whether ``entry`` is a record's [digest, blocks] for a window of ``seq_length`` tokens."""
    blocks = -(-seq_length // block_tokens(seq_length))
    return (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)
            and len(entry[0]) == 16 and len(entry[1]) == 8 * blocks
            and all(c in "0123456789abcdef" for c in entry[0] + entry[1]))


def first_difference(recorded_blocks: str, tokens) -> tuple[int, int] | None:
    """The positions [first, last] of the first block where ``tokens`` [seq] differ from the window
    whose block digests are ``recorded_blocks``; None where every block agrees."""
    ids = _ids(tokens)
    step = block_tokens(len(ids))
    ours = block_digests(ids)
    for b in range(0, len(recorded_blocks), 8):
        if ours[b:b + 8] != recorded_blocks[b:b + 8]:
            first = b // 8 * step
            return first, min(first + step, len(ids)) - 1
    return None
