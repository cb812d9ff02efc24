"""OpenAI-style chat messages, read from one JSONL line and checked, and which of their tokens carry loss.

A line is ``{"messages": [...]}`` (or the list itself). Each message has a ``role`` (system, developer,
user, assistant, tool) and ``content`` (a string, or a list of ``{"type": "text", "text": ...}``
parts). An assistant message may also carry ``reasoning`` (or ``thinking`` / ``reasoning_content``:
its chain of thought) and ``tool_calls`` (``[{"id", "function": {"name", "arguments"}}]``, or
``{"name", "arguments"}`` flat); a tool message names its function by ``name``, or by
``tool_call_id`` of an earlier call. A system, developer, user or tool message must have
``content`` (an assistant message may have only reasoning or tool calls); tool-call ``arguments``
must be JSON (an object, or its text: harmony writes them after ``<|constrain|>json``); a function
name is letters, digits, ``_`` and ``-`` (OpenAI's rule for function names; harmony writes it in the
header as ``to=functions.NAME``). Anything else is a ``ChatDataError`` naming the message and the
field; the command adds the file and line.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Literal

from megatron_kd.errors import FlagError, UserError
from megatron_kd.options import Range, option

ROLES = ("system", "developer", "user", "assistant", "tool")
CHANNELS = ("analysis", "commentary", "final")
REASONING_KEYS = ("reasoning", "thinking", "reasoning_content")
HEADER_CHOICES = ("generated", "none")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")


class ChatDataError(UserError):
    """A conversation that cannot be rendered (a bad line, role or turn, a mask that selects nothing)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the call's JSON text, as the model writes it
    id: str | None = None


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None  # a tool message's function
    raw: dict = field(default_factory=dict, compare=False)  # as read, for a tokenizer's own chat template


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


@dataclass(frozen=True)
class MaskSettings:
    """loss mask: which tokens of a conversation carry loss (one byte per token beside the tokens)"""

    loss_roles: tuple[str, ...] = option(("assistant",), metavar="ROLES", type=_comma_list)
    """Roles whose messages carry loss, comma-separated, of system, developer, user, assistant,
    tool."""
    loss_channels: tuple[str, ...] = option(CHANNELS, metavar="CHANNELS", type=_comma_list)
    """Harmony channels of the assistant's messages that carry loss, of analysis (reasoning),
    commentary (tool calls and their preambles) and final (the answer); a chat template has no
    channels and ignores it."""
    loss_header: Literal[HEADER_CHOICES] = option("generated")
    """'generated': also the header tokens the model writes itself at inference (harmony: the
    channel, recipient and <|message|> after the prompt's <|start|>assistant; all of a later
    message's header in the same turn); 'none': content and end token only. End tokens (<|end|>,
    <|return|>, <|call|>) always carry loss: the model must learn to stop."""
    seq_length: int | None = option(metavar="N", rule=Range(1, integer=True), unset="any length")
    """Longest conversation in tokens (the run's --seq-length)."""
    overlong: Literal["truncate", "refuse"] = option("refuse")
    """A conversation longer than --seq-length: refuse it (one line naming it) or keep its first N
    tokens."""

    def __post_init__(self):
        for flag, values, known in (("--loss-roles", self.loss_roles, ROLES),
                                    ("--loss-channels", self.loss_channels, CHANNELS)):
            unknown = [v for v in values if v not in known]
            if unknown or not values:
                raise FlagError(f"{flag} {','.join(values)}: expected a comma-separated list of {', '.join(known)}")
        if self.loss_header not in HEADER_CHOICES:
            raise FlagError(f"--loss-header {self.loss_header}: expected one of {', '.join(HEADER_CHOICES)}")
        if self.overlong not in ("truncate", "refuse"):
            raise FlagError(f"--overlong {self.overlong}: expected truncate or refuse")
        if self.seq_length is not None and self.seq_length < 1:
            raise FlagError(f"--seq-length {self.seq_length}: expected a positive number of tokens")

    def describe(self) -> str:
        """One line naming the settings (what a mismatch error shows)."""
        return (f"roles={','.join(self.loss_roles)} channels={','.join(self.loss_channels)} "
                f"header={self.loss_header}")

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def mask_fields(self) -> dict:
        """The settings that decide which tokens carry loss (the length limit decides what is kept)."""
        return {k: v for k, v in self.to_json().items() if k in ("loss_roles", "loss_channels", "loss_header")}


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        _utf8(value, what)
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return _utf8("".join(p["text"] for p in value), what)
    raise ChatDataError(f"{what} is {type(value).__name__}, expected a string or a list of "
                        f"{{\"type\": \"text\", \"text\": ...}} parts")


def _utf8(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChatDataError(f"{what} is not UTF-8 text ({e.reason}: a lone surrogate escape such as \\ud800)") from None
    return text


def _tool_name(name, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise ChatDataError(f"{what} has no function name (function.name)")
    if not TOOL_NAME.fullmatch(name):
        raise ChatDataError(f"{what} function name {name!r} has characters other than letters, digits, '_' and '-' "
                            f"(the name is written in the header as to=functions.NAME)")
    return name


def _tool_call(call, what: str) -> ToolCall:
    if not isinstance(call, dict):
        raise ChatDataError(f"{what} is {type(call).__name__}, expected an object with function.name and arguments")
    function = call.get("function", call)
    name = _tool_name(function.get("name") if isinstance(function, dict) else None, what)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatDataError(f"{what} arguments are not JSON ({e.msg} at column {e.colno}); expected a JSON object "
                                f"or its text, e.g. \"{{\\\"city\\\": \\\"Paris\\\"}}\"") from None
        _utf8(arguments, f"{what} arguments")
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name=name, arguments=arguments, id=call.get("id"))


def parse_messages(line: object) -> list[Message]:
    """The messages of one parsed JSONL line, checked (``ChatDataError`` naming message and field)."""
    messages = line.get("messages") if isinstance(line, dict) else line
    if not isinstance(messages, list) or not messages:
        raise ChatDataError("expected an object with a non-empty \"messages\" list")
    out: list[Message] = []
    calls: dict[str, str] = {}  # tool_call_id -> function name
    for i, raw in enumerate(messages):
        what = f"message {i}"
        if not isinstance(raw, dict):
            raise ChatDataError(f"{what} is {type(raw).__name__}, expected an object with role and content")
        role = raw.get("role")
        if role not in ROLES:
            raise ChatDataError(f"{what} has role {role!r}, expected one of {', '.join(ROLES)}")
        if role != "assistant" and raw.get("content") is None:
            others = [k for k in raw if k not in ("role", "name", "tool_call_id")]
            has = f" (it has {', '.join(map(repr, others))})" if others else ""
            raise ChatDataError(f"{what} ({role}) has no \"content\"{has}; expected \"content\": a string or a list of "
                                f"{{\"type\": \"text\", \"text\": ...}} parts")
        content = _text(raw.get("content"), f"{what} content")
        if role != "assistant":
            extra = [k for k in (*REASONING_KEYS, "tool_calls") if raw.get(k)]
            if extra:
                raise ChatDataError(f"{what} ({role}) has {extra[0]}, which only assistant messages carry")
            name = None
            if role == "tool":
                name = raw.get("name") or calls.get(raw.get("tool_call_id"))
                if not isinstance(name, str) or not name:
                    raise ChatDataError(f"{what} (tool) names no function: give \"name\", or \"tool_call_id\" of an "
                                        f"earlier assistant tool call")
                _tool_name(name, what)
            out.append(Message(role, content, name=name, raw=raw))
            continue
        reasoning = "".join(_text(raw.get(k), f"{what} {k}") for k in REASONING_KEYS)
        tool_calls = raw.get("tool_calls") or []
        if not isinstance(tool_calls, list):
            raise ChatDataError(f"{what} tool_calls is {type(tool_calls).__name__}, expected a list")
        parsed = tuple(_tool_call(c, f"{what} tool_calls[{j}]") for j, c in enumerate(tool_calls))
        calls.update({c.id: c.name for c in parsed if c.id})
        if not (content.strip() or reasoning.strip() or parsed):
            raise ChatDataError(f"{what} is an empty assistant turn: no content, reasoning or tool_calls")
        out.append(Message("assistant", content, reasoning, parsed, raw=raw))
    return out
