"""``megatron-kd data chat``: OpenAI-style conversations (JSONL) -> a Megatron indexed dataset with a
per-token loss mask beside it.

    megatron-kd data chat --input conversations.jsonl --output PREFIX \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        [--seq-length N --overlong truncate|refuse] [--loss-roles assistant] \\
        [--loss-channels analysis,commentary,final] [--loss-header generated|none] [--renderer auto] \\
        [--overwrite]

Each line is one conversation (``conversation.py`` says what a line may hold), rendered token by
token: in GPT-OSS's harmony format (``harmony.py``) when the tokenizer has harmony's special
tokens, else through the tokenizer's own chat template (``template.py``). Output:

- ``PREFIX.bin`` / ``PREFIX.idx``: the tokens, one document per conversation (megatron-core's
  ``IndexedDatasetBuilder``), what ``--data-path PREFIX`` reads. The tokenizer's EOD token ends
  each document (appended unless the conversation already ends with it: GPT-OSS's EOD is
  ``<|return|>``), so ``--reset-attention-mask`` finds the conversations' boundaries; it carries
  no loss.
- ``PREFIX_loss_mask.bin`` / ``.idx``: a uint8 indexed dataset with the same documents, one byte
  per token: 1 where the token is a target the student learns to predict (its prediction, made at
  the token before it, is kept in the loss), 0 elsewhere.
- ``PREFIX_chat.json``: the renderer, the mask settings, counts, the SHA-256 of the mask bytes and
  the mask's fingerprint (``megatron_kd.megatron.loss_mask`` reads it; the teacher cache records it).

Message text is data, never control: a special token's spelling inside a message (``<|start|>`` in a
user's question) is encoded as ordinary text tokens, so no text can forge a turn or carry loss it
should not.

Bad input is one line naming the file and line, exit status 2: a line that is not JSON or not UTF-8,
an unknown role, a message without content, an empty assistant turn, tool-call arguments that are
not JSON, a tool name with characters other than letters, digits, ``_`` and ``-``, a chat template
that fails, a conversation longer than ``--seq-length`` under ``--overlong refuse``, a conversation
whose mask selects no token.

Nothing at ``--output`` is deleted or overwritten by a failed or interrupted run: every file is
written under a temporary name beside it (``OutputFiles``) and moved into place only once the whole
input was read; existing files there are refused unless ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from megatron_kd.data.conversation import ChatDataError, MaskSettings, parse_messages
from megatron_kd.data.harmony import SPECIAL_TOKENS, Piece, harmony_pieces
from megatron_kd.data.jsonl import json_lines
from megatron_kd.megatron.loss_mask import SIDECAR_FORMAT, digest, mask_prefix, sidecar_path
from megatron_kd.data.template import template_pieces
from megatron_kd.errors import FlagError, UserError

RENDERERS = ("auto", "harmony", "template")


def _hf(tokenizer):
    """The Hugging Face tokenizer a Megatron tokenizer wraps, or None."""
    return getattr(getattr(tokenizer, "_tokenizer", None), "tokenizer", None)


def token_ids(tokenizer) -> dict[str, int]:
    """Token spelling -> id."""
    hf = _hf(tokenizer)
    if hf is not None:
        return dict(hf.get_vocab())
    vocab = getattr(tokenizer, "vocab", None)
    if isinstance(vocab, dict):
        return dict(vocab)
    return {token: int(i) for i, token in dict(getattr(tokenizer, "inv_vocab", {}) or {}).items()}


def control_ids(tokenizer) -> dict[int, str]:
    """The tokenizer's control tokens, id -> spelling: its special tokens (Hugging Face's special added
    tokens, BOS/EOS/PAD...) and harmony's, where it has them. Message text never encodes to these."""
    hf, ids = _hf(tokenizer), token_ids(tokenizer)
    out = {ids[t]: t for t in SPECIAL_TOKENS if t in ids}
    if hf is not None:
        out.update({int(i): t.content for i, t in getattr(hf, "added_tokens_decoder", {}).items() if t.special})
        out.update({int(i): t for i, t in zip(hf.all_special_ids, hf.all_special_tokens)})
    return out


class PieceEncoder:
    """Pieces -> (token ids, loss mask): special tokens by their id, runs of text with the same loss
    as one string through the tokenizer, without the special tokens it adds itself (a BOS).

    Text is encoded with the tokenizer's special-token spellings split as ordinary text
    (``split_special_tokens``), except a chat template's own text (``Piece.template``), whose
    spellings are the template's control tokens; text that still encodes to a control token (a
    tokenizer that cannot split them) is refused."""

    def __init__(self, tokenizer):
        self.tokenizer, self.hf = tokenizer, _hf(tokenizer)
        self.ids = token_ids(tokenizer)
        self.control = control_ids(tokenizer)

    def text(self, text: str, template: bool = False) -> list[int]:
        if self.hf is not None:
            ids = list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=not template))
        else:
            ids = list(self.tokenizer.tokenize(text))
        if not template:
            forged = [self.control[i] for i in ids if i in self.control]
            if forged:
                raise ChatDataError(f"message text holding {forged[0]!r} encodes to that control token with this "
                                    f"tokenizer (it cannot encode the spelling as plain text); remove it from the data")
        return ids

    def __call__(self, pieces: list[Piece]) -> tuple[list[int], list[int]]:
        ids, mask, run, run_key = [], [], [], (False, False)

        def flush():
            if run:
                tokens = self.text("".join(run), template=run_key[1])
                ids.extend(tokens)
                mask.extend([int(run_key[0])] * len(tokens))
                run.clear()

        for piece in pieces:
            if piece.special:
                flush()
                ids.append(self.ids[piece.text])
                mask.append(int(piece.loss))
            else:
                key = (piece.loss, piece.template)
                if run and key != run_key:
                    flush()
                run.append(piece.text)
                run_key = key
        flush()
        return ids, mask


def token_dtype(tokenizer) -> type:
    """The token dataset's dtype: uint16 when every id fits, else int32."""
    return np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def chat_template(tokenizer) -> str | None:
    """The template ``--chat-template`` gave the Megatron tokenizer, else its Hugging Face tokenizer's own."""
    hf = _hf(tokenizer)
    if hf is None:
        return None
    return getattr(tokenizer, "chat_template", None) or getattr(hf, "chat_template", None) or None


def pick_renderer(tokenizer, choice: str) -> str:
    has_harmony = all(t in token_ids(tokenizer) for t in SPECIAL_TOKENS)
    has_template = chat_template(tokenizer) is not None
    if choice == "harmony" and not has_harmony:
        missing = [t for t in SPECIAL_TOKENS if t not in token_ids(tokenizer)]
        raise FlagError(f"--renderer harmony: the tokenizer has no {', '.join(missing)} (harmony's special tokens)")
    if choice == "template" and not has_template:
        raise FlagError("--renderer template: the tokenizer has no chat template (give one with --chat-template)")
    if choice != "auto":
        return choice
    if has_harmony:
        return "harmony"
    if has_template:
        return "template"
    raise FlagError("the tokenizer has neither harmony's special tokens (<|start|>, <|channel|>, <|message|>, ...) nor "
                    "a chat template: pass a GPT-OSS tokenizer, or one with a chat template (--chat-template)")


class ConversationRenderer:
    """One parsed JSONL line -> (token ids, loss mask) of its document, checked against ``settings``."""

    def __init__(self, tokenizer, settings: MaskSettings, renderer: str = "auto"):
        self.settings = settings
        self.renderer = pick_renderer(tokenizer, renderer)
        self.encode = PieceEncoder(tokenizer)
        self.eod = int(tokenizer.eod)
        hf, template = _hf(tokenizer), chat_template(tokenizer)
        self.control = sorted(set(self.encode.control.values()))
        if self.renderer == "template":
            from jinja2 import TemplateError

            # what a template can raise on data: jinja2's sandbox (SecurityError, a range over its limit), the
            # template's own raise_exception, syntax errors, and Python's errors on values it mishandles
            stopped = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                       RecursionError)

            def render(raws, prompt):
                try:
                    return hf.apply_chat_template(raws, chat_template=template, tokenize=False,
                                                  add_generation_prompt=prompt)
                except ChatDataError:
                    raise
                except stopped as e:
                    raise ChatDataError(f"the chat template stopped on this conversation ({type(e).__name__}: "
                                        f"{' '.join(str(e).split())[:300]}); fix the template (--chat-template) or "
                                        f"the conversation") from None
            self._render = render

    def __call__(self, line: object) -> tuple[list[int], list[int], bool]:
        """(ids, mask, truncated)."""
        messages = parse_messages(line)
        if self.renderer == "harmony":
            pieces = harmony_pieces(messages, self.settings)
        else:
            pieces = template_pieces(messages, self.settings, self._render, self.control)
        ids, mask = self.encode(pieces)
        if not ids or ids[-1] != self.eod:  # the document's end, for packed documents; no loss
            ids.append(self.eod)
            mask.append(0)
        if not any(mask):
            raise ChatDataError(f"the loss mask selects no token of this conversation (no message of "
                                f"{self.settings.describe()})")
        limit = self.settings.seq_length
        if limit is None or len(ids) <= limit:
            return ids, mask, False
        if self.settings.overlong == "refuse":
            raise ChatDataError(f"the conversation has {len(ids)} tokens, more than --seq-length {limit} "
                                f"(--overlong truncate keeps its first {limit})")
        ids, mask = ids[:limit], mask[:limit]
        if not any(mask):
            raise ChatDataError(f"cut to --seq-length {limit} tokens (--overlong truncate), the conversation keeps no "
                                f"token of {self.settings.describe()}")
        return ids, mask, True


def _conversations(input_path: Path, render: ConversationRenderer):
    """(ids, mask, truncated) of each conversation of the JSONL file, streamed; errors name FILE:LINE."""
    for where, line in json_lines(input_path, ChatDataError):
        try:
            yield render(line)
        except ChatDataError as e:
            raise ChatDataError(f"{where}: {e}") from None


class OutputFiles:
    """The files a data command writes at ``--output PREFIX``, written under temporary names beside
    them (the same directory, ``.NAME.XXXX.partial``) and moved into place by ``commit()`` only once
    the whole input was read and checked. A run that fails or is interrupted leaves the files that
    were there untouched and removes its temporary files (SIGTERM included; SIGKILL leaves only
    hidden ``.partial`` files). Existing files at the final names are refused unless ``overwrite``; with it
    they are replaced at the very end, each with ``os.replace`` (atomic), the last name (the
    sidecar JSON) last, and the old sidecar removed first, so a dataset without its sidecar is one
    being replaced, never a mix described by an old sidecar.

    Used as a context manager: leaving it without ``commit()`` removes the temporary files."""

    def __init__(self, prefix, finals: list[Path], *, overwrite: bool = False, flag: str = "--output"):
        self.finals = [Path(f) for f in finals]
        self.parent = check_output(prefix, self.finals, overwrite=overwrite, flag=flag)
        where = f"{flag} {prefix}"
        missing, ancestor = [], self.parent
        while not ancestor.exists():
            missing.append(ancestor)
            ancestor = ancestor.parent
        self.created, self.temps = [], {}
        try:
            for directory in reversed(missing):
                directory.mkdir()
                self.created.append(directory)
            for final in self.finals:
                fd, temp = tempfile.mkstemp(dir=self.parent, prefix=f".{final.name}.", suffix=".partial")
                os.close(fd)
                self.temps[final] = Path(temp)
        except OSError as e:
            self.abort()
            raise FlagError(f"{where}: cannot write in {e.filename or self.parent} ({e.strerror}); expected a "
                            f"writable directory") from None
        self.overwrite, self.committed = overwrite, False

    def __getitem__(self, final) -> str:
        """The temporary path to write ``final`` to."""
        return str(self.temps[Path(final)])

    def commit(self):
        mode = 0o666 & ~_umask()
        *data, sidecar = self.finals
        try:
            for final in self.finals:
                os.chmod(self.temps[final], mode)  # mkstemp's 0600 -> what open() would have made
            if self.overwrite:
                sidecar.unlink(missing_ok=True)
            for final in (*data, sidecar):
                os.replace(self.temps.pop(final), final)
        except BaseException:
            self.abort()
            raise
        self.committed = True

    def abort(self):
        for temp in self.temps.values():
            temp.unlink(missing_ok=True)
        self.temps.clear()
        for directory in reversed(self.created):
            try:
                directory.rmdir()
            except OSError:
                break
        self.created.clear()

    def __enter__(self):
        # a plain ``kill`` (SIGTERM) unwinds like Ctrl-C, so the temporary files are removed; only SIGKILL
        # leaves them (hidden, beside the untouched old files)
        self._sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(self, *exc):
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        if not self.committed:
            self.abort()
        return False


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output(prefix, finals, *, overwrite: bool = False, flag: str = "--output") -> Path:
    """The directory ``prefix``'s files go to, after checking (one line each) that the prefix is not a
    directory, that no file stands where a directory must be, that the directory is writable and that
    none of ``finals`` exists (unless ``overwrite``). Nothing is created."""
    raw = str(prefix)
    prefix = Path(prefix)
    where = f"{flag} {raw}"
    if raw.endswith(("/", os.sep)) or prefix.is_dir():
        raise FlagError(f"{where}: is a directory; expected a file prefix, e.g. {prefix / 'NAME'} (writes "
                        f"NAME.bin, NAME.idx, ... in it)")
    parent = prefix.parent
    ancestor = parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FlagError(f"{where}: {ancestor} is a file, expected a directory to write the dataset in")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise FlagError(f"{where}: cannot write in {ancestor} (permission denied); expected a writable directory")
    finals = [Path(f) for f in finals]
    directories = [str(f) for f in finals if f.is_dir()]
    if directories:
        raise FlagError(f"{where}: {directories[0]} is a directory, expected the dataset's file there")
    existing = [str(f) for f in finals if f.exists() or f.is_symlink()]
    if existing and not overwrite:
        raise FlagError(f"{where}: {', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass "
                        f"--overwrite to replace them once the new dataset is complete, or choose another prefix")
    return parent


def chat_files(prefix) -> list[Path]:
    """What ``data chat`` writes at ``prefix``, the sidecar last."""
    prefix = Path(prefix)
    data = [Path(f"{p}.{ext}") for p in (prefix, mask_prefix(prefix)) for ext in ("bin", "idx")]
    return data + [sidecar_path(prefix)]


def build_chat_dataset(input_path, output_prefix, tokenizer, settings: MaskSettings, *,
                       renderer: str = "auto", overwrite: bool = False) -> dict:
    """Render every conversation of ``input_path`` and write the token dataset, the loss-mask dataset
    and the sidecar at ``output_prefix``, streaming (one conversation in memory at a time); returns
    the sidecar's content. ``ChatDataError`` (one line, "FILE:LINE: ...") for a line that cannot be
    rendered. Everything is written under temporary names and moved into place at the end
    (``OutputFiles``): a failed run leaves what was at ``output_prefix`` as it was; existing files
    there are refused unless ``overwrite``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_kd.megatron.data import tokenizer_fingerprint

    render = ConversationRenderer(tokenizer, settings, renderer)
    input_path, prefix = Path(input_path), Path(output_prefix)
    try:
        input_path.open("rb").close()
    except OSError as e:
        raise UserError(f"--input {input_path}: cannot read it ({e.strerror})") from None
    tokens_bin, tokens_idx, mask_bin, mask_idx, sidecar_file = chat_files(prefix)
    with OutputFiles(prefix, chat_files(prefix), overwrite=overwrite) as out:
        tokens = IndexedDatasetBuilder(out[tokens_bin], dtype=token_dtype(tokenizer))
        masks = IndexedDatasetBuilder(out[mask_bin], dtype=np.uint8)
        mask_hash = hashlib.sha256()
        documents = n_tokens = n_loss = truncated = 0
        try:
            for ids, mask, cut in _conversations(input_path, render):
                tokens.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                mask_bytes = np.asarray(mask, dtype=np.uint8)
                masks.add_document(torch.from_numpy(mask_bytes.astype(np.int64)), [len(mask)])
                mask_hash.update(mask_bytes.tobytes())
                documents, n_tokens, n_loss, truncated = documents + 1, n_tokens + len(ids), n_loss + sum(mask), \
                    truncated + cut
            if not documents:
                raise ChatDataError(f"--input {input_path}: no conversation in it")
        except BaseException:
            for builder in (tokens, masks):
                builder.data_file.close()
            raise
        tokens.finalize(out[tokens_idx])
        masks.finalize(out[mask_idx])
        sidecar = {
            "format": SIDECAR_FORMAT, "renderer": render.renderer, "settings": settings.to_json(),
            "mask": f"{render.renderer} {settings.describe()}", "loss_mask": mask_prefix(prefix).name,
            "documents": documents, "tokens": n_tokens, "loss_tokens": n_loss, "truncated": truncated,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "mask_sha256": mask_hash.hexdigest(),
        }
        sidecar["fingerprint"] = digest({"renderer": render.renderer, "settings": settings.to_json(),
                                         "mask_sha256": sidecar["mask_sha256"]})
        Path(out[sidecar_file]).write_text(json.dumps(sidecar, indent=2) + "\n")
        out.commit()
    return sidecar


def build_tokenizer(args, command: str = "data chat"):
    """The Megatron tokenizer that ``--tokenizer-*`` flags name, as ``train`` builds it."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer

    if args.tokenizer_type is None:
        raise FlagError(f"{command} needs --tokenizer-type (and --tokenizer-model DIR), as train gets them")
    args.pad_vocab_size = False  # the dataset holds token ids; the vocabulary padding is the model's
    try:
        return megatron_build_tokenizer(args)
    except (OSError, ValueError) as e:
        raise FlagError(f"--tokenizer-type {args.tokenizer_type} --tokenizer-model {args.tokenizer_model}: cannot "
                        f"load the tokenizer ({' '.join(str(e).split())[:300]})") from None
