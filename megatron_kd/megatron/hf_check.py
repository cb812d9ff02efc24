"""Is a ``--kd-student-hf`` / ``--kd-teacher-hf`` directory complete? Checked at the flag check,
before distributed start-up, so a missing or truncated file is one line naming it (not a
FileNotFoundError or SafetensorError traceback from every rank after the model is built).

What is read, cheaply (headers, not tensors):
- ``config.json`` parses as a JSON object with a ``model_type``;
- the weights: every file ``model.safetensors.index.json`` names (or the single
  ``model.safetensors``) exists, its header parses (8-byte little-endian length, then that many
  bytes of JSON: name -> dtype, shape, data_offsets [begin, end) after the header), holds the
  tensors the index assigns to it, and the file is at least 8 + header + the largest end long
  (what a copy cut short fails); PyTorch ``pytorch_model*.bin`` files are checked for presence;
- a tokenizer file (``tokenizer.json``, which must parse, ``tokenizer.model`` or ``vocab.json``)
  when the run takes its tokenizer from the directory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_kd.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# a safetensors header above this is not a header (GPT-OSS 120B's largest is ~0.1 MB)
MAX_HEADER_BYTES = 100 * 2**20


class HFDirError(UserError):
    """A Hugging Face directory given to a flag is missing a file or holds a damaged one."""


def _read_json(path: Path, flag: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFDirError(f"{flag}: {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFDirError(f"{flag}: {path} does not parse as JSON ({e}): truncated or not a JSON file") from None


def safetensors_tensors(path: Path, flag: str) -> set[str]:
    """The tensor names of a safetensors file, after checking its header and length."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or length > min(size - 8, MAX_HEADER_BYTES):
                raise HFDirError(f"{flag}: {path} is truncated or not a safetensors file ({size} bytes, header "
                                 f"length {length})")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise HFDirError(f"{flag}: {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFDirError(f"{flag}: {path}: its safetensors header does not parse ({e})") from None
    if not isinstance(header, dict):
        raise HFDirError(f"{flag}: {path}: its safetensors header is not a JSON object")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    try:
        end = max((int(entry["data_offsets"][1]) for entry in tensors.values()), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise HFDirError(f"{flag}: {path}: a safetensors header entry has no data_offsets [begin, end]") from None
    if 8 + length + end > size:
        raise HFDirError(f"{flag}: {path} is truncated: {size} bytes, its header says {8 + length + end}")
    return set(tensors)


def _check_weights(root: Path, flag: str) -> None:
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, flag).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFDirError(f"{flag}: {index} has no weight_map (tensor name -> file)")
        by_file: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(str(file), set()).add(name)
        for file, names in sorted(by_file.items()):
            missing = names - safetensors_tensors(root / file, flag)
            if missing:
                raise HFDirError(f"{flag}: {root / file} lacks {len(missing)} tensors that {index.name} assigns to it "
                                 f"(e.g. {sorted(missing)[0]})")
        return
    if (root / "model.safetensors").exists():
        safetensors_tensors(root / "model.safetensors", flag)
        return
    bin_index = root / "pytorch_model.bin.index.json"
    if bin_index.exists():
        weight_map = _read_json(bin_index, flag).get("weight_map") or {}
        for file in sorted(set(map(str, weight_map.values()))):
            if not (root / file).is_file():
                raise HFDirError(f"{flag}: {root / file} (named by {bin_index.name}) is missing")
        return
    if not (root / "pytorch_model.bin").is_file():
        raise HFDirError(f"{flag}: {root} has no weights: expected model.safetensors or model.safetensors.index.json")


def check_hf_dir(path: str, flag: str, *, tokenizer: bool) -> None:
    """One ``HFDirError`` line naming the flag and the file, or nothing. ``tokenizer``: the run
    takes its tokenizer from this directory."""
    root = Path(path)
    if not root.is_dir():
        raise HFDirError(f"{flag} {path}: not a directory")
    config = _read_json(root / "config.json", flag)
    if not isinstance(config, dict) or "model_type" not in config:
        raise HFDirError(f"{flag}: {root / 'config.json'} has no model_type (not a Hugging Face model config)")
    _check_weights(root, flag)
    if tokenizer:
        present = [name for name in TOKENIZER_FILES if (root / name).is_file()]
        if not present:
            raise HFDirError(f"{flag}: {root} has no tokenizer ({' or '.join(TOKENIZER_FILES)}), and the run takes its "
                             "tokenizer from there (or give --tokenizer-model)")
        if "tokenizer.json" in present:
            _read_json(root / "tokenizer.json", flag)
