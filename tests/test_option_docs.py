"""Options are declared once (``megatron_kd/options.py``): the parser, ``--help`` and the README's
flag table are all built from the configs' fields, so they cannot disagree.

1. the README's ``--kd-*`` table is the one ``kd_option_table`` writes (the failure prints it)
2. every ``--kd-*`` flag of the parser is a config field of that name, with its default, its
   choices and its docstring as help; every config field (less the flags another config declares)
   is a flag
3. a config built from parsed flags equals the one built in code from the same values
4. a numeric field without a Range (an option's or a plain field's) is refused when the parser is
   built; postponed annotations resolve
5. ``prune``'s targets come from ``PruneTargets``'s fields; ``--kd-samples`` names its new name
"""

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from megatron_kd.cli import main
from megatron_kd.errors import FlagError
from megatron_kd.megatron.args import (KD_OPTION_GROUPS, PREFIX, KDConfig, TeacherPassConfig, add_kd_args,
                                       kd_option_table, refuse_renamed_flags)
from megatron_kd.options import add_option_group, from_args, numeric_fields_without_rule, option, option_docs

README = Path(__file__).parents[1] / "README.md"


def _readme_kd_table() -> list[str]:
    lines = README.read_text().splitlines()
    start = lines.index("| flag | default | meaning |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def test_the_readme_table_is_the_generated_one():
    generated = kd_option_table()
    assert _readme_kd_table() == generated, ("README.md's --kd-* table differs from the configs' fields; "
                                             "replace it with:\n" + "\n".join(generated))


def _kd_actions() -> dict[str, argparse.Action]:
    parser = add_kd_args(argparse.ArgumentParser())
    return {a.dest: a for a in parser._actions if a.dest.startswith(f"{PREFIX}_")}


def test_parser_flags_are_the_config_fields():
    actions = _kd_actions()
    declared = {}
    for config, elsewhere in KD_OPTION_GROUPS:
        docs = option_docs(config)
        for f in fields(config):
            if f.name in elsewhere:
                continue
            dest = f"{PREFIX}_{f.name}"
            assert dest not in declared, f"--kd-{f.name} declared by {declared.get(dest)} and {config.__name__}"
            declared[dest] = config.__name__
            action = actions[dest]
            assert action.option_strings == ["--" + dest.replace("_", "-")]
            assert action.default == f.default, dest
            assert action.help.startswith(docs[f.name].replace("%", "%%")), dest
    assert set(actions) == set(declared)
    # the flags one config takes from another exist, with the same default
    for config, elsewhere in KD_OPTION_GROUPS:
        for name in elsewhere:
            assert actions[f"{PREFIX}_{name}"].default == next(f.default for f in fields(config) if f.name == name)
    assert set(_kd_actions()["kd_tail"].choices) == {"none", "renorm", "ghost"}


def test_configs_from_flags_equal_configs_from_code():
    parser = add_kd_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kd-cache", "/c", "--kd-weight", "0.5", "--kd-tail", "ghost", "--kd-chunk-size", "7",
                              "--kd-draws", "16", "--kd-cache-workers", "2"])
    assert KDConfig.from_args(args) == KDConfig(cache="/c", weight=0.5, tail="ghost", chunk_size=7)
    teacher = TeacherPassConfig.from_args(args)
    assert teacher == TeacherPassConfig(cache="/c", chunk_size=7, draws=16, cache_workers=2)
    assert (teacher.entries, teacher.codec) == (16, None)
    assert TeacherPassConfig(cache_mode="topk").entries == 100
    with pytest.raises(FlagError, match="--kd-draws 8 is for --kd-cache-mode sampled"):
        TeacherPassConfig(cache_mode="topk", draws=8)
    with pytest.raises(FlagError, match="--kd-capture-temperature must be a finite number > 0"):
        TeacherPassConfig(capture_temperature=0.0)


def test_options_without_a_range_or_a_declaration_are_refused():
    @dataclass
    class Loose:
        """loose"""

        steps: int | None = option(metavar="N")
        """No range."""

    assert numeric_fields_without_rule(Loose) == ["steps"]
    with pytest.raises(RuntimeError, match="steps"):
        add_option_group(argparse.ArgumentParser(), Loose)

    @dataclass
    class Plain:
        """plain"""

        size: int = 3

    with pytest.raises(RuntimeError, match="size"):
        add_option_group(argparse.ArgumentParser(), Plain)


def test_postponed_annotations_resolve():
    from megatron_kd.prune import PruneTargets

    assert isinstance(PruneTargets.__dataclass_fields__["num_layers"].type, str)  # the module postpones them
    parser = argparse.ArgumentParser()
    add_option_group(parser, PruneTargets, prefix="prune")
    args = parser.parse_args(["--prune-num-layers", "4"])
    assert from_args(PruneTargets, args, prefix="prune") == PruneTargets(num_layers=4)
    assert args.prune_hidden_size is None


def test_prune_help_lists_the_targets(capsys):
    from megatron_kd.prune import PruneTargets

    assert main(["prune", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for f in fields(PruneTargets):
        assert "--prune-" + f.name.replace("_", "-") in out
    assert "--prune-calib-samples N" in out and "Default: 128." in out


def test_the_old_draws_flag_names_the_new_one(capsys):
    with pytest.raises(FlagError, match="--kd-samples is now --kd-draws"):
        refuse_renamed_flags(["--kd-samples=8"])
    assert main(["cache", "build", "--kd-samples", "8"]) == 2
    assert "--kd-samples is now --kd-draws" in capsys.readouterr().err
