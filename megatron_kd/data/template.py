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
"""

from __future__ import annotations

from megatron_kd.data.conversation import ChatDataError, MaskSettings, Message
from megatron_kd.data.harmony import Piece


def template_pieces(messages: list[Message], settings: MaskSettings, render) -> list[Piece]:
    """``render(raw_messages, add_generation_prompt) -> str``: the tokenizer's template as text."""
    raws = [m.raw for m in messages]
    full = render(raws, False)
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
    return [p for p in pieces if p.text]
