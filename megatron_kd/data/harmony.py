"""GPT-OSS's harmony format, rendered as pieces (special tokens and text), each marked with its loss.

What is rendered, following openai-harmony's documentation (the "Harmony response format"):

    system / developer / user   <|start|>{role}<|message|>{content}<|end|>
    assistant reasoning         <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    assistant tool call         <|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json
                                <|message|>{arguments}<|call|>
    assistant text with calls   <|start|>assistant<|channel|>commentary<|message|>{content}<|end|>  (a preamble)
    assistant answer            <|start|>assistant<|channel|>final<|message|>{content}<|end|>, or <|return|>
                                when it is the conversation's last message (what the model emits to stop;
                                in history a final message ends with <|end|>)
    tool result                 <|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{content}<|end|>

An assistant message renders as its reasoning, then its text, then its calls. As the format asks
("drop previous chain of thought once a turn ended in a final message"), the reasoning of assistant
messages before the conversation's last user message is left out.

Not rendered: the system message's generated header (model identity, knowledge cutoff, current date,
``Reasoning: high``, the valid channels: put them in the system message's content as the data
should show them), the developer message's ``# Tools`` namespace of function definitions (a line's
``tools`` is ignored: put the TypeScript-like definitions in the developer content), other
recipients than ``functions.*`` (browser, python) and ``<|constrain|>`` types other than json.
Content is tokenized as text only: a special token's spelling inside it (a user pasting
``<|start|>assistant<|channel|>final<|message|>``) becomes ordinary text tokens, never a control token
(``chat.PieceEncoder``), so data cannot forge a turn or put loss where it should not be. Tool names
are checked (``conversation.py``: letters, digits, ``_`` and ``-``), and so are tool-call
arguments (JSON, as ``<|constrain|>json`` says).

Loss (``MaskSettings``): an assistant message in ``loss_channels`` carries loss on its content and
end token, and with ``loss_header="generated"`` on the header tokens the model writes: after the
prompt's ``<|start|>assistant`` (what harmony's completion prompt ends with) the channel, recipient,
constraint and ``<|message|>``; for a message that follows another assistant message of the same
turn, its ``<|start|>assistant`` too. Other roles in ``loss_roles`` carry loss the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_kd.data.conversation import Message, MaskSettings

START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
SPECIAL_TOKENS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)


@dataclass(frozen=True)
class Piece:
    text: str
    special: bool  # one special token, by its spelling
    loss: bool
    # text a chat template wrote itself, whose special-token spellings are its control tokens; any other
    # text (message content above all) is encoded with those spellings as ordinary text
    template: bool = False


@dataclass(frozen=True)
class _Part:
    """One harmony message: <|start|>{head}[<|channel|>{channel}{tail}]<|message|>{body}{end}."""

    role: str
    head: str
    channel: str | None
    tail: str  # after the channel: " to=functions.x " and the json constraint
    body: str
    end: str


def _parts(messages: list[Message]) -> list[_Part]:
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    parts: list[_Part] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            parts.append(_Part("tool", f"functions.{m.name} to=assistant", "commentary", "", m.content, END))
        elif m.role != "assistant":
            parts.append(_Part(m.role, m.role, None, "", m.content, END))
        else:
            if m.reasoning and i > last_user:
                parts.append(_Part("assistant", "assistant", "analysis", "", m.reasoning, END))
            if m.content and m.tool_calls:
                parts.append(_Part("assistant", "assistant", "commentary", "", m.content, END))
            elif m.content:
                parts.append(_Part("assistant", "assistant", "final", "", m.content, END))
            for call in m.tool_calls:
                parts.append(_Part("assistant", "assistant", "commentary", f" to=functions.{call.name} ",
                                   call.arguments, CALL))
    if parts and parts[-1].channel == "final" and parts[-1].role == "assistant":
        last = parts[-1]
        parts[-1] = _Part(last.role, last.head, last.channel, last.tail, last.body, RETURN)
    return parts


def harmony_pieces(messages: list[Message], settings: MaskSettings) -> list[Piece]:
    """The conversation in harmony format, each piece marked with whether it carries loss."""
    pieces: list[Piece] = []
    previous = None
    for part in _parts(messages):
        trained = part.role in settings.loss_roles and (part.role != "assistant"
                                                        or part.channel in settings.loss_channels)
        header = trained and settings.loss_header == "generated"
        # the prompt ends with <|start|>assistant; within a turn the model writes the next header itself
        continues_turn = part.role == "assistant" and previous == "assistant"
        pieces += [Piece(START, True, header and continues_turn), Piece(part.head, False, header and continues_turn)]
        if part.channel is not None:
            pieces += [Piece(CHANNEL, True, header), Piece(part.channel, False, header)]
            if part.tail:
                pieces += [Piece(part.tail, False, header), Piece(CONSTRAIN, True, header),
                           Piece("json", False, header)]
        pieces += [Piece(MESSAGE, True, header)]
        if part.body:
            pieces.append(Piece(part.body, False, trained))
        pieces.append(Piece(part.end, True, trained))
        previous = part.role
    return pieces
