"""Root metadata of a teacher cache: what was captured, how it is laid out and encoded.

Stored as the ``megatron_kd`` attribute of the store's root group (zarr.json). Everything in it is
deterministic, so a resumed build ends with the same bytes as an uninterrupted one.

``store_id`` names the store: the first 32 hex digits of the SHA-256 of the canonical JSON of every
field but ``complete`` (what was captured, from which teacher, tokenizer and dataset, how it is laid
out and encoded). Every shard's binding record (binding.py) carries it, so a shard copied with its
record from a cache of another teacher, dataset or shape names another store. It is derived, not
random: two builds with the same parameters are the same store, byte for byte, and a resumed build
stays identical to an uninterrupted one. The stored value is checked against the recomputed one on
open.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from megatron_kd.cache.codec import CacheError
from megatron_kd.cache.encodings import CODECS, SAMPLED_COUNTS_V1, TOPK_V1, codec_of, encoding_field
from megatron_kd.cache.layout import PartitionLayout

# 2: shard binding records and store_id; 3: each row's token digests in its record (tokens.py).
# A store of an older version is refused with what it lacks.
SCHEMA_VERSION = 3
_LACKS = {1: "no chunk binding (a shard moved or copied from another cache reads as this one's)",
          2: "no digests of the tokens its teacher read (rows cannot be bound to a run's samples)"}
ATTR_KEY = "megatron_kd"
MODES = ("topk", "sampled")
# How the teacher saw the documents packed into a sample: apart ("documents": Megatron-LM's
# --reset-attention-mask), positions restarting per document ("positions": --reset-position-ids),
# both, or neither.
PACKING_MODES = ("none", "documents", "positions", "documents+positions")
FINGERPRINTS = ("teacher_fingerprint", "tokenizer_fingerprint", "dataset_fingerprint")
# Keys a writer's ``metadata`` may set; anything else belongs under "extra".
METADATA_KEYS = ("temperature", "mode", "sampled_draws", "packing", "loss_mask", *FINGERPRINTS, "extra")
# The fields of a non-empty ``loss_mask`` (megatron_kd.megatron.loss_mask.loss_mask_field)
LOSS_MASK_KEYS = ("mask", "fingerprint")
# Draw counts of sampled-counts-v1 are uint16.
MAX_SAMPLED_DRAWS = (1 << 16) - 1
# Integer fields and their smallest valid value.
_COUNTS = {"vocab_size": 1, "topk": 1, "seq_length": 1, "num_samples": 0, "dp_size": 1, "micro_batch_size": 1,
           "rows_per_shard": 1, "sampled_draws": 0}


@dataclass
class CacheMeta:
    vocab_size: int
    """Teacher vocabulary size; every cached id is below it."""
    topk: int
    """Entries per token (K)."""
    seq_length: int
    """Tokens per sample."""
    num_samples: int
    """Samples in the store (global sample indices 0 .. num_samples-1)."""
    dp_size: int
    """Data-parallel size of the capture: one partition per rank."""
    micro_batch_size: int
    """Micro-batch size of the capture (sets which samples each partition holds)."""
    rows_per_shard: int
    """Samples per shard file."""
    temperature: float = 1.0
    """Temperature at which the teacher's log-probabilities were taken."""
    mode: Literal["topk", "sampled"] = "topk"
    """"topk": the K most likely ids; "sampled": ids drawn from the teacher, log(count / draws)."""
    sampled_draws: int = 0
    """Draws per token in sampled mode (0 in top-K mode)."""
    packing: str = "none"
    """How the teacher saw the documents packed into a sample (one of ``PACKING_MODES``; the flags
    that ask for each are ``megatron_kd.megatron.packing``'s); a student must pack alike."""
    loss_mask: dict = field(default_factory=dict)
    """The per-token loss mask of the data (chat data, ``megatron-kd data chat``): {} when every token
    is trained, else {"mask": its settings, "fingerprint": its digest}. The teacher pass then stores
    entries only at the positions the mask keeps (the others are all padding, which the entropy-coded
    codecs store as one count per token), and a student must train under the same mask."""
    teacher_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    dataset_fingerprint: str = ""
    extra: dict = field(default_factory=dict)
    """Free-form, JSON-serializable (e.g. the teacher's arguments); compared on resume."""
    schema_version: int = SCHEMA_VERSION
    encoding: dict = field(default_factory=lambda: encoding_field(TOPK_V1))
    """How ids and log-probs are stored: topk-v1's dict, or {"codec": name} (encodings.py)."""
    complete: bool = False
    """Completion record: every partition holds every one of its samples."""

    @property
    def codec(self) -> str:
        """The codec ``encoding`` names (checked on open: a store naming none this version reads is refused)."""
        return codec_of(self.encoding)

    @property
    def layout(self) -> PartitionLayout:
        return PartitionLayout(self.num_samples, self.dp_size, self.micro_batch_size)

    def partitions(self) -> list[dict]:
        """Per-partition sample ranges (rows, first and last global sample)."""
        out = []
        for rank in range(self.dp_size):
            samples = self.layout.samples_of(rank)
            out.append({"rank": rank, "rows": len(samples),
                        "first_sample": int(samples[0]) if len(samples) else None,
                        "last_sample": int(samples[-1]) if len(samples) else None})
        return out

    def identity(self) -> dict:
        """Every field that says what the store holds: all but the completion record. Temperature
        as a float, so 1 and 1.0 (equal, hence accepted on resume) name the same store."""
        ident = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "complete"}
        if isinstance(ident["temperature"], int) and not isinstance(ident["temperature"], bool):
            ident["temperature"] = float(ident["temperature"])
        if ident["packing"] == "none":  # stores built before packing was recorded keep their store_id
            del ident["packing"]
        if not ident["loss_mask"]:  # likewise stores without a loss mask
            del ident["loss_mask"]
        return ident

    @property
    def store_id(self) -> str:
        try:
            canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                   allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CacheError(f"cache metadata is not plain JSON ({e}); 'extra' must hold JSON values only") from None
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:32]

    def to_attrs(self) -> dict:
        attrs = asdict(self)
        if attrs["packing"] == "none":  # absent means unpacked: stores of before are written as they were
            del attrs["packing"]
        if not attrs["loss_mask"]:  # absent means every token: likewise
            del attrs["loss_mask"]
        attrs["partitions"] = self.partitions()
        attrs["store_id"] = self.store_id
        return attrs

    @classmethod
    def from_attrs(cls, attrs: dict, *, path: str) -> "CacheMeta":
        """The metadata in ``attrs`` (the root zarr.json's, ``path`` names that file), every field's
        type and range checked: CacheError naming the field and what was expected."""
        version = attrs.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CacheError(f"{path}: no {ATTR_KEY}.schema_version; not a megatron_kd cache")
        if version > SCHEMA_VERSION:
            raise CacheError(f"{path}: written by a newer megatron_kd (schema_version {version} > "
                             f"{SCHEMA_VERSION} supported); upgrade megatron_kd to read it")
        if version < SCHEMA_VERSION:
            raise CacheError(f"{path}: {ATTR_KEY}.schema_version is {version}, expected {SCHEMA_VERSION}: schema_version "
                             f"{version} has {_LACKS.get(version, _LACKS[1])}; rebuild the cache with this megatron_kd")
        names = {f.name for f in fields(cls)}
        missing = [n for n in _COUNTS if n not in attrs and n != "sampled_draws"]
        if missing:
            raise CacheError(f"{path}: {ATTR_KEY} lacks field(s) {missing}")
        meta = cls(**{k: v for k, v in attrs.items() if k in names})
        meta._check(path)
        if "partitions" in attrs and attrs["partitions"] != meta.partitions():
            raise CacheError(f"{path}: {ATTR_KEY}.partitions is {attrs['partitions']!r}, expected "
                             f"{meta.partitions()!r} (from num_samples, dp_size, micro_batch_size)")
        if attrs.get("store_id") != meta.store_id:
            raise CacheError(f"{path}: {ATTR_KEY}.store_id is {attrs.get('store_id')!r}, expected {meta.store_id!r} "
                             f"(the digest of the other fields: one of them was changed after the build)")
        return meta

    def _check(self, path: str) -> None:
        def bad(name: str, expected: str):
            raise CacheError(f"{path}: {ATTR_KEY}.{name} is {getattr(self, name)!r}, expected {expected}")

        for name, low in _COUNTS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                bad(name, f"an integer >= {low}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
            bad("temperature", "a positive number")
        if self.mode not in MODES:
            bad("mode", f"one of {MODES}")
        if self.packing not in PACKING_MODES:
            bad("packing", f"one of {PACKING_MODES}")
        for name in FINGERPRINTS:
            if not isinstance(getattr(self, name), str):
                bad(name, "a string")
        if not isinstance(self.extra, dict):
            bad("extra", "an object")
        if not isinstance(self.loss_mask, dict) or (self.loss_mask and (
                sorted(self.loss_mask) != sorted(LOSS_MASK_KEYS)
                or not all(isinstance(v, str) for v in self.loss_mask.values()))):
            bad("loss_mask", f"{{}} or an object of strings {', '.join(LOSS_MASK_KEYS)}")
        if not isinstance(self.complete, bool):
            bad("complete", "true or false")
        if codec_of(self.encoding) is None:
            named = self.encoding.get("codec") if isinstance(self.encoding, dict) else None
            if named is not None:
                raise CacheError(f"{path}: {ATTR_KEY}.encoding.codec is {named!r}, not a codec this megatron_kd reads "
                                 f"({', '.join(CODECS)}); written by a newer megatron_kd? upgrade it to read this cache")
            bad("encoding", f"topk-v1's {encoding_field(TOPK_V1)!r} or {{'codec': NAME}} with NAME one of {CODECS[1:]}")
        if self.codec == SAMPLED_COUNTS_V1 and (self.mode != "sampled" or not 1 <= self.sampled_draws <= MAX_SAMPLED_DRAWS):
            raise CacheError(f"{path}: {ATTR_KEY}.encoding.codec {SAMPLED_COUNTS_V1!r} stores draw counts: it needs mode "
                             f"'sampled' and sampled_draws in 1..{MAX_SAMPLED_DRAWS}, got mode {self.mode!r}, "
                             f"sampled_draws {self.sampled_draws!r}")

    def mismatches(self, other: "CacheMeta") -> list[tuple[str, object, object]]:
        """(field, self value, other value) for every field that differs, completion excluded."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
                if f.name != "complete" and getattr(self, f.name) != getattr(other, f.name)]


def check_expected(meta: CacheMeta, expect: dict, *, path: str) -> None:
    """Raise CacheError naming the first field whose stored value differs from ``expect``."""
    names = {f.name for f in fields(CacheMeta)}
    for key, want in expect.items():
        if key not in names:
            raise ValueError(f"unknown cache field {key!r} in expect (known: {sorted(names)})")
        have = getattr(meta, key)
        if have != want:
            raise CacheError(f"{path}: cache {key} is {have!r}, expected {want!r}")
