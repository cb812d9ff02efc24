"""The teacher pass loop: dataset samples -> teacher hidden states -> top-K (or samples) -> cache.

Every data-parallel rank runs over its own partition's samples (``CacheWriter.pending_samples``,
in the order its training sampler will consume them), micro-batch by micro-batch; tensor-parallel
ranks of one model replica run in lockstep and TP rank 0 writes. A killed pass resumes where it
stopped: the writer skips what is on disk, and sampled mode keys each token's draws by (seed,
global sample index, position) alone (``ops.teacher.sample.sample_row_keys``), so re-running, from any
point and with any micro-batch or chunk size, yields the same bytes. Each micro-batch is stored
behind the next one's forward (``WriteBehind``): the pass's time is the teacher's, not the disk's.

With ``CaptureConfig.masked`` (chat data with a loss mask: ``megatron_kd.megatron.loss_mask``) the
teacher still reads every token, but the top-K (or the draws) is taken only at the positions the
sample's ``loss_mask`` keeps; every other position is stored as padding (no entries), which the
entropy-coded codecs store as a count per token, so the cache grows with the answer tokens.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_kd.cache.write_behind import WriteBehind, default_workers
from megatron_kd.ops.comm import group_rank, group_size
from megatron_kd.ops.teacher import sample_row_keys, vocab_parallel_sample, vocab_parallel_topk


@dataclass
class CaptureConfig:
    mode: Literal["topk", "sampled"] = "topk"
    """What is stored per token: the teacher's top-K, or tokens drawn from it."""
    topk: int = 100
    """K of a top-K pass: the entries stored per token."""
    draws: int = 64
    """Tokens drawn per position in a sampled pass (stored as distinct tokens with their counts)."""
    temperature: float = 1.0
    """Temperature of the teacher's softmax at capture."""
    micro_batch_size: int = 1
    seed: int = 1234
    """Seed of sampled mode; a token's draws depend on (seed, sample index, position) only."""
    chunk_size: int | None = None
    """Tokens per projection chunk (None: automatic)."""
    store_workers: int | None = None
    """Threads that compress and write the cache's shards behind the forward (None: from the CPU
    cores of this rank, ``write_behind.default_workers``)."""
    masked: bool = False
    """Entries only where the sample's ``loss_mask`` is nonzero (padding elsewhere)."""

    @property
    def entries(self) -> int:
        """Entries per token of the cache rows: K, or the draws."""
        return self.topk if self.mode == "topk" else self.draws


def _broadcast_pending(writer, tp_group, device) -> np.ndarray:
    """TP rank 0 owns the writer; every rank of the replica needs the same list of samples."""
    if group_size(tp_group) == 1:
        return writer.pending_samples()
    if group_rank(tp_group) == 0:
        pending = torch.as_tensor(writer.pending_samples(), dtype=torch.int64, device=device)
        n = torch.tensor([len(pending)], dtype=torch.int64, device=device)
    else:
        n = torch.zeros(1, dtype=torch.int64, device=device)
    src = dist.get_global_rank(tp_group, 0)
    dist.broadcast(n, src, group=tp_group)
    if group_rank(tp_group) != 0:
        pending = torch.empty(int(n), dtype=torch.int64, device=device)
    dist.broadcast(pending, src, group=tp_group)
    return pending.cpu().numpy()


def _to_device(array, device) -> torch.Tensor:
    """A host array on ``device`` without waiting for it: a copy from pageable memory synchronizes
    the host with the GPU (torch's ``copy_``), one from pinned memory queues behind the forward."""
    tensor = torch.as_tensor(array)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _entries(hidden, weight, kept, samples, cfg: CaptureConfig, tp_group, vocab_size, device):
    """(ids, logprobs) [s, b, K] of the micro-batch's hidden states [s, b, h]: the top-K or the draws at
    every position, or (``kept``: the (position, sample) index tensors of the kept tokens) only at the
    kept ones, padding (-1, -inf) elsewhere. Index tensors, not a boolean mask: a mask's indexing waits
    for the GPU to count it."""
    s, b = hidden.shape[:2]
    rows = hidden if kept is None else hidden[kept]  # [n, h]: the LM head runs on the kept tokens only
    kw = dict(tp_group=tp_group, vocab_size=vocab_size, temperature=cfg.temperature, chunk_size=cfg.chunk_size)
    if cfg.mode == "topk":
        ids, lps = vocab_parallel_topk(rows, weight, cfg.topk, **kw)
    else:
        keys = sample_row_keys(cfg.seed, _to_device(np.asarray(samples, np.int64), device), s)
        ids, lps = vocab_parallel_sample(rows, weight, cfg.draws, row_keys=keys if kept is None else keys[kept], **kw)
    if kept is None:
        return ids, lps
    full_ids = torch.full((s, b, cfg.entries), -1, dtype=ids.dtype, device=ids.device)
    full_lps = torch.full((s, b, cfg.entries), float("-inf"), dtype=lps.dtype, device=lps.device)
    full_ids[kept], full_lps[kept] = ids, lps
    return full_ids, full_lps


@torch.no_grad()
def capture_teacher(teacher, dataset, writer, cfg: CaptureConfig, *, device=None, progress: bool = True) -> dict:
    """Run ``teacher`` over this rank's pending samples of ``dataset`` and write them.

    ``writer`` is the CacheWriter of this DP rank's partition on TP rank 0 (None elsewhere);
    ``dataset[i]`` returns a dict with "tokens" and "position_ids" (Megatron's GPTDataset).
    Returns a summary (samples, tokens, seconds, tokens/s, mean teacher mass) for this rank.
    """
    tp_group = teacher.tp_group
    device = device or next(teacher.model.parameters()).device
    pending = _broadcast_pending(writer, tp_group, device)
    mbs = cfg.micro_batch_size
    is_writer = writer is not None
    bar = tqdm(total=len(pending), unit="sample", desc="teacher pass",
               disable=not (progress and is_writer and (not dist.is_initialized() or dist.get_rank() == 0)))
    tokens_done, mass_sum, start = 0, 0.0, time.perf_counter()
    # stores go behind the forward (write_behind.py): the GPU runs micro-batch i + 1 while the
    # host compresses and writes the shards micro-batches up to i filled
    workers = cfg.store_workers or default_workers()
    with WriteBehind(writer, workers=workers) if is_writer else contextlib.nullcontext() as behind:
        for i in range(0, len(pending), mbs):
            samples = pending[i:i + mbs]
            items = [dataset[int(s)] for s in samples]
            # nothing in this loop waits for the GPU: micro-batch i + 1's forward is queued while
            # micro-batch i's still runs
            host_tokens = np.stack([np.asarray(x["tokens"]) for x in items])
            tokens = _to_device(host_tokens, device)
            position_ids = _to_device(np.stack([np.asarray(x["position_ids"]) for x in items]), device)
            hidden, weight = teacher(tokens, position_ids)  # [s, b, h]
            kept, kept_tokens = None, tokens.numel()
            if cfg.masked:  # [s, b], the same on every TP rank (the same samples)
                keep = np.stack([np.asarray(x["loss_mask"]) for x in items]).T > 0
                kept, kept_tokens = tuple(_to_device(i, device) for i in np.nonzero(keep)), int(keep.sum())
            ids, lps = _entries(hidden, weight, kept, samples, cfg, tp_group, teacher.vocab_size, device)
            # [b, s, K], left on the device: the writer encodes (sorts, validates) them there
            ids, lps = ids.transpose(0, 1), lps.transpose(0, 1)
            if is_writer:
                behind.submit(samples, ids, lps, tokens=host_tokens)
            tokens_done += kept_tokens
            mass_sum = mass_sum + lps.double().exp().sum()  # on the device: no sync per micro-batch
            elapsed = time.perf_counter() - start
            bar.update(len(samples))
            bar.set_postfix(tok_s=f"{tokens_done / max(elapsed, 1e-9):,.0f}")
    bar.close()
    elapsed = time.perf_counter() - start
    return {"samples": len(pending), "tokens": tokens_done, "seconds": elapsed,
            "tokens_per_s": tokens_done / max(elapsed, 1e-9),
            "mean_teacher_mass": float(mass_sum) / max(tokens_done, 1)}
