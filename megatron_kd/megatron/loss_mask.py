"""The per-token loss mask of chat data (``megatron-kd data chat``, ``megatron_kd/data/``), joined to
Megatron's GPT datasets.

A data prefix has a loss mask when ``PREFIX_chat.json`` lies beside ``PREFIX.bin``: it names the
uint8 indexed dataset ``PREFIX_loss_mask.bin/.idx`` (one byte per token, the same documents as the
tokens) and the mask's fingerprint. ``with_loss_masks(dataset)`` wraps a GPTDataset (or a blend of
them) whose prefixes have masks in ``LossMaskedDataset``: sample i's ``loss_mask`` becomes Megatron's
(padding, ``--eod-mask-loss``) times the mask of its label tokens, read from the mask dataset with
the sample's own documents and offsets (megatron-core's sample index, so packing is untouched).
A prefix of a blend without a mask trains every token. ``loss_mask_field(dataset)`` is what the
teacher cache records and training checks: {} without masks, else the masks' settings and
fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from megatron_kd.errors import UserError

SIDECAR_FORMAT = "megatron_kd.chat_loss_mask/1"


def mask_prefix(prefix) -> Path:
    return Path(f"{prefix}_loss_mask")


def sidecar_path(prefix) -> Path:
    return Path(f"{prefix}_chat.json")


class LossMaskError(UserError):
    """A chat loss mask that does not belong to its token dataset, or a sidecar that does not parse."""


def read_sidecar(prefix) -> dict | None:
    """``PREFIX_chat.json``, checked; None when the prefix has no loss mask."""
    path = sidecar_path(prefix)
    if not path.exists():
        return None
    try:
        sidecar = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LossMaskError(f"{path}: not readable JSON ({e}); write it again with megatron-kd data chat") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != SIDECAR_FORMAT:
        raise LossMaskError(f"{path}: format is {sidecar.get('format') if isinstance(sidecar, dict) else None!r}, "
                            f"expected {SIDECAR_FORMAT!r}")
    for key in ("mask", "fingerprint", "loss_mask"):
        if not isinstance(sidecar.get(key), str):
            raise LossMaskError(f"{path}: field {key!r} is missing or not a string")
    expected = mask_prefix(Path(prefix).name).name
    if sidecar["loss_mask"] != expected:  # a name, never a path: the mask lies beside the tokens
        raise LossMaskError(f"{path}: field 'loss_mask' is {sidecar['loss_mask']!r}, expected {expected!r} (the "
                            f"mask beside {Path(prefix).name}.bin in the same directory); write the dataset again "
                            f"with megatron-kd data chat")
    return sidecar


def _open_mask(prefix, tokens) -> object:
    """The mask's IndexedDataset, checked to hold the documents of ``tokens`` (the prefix's IndexedDataset)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    read_sidecar(prefix)  # checks that it names PREFIX_loss_mask
    where = mask_prefix(prefix)
    if not Path(f"{where}.idx").exists() or not Path(f"{where}.bin").exists():
        raise LossMaskError(f"{sidecar_path(prefix)}: names the loss mask {where}.bin/.idx, which is not there")
    mask = IndexedDataset(str(where))
    if mask.index.dtype != np.uint8 or not np.array_equal(mask.sequence_lengths, tokens.sequence_lengths):
        raise LossMaskError(f"{where}.idx: its documents are not those of {prefix}.idx (dtype {mask.index.dtype}, "
                            f"{len(mask.sequence_lengths)} documents against {len(tokens.sequence_lengths)}); "
                            f"write both again with megatron-kd data chat")
    return mask


def _gpt_datasets(dataset) -> list:
    """The GPTDatasets under ``dataset`` (itself, or a blend's; through our wrappers' ``base``)."""
    while hasattr(dataset, "base"):
        dataset = dataset.base
    return list(getattr(dataset, "datasets", None) or [dataset])


def _sidecar_of(gpt_dataset) -> dict | None:
    path = getattr(gpt_dataset, "dataset_path", None)
    return read_sidecar(path) if path else None


def loss_mask_field(dataset) -> dict:
    """The loss mask ``dataset``'s samples carry (a ``LossMaskedDataset``, or a wrapper of one): {} when
    none, else {"mask": the settings of each prefix's mask ("none" for a prefix without), "fingerprint":
    a digest of their fingerprints}: the teacher cache's ``loss_mask`` field, which training compares
    with its own."""
    while not isinstance(dataset, LossMaskedDataset) and hasattr(dataset, "base"):
        dataset = dataset.base
    return dict(dataset.loss_mask) if isinstance(dataset, LossMaskedDataset) else {}


def digest(obj) -> str:
    """32 hex digits of the SHA-256 of ``obj``'s canonical JSON (the mask's fingerprints)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def _mask_field(sidecars: list) -> dict:
    return {"mask": "; ".join(s["mask"] if s else "none" for s in sidecars),
            "fingerprint": digest([s["fingerprint"] if s else None for s in sidecars])}


class _SampleMask:
    """The mask of one GPTDataset's samples: megatron-core's own sample lookup over the mask dataset."""

    def __init__(self, gpt_dataset):
        self.gpt = gpt_dataset
        self.mask = _open_mask(gpt_dataset.dataset_path, gpt_dataset.dataset)

    def __call__(self, idx: int) -> np.ndarray:
        """uint8 [seq_length]: the mask of each position's label token."""
        from megatron.core.datasets.gpt_dataset import GPTDataset

        gpt = self.gpt
        # the document / sample / shuffle indices of the token dataset, the mask dataset to read; padding
        # (past the last document) is 0
        view = SimpleNamespace(dataset=self.mask, config=gpt.config, _pad_token_id=0,
                               shuffle_index=gpt.shuffle_index, sample_index=gpt.sample_index,
                               document_index=gpt.document_index,
                               path_to_shuffle_index=getattr(gpt, "path_to_shuffle_index", None),
                               path_to_sample_index=getattr(gpt, "path_to_sample_index", None),
                               path_to_document_index=getattr(gpt, "path_to_document_index", None))
        text, _, _ = GPTDataset._query_document_sample_shuffle_indices(view, idx)
        if gpt.config.add_extra_token_to_sequence:
            return text[1:]
        return np.concatenate([text[1:], np.zeros(1, text.dtype)])


class LossMaskedDataset(torch.utils.data.Dataset):
    """``base`` (a GPTDataset or a BlendedDataset of them) with each sample's ``loss_mask`` multiplied
    by the chat loss mask of its label tokens. Forwards ``config`` and ``unique_identifiers`` (what
    the teacher cache's dataset fingerprint is taken from: the mask has a field of its own)."""

    def __init__(self, base):
        self.base = base
        sidecars = [_sidecar_of(d) for d in _gpt_datasets(base)]
        self._masks = [_SampleMask(d) if sidecar else None for d, sidecar in zip(_gpt_datasets(base), sidecars)]
        self.loss_mask = _mask_field(sidecars)

    @property
    def config(self):
        return self.base.config

    @property
    def unique_identifiers(self):
        return self.base.unique_identifiers

    def __len__(self) -> int:
        return len(self.base)

    def _mask(self, idx: int) -> np.ndarray | None:
        if len(self._masks) == 1:
            sample_mask = self._masks[0]
            return None if sample_mask is None else sample_mask(idx)
        which, inner = int(self.base.dataset_index[idx]), int(self.base.dataset_sample_index[idx])
        sample_mask = self._masks[which]
        return None if sample_mask is None else sample_mask(inner)

    def __getitem__(self, idx: int | None) -> dict:
        item = self.base[idx]  # first: it maps megatron-core's lazily loaded indices
        if idx is None:  # GPTDataset's batch-padding sample: its loss mask is all zeros already
            return item
        mask = self._mask(int(idx))
        if mask is not None:
            item["loss_mask"] = item["loss_mask"] * torch.from_numpy(mask.astype(np.float32))
        return item


def with_loss_masks(dataset):
    """``dataset`` wrapped in ``LossMaskedDataset`` when a prefix under it has a chat loss mask."""
    if dataset is None or isinstance(dataset, LossMaskedDataset) \
            or not any(_sidecar_of(d) for d in _gpt_datasets(dataset)):
        return dataset
    return LossMaskedDataset(dataset)
