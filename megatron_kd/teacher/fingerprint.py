"""Teacher fingerprints: a digest of the teacher's weights, so a cache never mixes two teachers.

A cache records the fingerprint of the teacher that wrote it, and a writer resuming the store
refuses another one. So the fingerprint must change whenever the weights do: it is computed from
file contents, never from names, sizes or mtimes (a checkpoint rewritten in place keeps those).

    entry of a file   (path relative to the checkpoint root, size in bytes, CRC32C of the bytes)
    fingerprint       "<kind>-" + sha256 of the entries in path order (first 32 hex digits)

- Hugging Face directory (``--kd-teacher-hf``): config.json, every *.safetensors and *.bin file
  and their *.index.json (both ways of running it, transformers or a Megatron model initialized
  from it, give the same fingerprint).
- Megatron checkpoint (``--load``): every file under the directory of the iteration that is
  loaded (``iter_0000100/`` or ``release/``: .distcp shards, common.pt, metadata.json, or
  mp_rank_*/ files), found from Megatron's tracker file (or ``--ckpt-step``). The relative paths
  carry the iteration.
- An in-memory model (tests, the CPU demo): the same digest over its tensors' bytes.

CRC32C (google_crc32c, hardware-accelerated: ~18 GB/s on one core here) makes this disk-bound.
Under torch.distributed the files are split over the ranks (largest first, to the least loaded
rank), each rank reads its share, and one all-gather of the entries gives every rank the same
fingerprint: a checkpoint is read once in all, not once per rank.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import google_crc32c
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_kd.errors import UserError

_BLOCK_BYTES = 16 << 20
HF_CONFIG = "config.json"
HF_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # megatron.training.checkpointing's tracker file


def _digest(entries) -> str:
    """sha256 over (relative path, size, crc32c) lines in path order."""
    h = hashlib.sha256()
    for rel, size, crc in sorted(entries):
        h.update(f"{rel}\0{size}\0{crc:08x}\n".encode())
    return h.hexdigest()[:32]


def _file_entry(root: Path, file: Path, bar) -> tuple[str, int, int]:
    crc, size = 0, 0
    with open(file, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            crc = google_crc32c.extend(crc, block)
            size += len(block)
            bar.update(len(block))
    return file.relative_to(root).as_posix(), size, crc


def _share_of_rank(files: list[Path], rank: int, world: int) -> list[Path]:
    """This rank's files: largest first, each to the least loaded rank (the same on every rank)."""
    load, mine = [0] * world, []
    for file in sorted(files, key=lambda f: (-f.stat().st_size, f.as_posix())):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += file.stat().st_size
        if owner == rank:
            mine.append(file)
    return mine


def files_fingerprint(root, files, *, kind: str, progress: bool = True, log=print) -> str:
    """``kind`` + digest of ``files`` (paths under ``root``); collective when torch.distributed is
    initialized (every rank must call it with the same files)."""
    root = Path(root)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = _share_of_rank(list(files), rank, world)
    total = sum(f.stat().st_size for f in mine)
    start = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"teacher fingerprint ({len(mine)} files)",
              disable=not (progress and rank == 0)) as bar:
        entries = [_file_entry(root, f, bar) for f in mine]
    if distributed:
        gathered = [None] * world
        dist.all_gather_object(gathered, entries)
        entries = [e for part in gathered for e in part]
    if rank == 0 and log is not None:
        seconds = time.perf_counter() - start
        nbytes = sum(size for _, size, _ in entries)
        log(f"teacher fingerprint: {len(entries)} files, {nbytes / 2**30:.2f} GiB of {root} in {seconds:.1f} s "
            f"({nbytes / 2**30 / max(seconds, 1e-9):.2f} GiB/s over {world} rank{'s' if world > 1 else ''})")
    return f"{kind}-{_digest(entries)}"


def hf_weight_files(path) -> list[Path]:
    """config.json and the weight files of a Hugging Face model directory (UserError if absent)."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"--kd-teacher-hf {path}: not a directory (expected a Hugging Face model directory "
                        f"with {HF_CONFIG} and *.safetensors / *.bin weights)")
    if not (root / HF_CONFIG).is_file():
        raise UserError(f"--kd-teacher-hf {path}: no {HF_CONFIG} (expected a Hugging Face model directory)")
    weights = sorted({f for pattern in HF_WEIGHT_PATTERNS for f in root.glob(pattern) if f.is_file()})
    if not any(f.name.endswith((".safetensors", ".bin")) for f in weights):
        raise UserError(f"--kd-teacher-hf {path}: no *.safetensors or *.bin weight files")
    return [root / HF_CONFIG, *weights]


def hf_fingerprint(path, *, progress: bool = True, log=print) -> str:
    return files_fingerprint(path, hf_weight_files(path), kind="hf", progress=progress, log=log)


def megatron_iteration_dir(load, ckpt_step: int | None = None) -> Path:
    """The directory Megatron loads from ``load``: ``iter_{ckpt_step or tracker's:07d}`` or ``release``."""
    root = Path(load)
    tracker = root / MEGATRON_TRACKER
    if ckpt_step:
        name = f"iter_{int(ckpt_step):07d}"
    else:
        if not tracker.is_file():
            raise UserError(f"--load {load}: no {MEGATRON_TRACKER}, so no checkpoint to load the teacher from "
                            f"(Megatron would start it from random weights)")
        text = tracker.read_text().strip()
        if text == "release":
            name = "release"
        elif text.isdigit():
            name = f"iter_{int(text):07d}"
        else:
            raise UserError(f"{tracker}: expected an iteration number or 'release', got {text[:40]!r}")
    directory = root / name
    if not directory.is_dir():
        raise UserError(f"--load {load}: the checkpoint directory {directory} of the iteration to load is missing")
    return directory


def megatron_fingerprint(load, *, ckpt_step: int | None = None, progress: bool = True, log=print) -> str:
    directory = megatron_iteration_dir(load, ckpt_step)
    files = sorted(f for f in directory.rglob("*") if f.is_file())
    if not files:
        raise UserError(f"--load {load}: the checkpoint directory {directory} holds no files")
    return files_fingerprint(Path(load), files, kind="megatron", progress=progress, log=log)


def tensors_fingerprint(named_tensors) -> str:
    """The digest of an in-memory model: (name, dtype and shape, CRC32C of the bytes) per tensor."""
    entries = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            continue  # e.g. a module's _extra_state
        t = tensor.detach().contiguous().view(-1)
        data = t.view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
        entries.append((f"{name}:{str(t.dtype).removeprefix('torch.')}{list(tensor.shape)}", len(data),
                        google_crc32c.value(data)))
    return f"tensors-{_digest(entries)}"


def module_fingerprint(module: torch.nn.Module) -> str:
    """``tensors_fingerprint`` of a module's parameters and buffers."""
    return tensors_fingerprint([*module.named_parameters(), *module.named_buffers()])


__all__ = ["files_fingerprint", "hf_fingerprint", "hf_weight_files", "megatron_fingerprint",
           "megatron_iteration_dir", "module_fingerprint", "tensors_fingerprint"]
