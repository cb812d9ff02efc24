"""Command-line options declared once, as dataclass fields: Megatron-Core's way.

A command's options are a dataclass whose fields carry their default, type and a docstring below
each field (Megatron-Core's config style). ``add_option_group`` builds the argparse group from it
with megatron-core's ``ArgumentGroupFactory`` (the factory behind Megatron-LM's own transformer,
logging and training flags): the flag is ``--<prefix>-<field>``, its ``dest`` ``<prefix>_<field>``,
its help the field's docstring, its choices a ``Literal`` type's values. ``option_table`` writes
the same fields as the Markdown table the README carries, so the parser and the manual cannot
drift (``tests/test_option_docs.py`` compares them).

Beside what the factory reads, ``option(...)`` records:

- ``rule``: a ``Range`` every numeric option has (finite, its bounds), checked on parsed flags
  (``check_ranges``) and in ``__post_init__`` of configs built in code;
- ``unset``: how the manual names a ``None`` default (``"auto"``, ``"all"``): what happens then.

The fields' types are resolved (``typing.get_type_hints``) before the factory reads them, so a
module that declares options may use ``from __future__ import annotations``.
"""

import argparse
import copy
import math
import typing
from dataclasses import dataclass, field, fields

from megatron_kd.errors import FlagError


@dataclass(frozen=True)
class Range:
    """Where a numeric option's value makes sense: finite, above ``low`` (``>`` or ``>=``) and below
    ``high`` (``<`` or ``<=``) when given, an integer when ``integer``. ``None`` is the option's
    "not given" (its default) and is always allowed."""

    low: float
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{kind} in {left}{self.low:g}, {self.high:g}{right}"

    def allows(self, value) -> bool:
        if value is None:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if value < self.low or (self.low_open and value == self.low):
            return False
        return self.high is None or value < self.high or (not self.high_open and value == self.high)

    def check(self, flag: str, value) -> None:
        if not self.allows(value):
            raise FlagError(f"{flag} must be {self.describe()}, got {value!r}")


def option(default=None, *, metavar: str | None = None, rule: Range | None = None, unset: str | None = None,
           **argparse_kwargs):
    """A dataclass field that is also a command-line option (see the module's docstring);
    ``argparse_kwargs`` go to ``add_argument`` as they are (e.g. ``type`` for a parser of its own)."""
    meta = dict(argparse_kwargs)
    if metavar is not None:
        meta["metavar"] = metavar
    return field(default=default, metadata={"argparse_meta": meta, "rule": rule, "unset": unset})


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}_{name}" if prefix else name


def option_docs(config: type) -> dict[str, str]:
    """Each field's docstring, one line (what ``--help`` and the manual print)."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    return ArgumentGroupFactory(config).field_docstrings


def add_option_group(parser, config: type, *, prefix: str = "", title: str | None = None,
                     exclude: tuple[str, ...] = ()) -> argparse._ArgumentGroup:
    """``config``'s fields as an argparse group of ``parser`` (``--<prefix>-<field>``); ``exclude``
    names fields another config declares the flag of."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    missing = numeric_fields_without_rule(config)
    if missing:  # a bug, not a user mistake: every numeric option says its range
        raise RuntimeError(f"{config.__name__}: numeric options without a Range: {missing}")
    hints = typing.get_type_hints(config)

    class Factory(ArgumentGroupFactory):
        def _build_argparse_kwargs_from_field(self, attribute):
            attribute = copy.copy(attribute)
            attribute.type = hints[attribute.name]  # an object, also under postponed annotations
            if "type" in attribute.metadata["argparse_meta"]:
                attribute.type = str  # a parser of its own (argparse_meta's) replaces what the type implies
            kwargs = super()._build_argparse_kwargs_from_field(attribute)
            dest = _dest(prefix, attribute.name)
            kwargs["arg_names"], kwargs["dest"] = [flag_name(dest)], dest
            help_text = kwargs["help"].replace("%", "%%")  # argparse formats help with %
            if hints[attribute.name] is not bool:
                help_text += f" Default: {_default_text(attribute)}."
            kwargs["help"] = help_text
            if "choices" in kwargs:
                kwargs.pop("type", None)  # the choices are the values, as given
            return kwargs

    group = Factory(config, exclude=list(exclude)).build_group(parser, title=title or config.__doc__.split("\n")[0])
    group.description = None  # the title says it; the fields' help says the rest
    return group


def option_rules(config: type, *, prefix: str = "") -> dict[str, Range]:
    """dest -> Range of every option of ``config`` that has one."""
    return {_dest(prefix, f.name): f.metadata["rule"] for f in fields(config) if f.metadata.get("rule")}


def numeric_fields_without_rule(config: type) -> list[str]:
    """The numeric fields of ``config`` without a ``Range`` (``add_option_group`` refuses them)."""
    hints = typing.get_type_hints(config)

    def numeric(hint) -> bool:  # int, float or Optional of them; a Literal's values are choices
        return typing.get_origin(hint) is not typing.Literal and bool({int, float} & (set(typing.get_args(hint)) or {hint}))

    return [f.name for f in fields(config) if numeric(hints[f.name]) and not f.metadata.get("rule")]


def check_ranges(config, *, prefix: str = "") -> None:
    """Every option of a config instance (built from flags or in code) against its Range, named by
    its flag."""
    for f in fields(config):
        rule = f.metadata.get("rule")
        if rule is not None:
            rule.check(flag_name(_dest(prefix, f.name)), getattr(config, f.name))


def from_args(config: type, args: argparse.Namespace, *, prefix: str = "", **overrides):
    """An instance of ``config`` from parsed flags (``<prefix>_<field>``), ``overrides`` given by name."""
    values = {f.name: getattr(args, _dest(prefix, f.name)) for f in fields(config)
              if f.init and f.name not in overrides and hasattr(args, _dest(prefix, f.name))}
    return config(**values, **overrides)


def _choices(hint) -> tuple | None:
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is typing.Literal:
            return typing.get_args(candidate)
    return None


def _default_text(f) -> str:
    if f.default is None:
        return f.metadata.get("unset") or "none"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if isinstance(f.default, tuple):
        return ",".join(map(str, f.default))
    return str(f.default)


def option_table(config: type, *, prefix: str = "", exclude: tuple[str, ...] = ()) -> list[str]:
    """The Markdown rows (flag, default, meaning) of ``config``'s options, in field order."""
    docs, hints = option_docs(config), typing.get_type_hints(config)
    rows = []
    for f in fields(config):
        if f.name in exclude or not f.init:
            continue
        meta = f.metadata.get("argparse_meta", {})
        flag, choices = flag_name(_dest(prefix, f.name)), meta.get("choices") or _choices(hints[f.name])
        if hints[f.name] is bool:
            shown = f"`{flag}`"
        else:
            arg = "{" + ",".join(map(str, choices)) + "}" if choices else meta.get("metavar", f.name.upper())
            shown = f"`{flag} {arg}`"
        meaning = docs.get(f.name, "").replace("|", "\\|")  # a bar inside a cell ends it
        rows.append(f"| {shown} | {_default_text(f)} | {meaning} |")
    return rows
