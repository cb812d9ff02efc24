"""Tiny offline tokenizers for the chat-data tests: one character per token, plus either harmony's
special tokens (a GPT-OSS-like tokenizer, EOD = <|return|> as GPT-OSS's) or a ChatML chat template."""

from __future__ import annotations

import json
from pathlib import Path

HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                    "<|constrain|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tokenizer(directory: Path, specials: list[str], *, eos: str, chat_template: str | None = None) -> Path:
    """A character-level Hugging Face tokenizer directory (WordLevel over printable ASCII and newline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   additional_special_tokens=specials)
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return directory


def megatron_tokenizer(directory: Path):
    """The Megatron tokenizer ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` builds."""
    from megatron_kd.commands.data_chat import chat_parser
    from megatron_kd.data.chat import build_tokenizer

    args = chat_parser().parse_args(["--input", "-", "--output", "-", "--tokenizer-type", "HuggingFaceTokenizer",
                                     "--tokenizer-model", str(directory)])
    return build_tokenizer(args)


def write_jsonl(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


def marked(tokenizer, ids, mask) -> str:
    """The tokens as text with [...] around each run that carries loss: what the tests compare."""
    hf = tokenizer._tokenizer.tokenizer
    out, inside = [], False
    for token, m in zip(hf.convert_ids_to_tokens([int(i) for i in ids]), mask):
        if m and not inside:
            out.append("[")
        if not m and inside:
            out.append("]")
        inside = bool(m)
        out.append(token)
    return "".join(out) + ("]" if inside else "")
