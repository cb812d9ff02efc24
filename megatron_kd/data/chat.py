"""``megatron-kd data chat``: OpenAI-style conversations (JSONL) -> a Megatron indexed dataset with a
per-token loss mask beside it.

    megatron-kd data chat --input conversations.jsonl --output PREFIX \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        [--seq-length N --overlong truncate|refuse] [--loss-roles assistant] \\
        [--loss-channels analysis,commentary,final] [--loss-header generated|none] [--renderer auto]

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

Bad input is one line naming the file and line, exit status 2: a line that is not JSON, an unknown
role, an empty assistant turn, a conversation longer than ``--seq-length`` under ``--overlong
refuse``, a conversation whose mask selects no token.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from megatron_kd.data.conversation import ChatDataError, MaskSettings, parse_messages
from megatron_kd.data.harmony import SPECIAL_TOKENS, Piece, harmony_pieces
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


class PieceEncoder:
    """Pieces -> (token ids, loss mask): special tokens by their id, runs of text with the same loss
    as one string through the tokenizer, without the special tokens it adds itself (a BOS)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.hf = tokenizer, _hf(tokenizer)
        self.ids = token_ids(tokenizer)

    def text(self, text: str) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=False))
        return list(self.tokenizer.tokenize(text))

    def __call__(self, pieces: list[Piece]) -> tuple[list[int], list[int]]:
        ids, mask, run, run_loss = [], [], [], False

        def flush():
            if run:
                tokens = self.text("".join(run))
                ids.extend(tokens)
                mask.extend([int(run_loss)] * len(tokens))
                run.clear()

        for piece in pieces:
            if piece.special:
                flush()
                ids.append(self.ids[piece.text])
                mask.append(int(piece.loss))
            else:
                if run and piece.loss != run_loss:
                    flush()
                run.append(piece.text)
                run_loss = piece.loss
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
        if self.renderer == "template":
            self._render = lambda raws, prompt: hf.apply_chat_template(raws, chat_template=template, tokenize=False,
                                                                       add_generation_prompt=prompt)

    def __call__(self, line: object) -> tuple[list[int], list[int], bool]:
        """(ids, mask, truncated)."""
        messages = parse_messages(line)
        if self.renderer == "harmony":
            pieces = harmony_pieces(messages, self.settings)
        else:
            pieces = template_pieces(messages, self.settings, self._render)
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
    try:
        handle = input_path.open(encoding="utf-8")
    except OSError as e:
        raise UserError(f"--input {input_path}: cannot read it ({e.strerror})") from None
    with handle:
        number = 0
        try:
            for number, text in enumerate(handle, 1):
                if not text.strip():
                    continue
                where = f"{input_path}:{number}"
                try:
                    line = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ChatDataError(f"{where}: not a JSON line ({e.msg} at column {e.colno})") from None
                try:
                    yield render(line)
                except ChatDataError as e:
                    raise ChatDataError(f"{where}: {e}") from None
        except UnicodeDecodeError as e:
            raise ChatDataError(f"{input_path}:{number + 1}: not UTF-8 ({e.reason})") from None


def build_chat_dataset(input_path, output_prefix, tokenizer, settings: MaskSettings, *,
                       renderer: str = "auto") -> dict:
    """Render every conversation of ``input_path`` and write the token dataset, the loss-mask dataset
    and the sidecar at ``output_prefix``, streaming (one conversation in memory at a time); returns
    the sidecar's content. ``ChatDataError`` (one line, "FILE:LINE: ...") for a line that cannot be
    rendered; the files begun are removed then, and the sidecar is written last."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_kd.megatron.data import tokenizer_fingerprint

    render = ConversationRenderer(tokenizer, settings, renderer)
    input_path, prefix = Path(input_path), Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    sidecar_path(prefix).unlink(missing_ok=True)  # no sidecar describes half-written files
    files = [Path(f"{p}.{ext}") for p in (prefix, mask_prefix(prefix)) for ext in ("bin", "idx")]
    tokens = IndexedDatasetBuilder(f"{prefix}.bin", dtype=token_dtype(tokenizer))
    masks = IndexedDatasetBuilder(f"{mask_prefix(prefix)}.bin", dtype=np.uint8)
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
        for file in files:
            file.unlink(missing_ok=True)
        raise
    tokens.finalize(f"{prefix}.idx")
    masks.finalize(f"{mask_prefix(prefix)}.idx")
    sidecar = {
        "format": SIDECAR_FORMAT, "renderer": render.renderer, "settings": settings.to_json(),
        "mask": f"{render.renderer} {settings.describe()}", "loss_mask": mask_prefix(prefix).name,
        "documents": documents, "tokens": n_tokens, "loss_tokens": n_loss, "truncated": truncated,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "mask_sha256": mask_hash.hexdigest(),
    }
    sidecar["fingerprint"] = digest({"renderer": render.renderer, "settings": settings.to_json(),
                                     "mask_sha256": sidecar["mask_sha256"]})
    sidecar_path(prefix).write_text(json.dumps(sidecar, indent=2) + "\n")
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
