"""Which data-parallel partition, and which row in it, holds each sample.

Megatron's pretraining sampler hands data-parallel rank r, from every global batch of consecutive
sample indices, the micro-batch slice [r·mbs, (r+1)·mbs). With the capture's dp_size and
micro_batch_size, sample i therefore belongs to rank (i // mbs) % dp and is that rank's
(i // (mbs·dp))·mbs + i % mbs -th sample: each partition lists its samples in training order, so
a rank that trains with the same layout reads its own partition front to back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PartitionLayout:
    num_samples: int
    dp_size: int
    micro_batch_size: int

    def __post_init__(self):
        for name in ("num_samples", "dp_size", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < (0 if name == "num_samples" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'num_samples' else 'positive'} "
                                 f"int, got {value!r}")

    def locate(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """Global sample indices -> (partition rank, row in the partition), vectorized."""
        s = np.asarray(samples, dtype=np.int64)
        mbs, dp = self.micro_batch_size, self.dp_size
        return (s // mbs) % dp, (s // (mbs * dp)) * mbs + s % mbs

    def samples_of(self, rank: int) -> np.ndarray:
        """Global sample indices held by partition ``rank``, in row order."""
        mbs, dp = self.micro_batch_size, self.dp_size
        starts = np.arange(rank * mbs, self.num_samples, mbs * dp, dtype=np.int64)
        rows = (starts[:, None] + np.arange(mbs, dtype=np.int64)[None, :]).ravel()
        return rows[rows < self.num_samples]

    def rows_of(self, rank: int) -> int:
        return len(self.samples_of(rank))
