"""A tokenizer's own chat template (Llama, Qwen: no harmony tokens), with the trained spans marked.

The template is rendered as text prefix by prefix, so it needs no ``{% generation %}`` markers: the
span of message i is what rendering messages [0, i] adds to rendering [0, i) (for an assistant
message, [0, i) with the generation prompt, so the prompt's own header is not trained and what the
model writes after it is: the content and the template's end of turn, e.g. ``<|eot_id|>`` or
``<|im_end|>``). Each prefix's text must begin the whole conversation's text; a template that
renders earlier turns differently once later ones exist (Qwen3 drops earlier turns' reasoning)
breaks that and is refused for that conversation (one line). Messages are handed to the template
as read (their ``reasoning_content`` / ``tool_calls`` keys are the template's business). Channels
and ``loss_header`` are harmony's and do not apply here.

Message text never becomes a control token. The rendered text must be tokenized with special-token
matching on (the template's own ``<|im_start|>`` is one token), so a content holding such a spelling
would turn into a real turn marker. Before rendering, each special-token spelling inside the
messages' strings is swapped for one private-use character (``_hide``); the template renders those
like any text; the text is then cut at them: the template's text around them is encoded with its
special tokens, each hidden spelling is put back as a piece of plain text (``Piece.template`` false:
encoded with special tokens split). So the template's structure stays the template's, and a
spelling from the data is ordinary text tokens wherever the template puts it (content, tool-call
arguments through ``tojson``). The swap is checked: the text with the spellings put back must equal
the template's rendering of the messages as read, else the conversation is refused (a template that
transforms the text it is given around those characters).
"""

from __future__ import annotations

import re

from megatron_kd.data.conversation import ChatDataError, MaskSettings, Message
from megatron_kd.data.harmony import Piece

_HIDDEN = 0xF0000  # Supplementary Private Use Area-A: the i-th special spelling in the data renders as chr(_HIDDEN + i)


def _hide(raws: list, specials: list[str]) -> tuple[list, dict[str, str]]:
    """``raws`` with every special-token spelling inside their strings replaced by one private-use
    character; {character: spelling} of those used."""
    if not specials:
        return raws, {}
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    marks = {t: chr(_HIDDEN + i) for i, t in enumerate(specials)}
    reserved = re.compile(f"[{chr(_HIDDEN)}-{chr(_HIDDEN + len(specials) - 1)}]")
    used: dict[str, str] = {}

    def swap(match):
        used[marks[match.group(0)]] = match.group(0)
        return marks[match.group(0)]

    def walk(value):
        if isinstance(value, str):
            if reserved.search(value):
                raise ChatDataError(f"a message holds the private-use character U+{ord(reserved.search(value)[0]):X}, "
                                    f"which rendering reserves; remove it from the data")
            return pattern.sub(swap, value)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    hidden = walk(raws)
    return (hidden, used) if used else (raws, {})


def template_pieces(messages: list[Message], settings: MaskSettings, render, specials=()) -> list[Piece]:
    """``render(raw_messages, add_generation_prompt) -> str``: the tokenizer's template as text;
    ``specials``: the spellings of the tokenizer's control tokens, kept as plain text in the data."""
    raws, hidden = _hide([m.raw for m in messages], list(specials))
    full = render(raws, False)
    if hidden:
        restored = re.sub(f"[{''.join(hidden)}]", lambda m: hidden[m.group(0)], full)
        if restored != render([m.raw for m in messages], False):
            raise ChatDataError(f"the chat template changes the text around {', '.join(map(repr, hidden.values()))} "
                                f"in a message, so that spelling cannot be kept as plain text; remove it from the data")
    pieces, cursor = [], 0
    for i, m in enumerate(messages):
        if m.role not in settings.loss_roles:
            continue
        generation_prompt = m.role == "assistant"
        start = render(raws[:i], generation_prompt) if i or generation_prompt else ""
        end = render(raws[:i + 1], False)
        if not (full.startswith(end) and end.startswith(start)) or len(start) < cursor:
            raise ChatDataError(f"the tokenizer's chat template does not render messages 0..{i} as the beginning of "
                                f"the whole conversation, so message {i}'s tokens cannot be told apart (a template "
                                f"that rewrites earlier turns); render it with a template that does, or split the "
                                f"conversation")
        pieces += [Piece(full[cursor:len(start)], False, False), Piece(full[len(start):len(end)], False, True)]
        cursor = len(end)
    pieces.append(Piece(full[cursor:], False, False))
    return [q for p in pieces if p.text for q in _split(p, hidden)]


def _split(piece: Piece, hidden: dict[str, str]) -> list[Piece]:
    """The rendered text of ``piece`` as the template's own text and the data's special spellings (plain text)."""
    if not hidden:
        return [Piece(piece.text, False, piece.loss, template=True)]
    parts = re.split(f"([{''.join(hidden)}])", piece.text)
    return [Piece(hidden.get(t, t), False, piece.loss, template=t not in hidden) for t in parts if t]
