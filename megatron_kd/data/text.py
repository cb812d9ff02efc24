"""``megatron-kd data text``: plain text documents (JSONL) -> a Megatron indexed dataset, what
Megatron-LM's ``tools/preprocess_data.py`` does (that tool is not in the megatron-core package).

    megatron-kd data text --input docs.jsonl [--input more.jsonl ...] --output PREFIX [--json-key text] \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR [--append-eod | --no-append-eod] \\
        [--overwrite]

Each line of each input, in order, is one document: a JSON object whose ``--json-key`` (default
``text``, as Megatron-LM's ``--json-keys text``) holds its text. Blank lines are skipped, and so is a
document whose text gives no token (an empty string). Output:

- ``PREFIX.bin`` / ``PREFIX.idx``: the tokens, one document per line (megatron-core's
  ``IndexedDatasetBuilder``; uint16 when the vocabulary fits, else int32, as ``data chat``), what
  ``--data-path PREFIX`` reads. The text is encoded without the special tokens the tokenizer adds
  itself (no BOS); the tokenizer's EOD ends each document unless ``--no-append-eod`` (Megatron-LM's
  ``--append-eod``), so ``--reset-attention-mask`` finds the documents' boundaries.
- ``PREFIX_text.json``: the inputs, the key, the counts and the tokenizer's fingerprint; written last.

Bad input is one line naming the file and line, exit status 2: a line that is not JSON, a line
without the key or whose value is not a string, text that is not UTF-8, an unreadable input, inputs
with no document at all; an ``--output`` that is a directory, lies under a file or in a directory
that cannot be written; files already at ``--output`` without ``--overwrite``. Everything is written
under temporary names beside ``--output`` and moved into place only once every input was read
(``chat.OutputFiles``): a failed or interrupted run leaves what was there untouched, and with
``--overwrite`` the old files are replaced at the very end, the sidecar last. One document is in
memory at a time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megatron_kd.data.chat import OutputFiles, _hf, token_dtype
from megatron_kd.data.jsonl import json_lines
from megatron_kd.errors import FlagError, UserError

SIDECAR_FORMAT = "megatron-kd text v1"


class TextDataError(UserError):
    """A line of the input that is not a document (not JSON, no text under the key, not UTF-8)."""


def sidecar_path(prefix) -> Path:
    return Path(f"{prefix}_text.json")


def text_files(prefix) -> list[Path]:
    """What ``data text`` writes at ``prefix``, the sidecar last."""
    return [Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), sidecar_path(prefix)]


def text_encoder(tokenizer):
    """text -> token ids, without the special tokens a Hugging Face tokenizer adds itself (as
    ``data chat``'s ``PieceEncoder.text``); no warning about documents longer than the model's context."""
    hf = _hf(tokenizer)
    if hf is not None:
        return lambda text: list(hf.encode(text, add_special_tokens=False, verbose=False))
    return lambda text: list(tokenizer.tokenize(text))


def documents(paths, json_key: str = "text", progress=None):
    """The text of each document of the JSONL files, in order, streamed; errors name FILE:LINE.
    ``progress(n)`` is called with the bytes of each line read."""
    for path in map(Path, paths):
        for where, value in json_lines(path, TextDataError, progress):
            if not isinstance(value, dict) or json_key not in value:
                what = "an object" if isinstance(value, dict) else f"a JSON {type(value).__name__}"
                raise TextDataError(f"{where}: no {json_key!r} key (the line is {what}; --json-key names the "
                                    f"text's key)")
            text = value[json_key]
            if not isinstance(text, str):
                raise TextDataError(f"{where}: {json_key!r} is {type(text).__name__}, expected a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TextDataError(f"{where}: {json_key!r} is not UTF-8 text ({e.reason})") from None
            yield text


def build_text_dataset(inputs, output_prefix, tokenizer, *, json_key: str = "text", append_eod: bool = True,
                       progress: bool | None = None, overwrite: bool = False) -> dict:
    """Tokenize every document of ``inputs`` (JSONL files, in order) into ``output_prefix``.bin/.idx and
    write the sidecar; returns its content plus ``seconds``. ``TextDataError`` ("FILE:LINE: ...") for a
    line that is not a document. Everything is written under temporary names and moved into place at
    the end (``OutputFiles``): a failed run leaves what was at ``output_prefix`` as it was; existing
    files there are refused unless ``overwrite``. ``progress``: a tqdm bar on stderr (None: on a
    terminal only)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    from megatron_kd.megatron.data import tokenizer_fingerprint

    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise FlagError("data text needs at least one --input")
    total = 0
    for path in inputs:  # every input readable before any work
        try:
            path.open("rb").close()
        except OSError as e:
            raise TextDataError(f"--input {path}: cannot read it ({e.strerror})") from None
        total += path.stat().st_size
    eod = tokenizer.eod if append_eod else None
    if append_eod and eod is None:
        raise FlagError("the tokenizer has no EOD token to append (its eos_token); pass --no-append-eod")
    encode = text_encoder(tokenizer)
    prefix = Path(output_prefix)
    bin_file, idx_file, sidecar_file = text_files(prefix)
    dtype = token_dtype(tokenizer)
    with OutputFiles(prefix, text_files(prefix), overwrite=overwrite) as out:
        builder = IndexedDatasetBuilder(out[bin_file], dtype=dtype)
        n_documents = n_tokens = empty = 0
        start = time.perf_counter()
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"data text {prefix.name}",
                   disable=None if progress is None else not progress)
        try:
            for text in documents(inputs, json_key, progress=bar.update):
                ids = encode(text)
                if not ids:
                    empty += 1
                    continue
                if eod is not None:
                    ids.append(int(eod))
                builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                n_documents, n_tokens = n_documents + 1, n_tokens + len(ids)
                bar.set_postfix(documents=n_documents, tokens=n_tokens, refresh=False)
            if not n_documents:
                raise TextDataError(f"--input {', '.join(map(str, inputs))}: no document in it"
                                    + (f" ({empty} empty)" if empty else ""))
        except BaseException:
            bar.close()
            builder.data_file.close()
            raise
        bar.close()
        builder.finalize(out[idx_file])
        sidecar = {
            "format": SIDECAR_FORMAT, "inputs": [str(p) for p in inputs], "json_key": json_key,
            "append_eod": append_eod, "eod": None if eod is None else int(eod), "dtype": dtype.__name__,
            "documents": n_documents, "tokens": n_tokens, "empty_skipped": empty,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        }
        Path(out[sidecar_file]).write_text(json.dumps(sidecar, indent=2) + "\n")
        out.commit()
    return {**sidecar, "seconds": time.perf_counter() - start}
