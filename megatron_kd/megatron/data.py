"""Megatron data plumbing shared by the teacher pass, training and the demo.

- ``ByteTokenizer``: a byte-level MegatronTokenizer (256 bytes + end-of-document + pad).
- ``write_indexed_dataset``: documents of token ids -> Megatron's .bin/.idx pair.
- ``build_gpt_datasets``: megatron-core's GPTDataset splits through BlendedMegatronDatasetBuilder,
  exactly as Megatron-LM's pretrain_gpt builds them (so sample indices agree with training), with
  the loss mask of chat data joined (``megatron_kd.megatron.loss_mask.with_loss_masks``).
- ``repair_index_cache``: megatron-core caches each dataset's document / sample / shuffle index as
  ``<hash>-<class>-<split>-<name>.npy`` (beside ``-description.txt``) and memory-maps them when all
  are present. A process killed inside ``np.save`` leaves a truncated file that would then fail to
  load on every later run; before megatron-core's builder runs, such a dataset's cached files are
  removed (one line says so) and the builder writes them again.
- fingerprints of tokenizers and datasets, stored in and checked against the teacher cache.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase

from megatron_kd.errors import UserError


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as tokens 0..255, then end-of-document (256) and pad (257)."""

    def __init__(self):
        super().__init__(path="", config={})
        # megatron-core datasets put this into their description (and hence their hash)
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict:
        return {**{bytes([i]).hex(): i for i in range(256)}, "<eod>": 256, "<pad>": 257}

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return 256

    @property
    def pad(self) -> int:
        return 257

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer has no chat template")


def vocabulary(tokenizer) -> dict[str, int] | None:
    """The tokenizer's token -> id table, whatever form the library hands it in: a dict (token ->
    id), a list or tuple (index = id; megatron-core's text tokenizers), or an object with
    ``get_vocab()`` (transformers). None for a tokenizer without one (Megatron's NullTokenizer)."""
    try:
        vocab = tokenizer.vocab
    except (AttributeError, NotImplementedError):
        vocab = None
    if vocab is None and hasattr(tokenizer, "get_vocab"):
        vocab = tokenizer.get_vocab()
    if isinstance(vocab, (list, tuple)):
        return {str(token): i for i, token in enumerate(vocab)}
    if hasattr(vocab, "items"):
        return {str(token): int(i) for token, i in vocab.items()}
    if vocab is not None and hasattr(vocab, "get_vocab"):
        return {str(token): int(i) for token, i in vocab.get_vocab().items()}
    return None


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's class, vocabulary size and vocabulary (id -> token mapping): two
    tokenizers of one size but other tokens differ."""
    vocab = vocabulary(tokenizer)
    items = sorted(vocab.items(), key=lambda item: (item[1], item[0])) if vocab else []
    doc = {"class": type(tokenizer).__name__, "vocab_size": int(tokenizer.vocab_size), "vocab": items}
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def dataset_fingerprint(dataset) -> str:
    """Hash of megatron-core's description of the dataset (files, split, seed, length, count) with its
    tokenizer named by content (``tokenizer_fingerprint``), not as megatron-core names it, by class and
    path: a pruned student's copy of the teacher's tokenizer reads the same samples from the same files."""
    described = dict(dataset.unique_identifiers)
    if described.get("tokenizer") is not None:
        described["tokenizer"] = tokenizer_fingerprint(described["tokenizer"])
    text = json.dumps(described, indent=4, default=lambda obj: obj.unique_identifiers)
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def write_indexed_dataset(prefix: str | Path, documents: Iterable, vocab_size: int) -> Path:
    """Write documents (sequences of token ids) as ``prefix``.bin / ``prefix``.idx."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_document(torch.as_tensor(np.asarray(doc, dtype=np.int64)), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return prefix


def build_gpt_datasets(data_prefixes: list[str], *, split: str, seq_length: int, seed: int, tokenizer,
                       num_samples: tuple[int, int, int], cache_dir: str | None = None, is_built_on_rank=None):
    """(train, valid, test) GPTDatasets, as Megatron-LM builds them for pretraining.

    The blend is a list of prefixes (equal weights) as in ``--data-path``; sample i of a split is
    the same token window on every rank and in every run with the same arguments.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(list(map(str, data_prefixes)), None),
        split=split, tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, path_to_cache=cache_dir,
        mid_level_dataset_surplus=0.005,
    )
    from megatron_kd.megatron.loss_mask import with_loss_masks

    repair_index_cache(config)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank or (lambda: True), config)
    return tuple(with_loss_masks(split) for split in builder.build())


def index_cache_dirs(config) -> list[Path]:
    """Where megatron-core keeps the index files of ``config``'s datasets: ``path_to_cache``, else
    ``<prefix>/cache/GPTDataset_indices`` per data prefix (its default)."""
    if config.path_to_cache:
        return [Path(config.path_to_cache)]
    blends = [config.blend, *(config.blend_per_split or [])]
    prefixes = {p for blend in blends if blend for p in blend[0]}
    return [Path(p) / "cache" / "GPTDataset_indices" for p in sorted(prefixes)]


def _torn(path: Path) -> str | None:
    """Why an index .npy cannot be memory-mapped (truncated, empty, bad header), or None."""
    try:
        np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        return str(e) or type(e).__name__
    return None


def repair_index_cache(config) -> None:
    """Remove every dataset's cached index files (all of its ``<hash>-<class>-<split>-*``) when one
    of its .npy files is torn, so megatron-core's builder rebuilds them. Runs where the builder
    writes (global rank 0, or without torch.distributed): the other ranks read the files only
    after the builder's barrier, when rank 0 has written them again."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    for directory in index_cache_dirs(config):
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.npy")):
            reason = _torn(path) if path.exists() else None
            if reason is None:
                continue
            base = path.name[:path.name.rindex("-") + 1]  # "<hash>-<class>-<split>-"
            for stale in sorted(directory.glob(f"{base}*")):
                try:
                    stale.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise UserError(f"dataset index cache {directory}: {path.name} is torn ({reason}) and {stale} "
                                    f"cannot be removed ({e.strerror}): delete the files {base}* there") from None
            print(f"megatron_kd: dataset index cache {directory}: {path.name} was torn ({reason}); removed "
                  f"{base}* for megatron-core to rebuild", file=sys.stderr, flush=True)
