"""``megatron-kd``: command-line entry point.

    megatron-kd demo [--quick]                 end-to-end distillation on CPU (teacher, cache, students)
    megatron-kd train <Megatron-LM flags> --kd-cache PATH ...      student training (GPUs, torchrun)
    megatron-kd cache build <Megatron-LM flags> --kd-cache PATH ...  teacher pass (GPUs, torchrun)
    megatron-kd export-hf <model flags> --load CKPT --out DIR       student checkpoint -> Hugging Face
    megatron-kd prune <teacher + data flags> --prune-num-experts N --out DIR   a student cut from the teacher
    megatron-kd plan <Megatron-LM flags> [--gpus 8 --search]       memory per GPU before launching
    megatron-kd hf-flags DIR                   the Megatron-LM model flags of a Llama / Qwen3 directory
    megatron-kd gguf-to-hf FILE --out DIR      a llama.cpp GGUF file (Llama / Qwen3) -> Hugging Face directory
    megatron-kd cache inspect PATH [--json]    summary of a teacher cache
    megatron-kd cache verify PATH              check metadata, completeness and every chunk
    megatron-kd data chat --input JSONL --output PREFIX <--tokenizer-* flags>   chat data with a loss mask
    megatron-kd data text --input JSONL --output PREFIX <--tokenizer-* flags>   plain text documents

Each command is a module of ``megatron_kd/commands/``; ``COMMANDS`` below is the one table of them,
from which the parser, ``--help`` and the dispatch are built. ``train``, ``cache build``,
``export-hf``, ``prune`` and ``plan`` take every Megatron-LM flag, handed over untouched: ``--help``
lists ours, ``--help-megatron`` Megatron-LM's. Errors in the input print one line to stderr and
exit with status 2; ``train``, ``cache build``, ``prune`` and ``export-hf`` check everything they
can (flags, Hugging Face directories, Megatron-LM's validation, that the machine has CUDA) before
any work.

``megatron-kd --verbose <command>`` (or ``MEGATRON_KD_VERBOSE=1``) shows what the console filters
(``megatron_kd/console.py``): third-party notices, and the stdout of ranks other than 0 under
torchrun. Checks that run before any work are the same on every rank, so only rank 0 reports
their mistakes (every rank with --verbose); later errors are reported by each rank that meets
them, naming the rank.
"""

from __future__ import annotations

import argparse
import sys

from megatron_kd.commands import (cache_build, cache_inspect, cache_verify, data_chat, data_text, demo, export_hf,
                                  gguf_to_hf, hf_flags, plan, prune, train)

# Every command, in the order --help lists them (commands/__init__.py: what a module holds). A name
# of two words is a command of a group.
COMMANDS = {
    "demo": demo, "train": train, "plan": plan, "export-hf": export_hf, "prune": prune, "hf-flags": hf_flags,
    "gguf-to-hf": gguf_to_hf, "cache build": cache_build, "cache inspect": cache_inspect,
    "cache verify": cache_verify, "data chat": data_chat, "data text": data_text,
}
GROUPS = {
    "cache": "Teacher top-K caches (Zarr v3 stores).",
    "data": "Training data: conversations rendered with a per-token loss mask, plain text documents.",
}


def build_parser() -> argparse.ArgumentParser:
    """megatron-kd's parser: a subparser per command of ``COMMANDS``; the flags of those that parse
    theirs with argparse (the others, which take their command line untouched, are listed only)."""
    from megatron_kd.errors import FlagParser

    parser = FlagParser(prog="megatron-kd", description="Offline knowledge distillation for Megatron-Core.")
    parser.add_argument("--verbose", action="store_true",
                        help="Before the command: show third-party notices and every rank's output (also "
                             "MEGATRON_KD_VERBOSE=1).")
    subparsers = {"": parser.add_subparsers(dest="command", required=True)}
    for name, command in COMMANDS.items():
        group, _, verb = name.rpartition(" ")
        if group not in subparsers:
            subparsers[group] = subparsers[""].add_parser(group, help=GROUPS[group]).add_subparsers(
                dest=f"{group}_command", required=True)
        if hasattr(command, "check"):  # its command line untouched: listed here, parsed by the command
            subparsers[group].add_parser(verb, help=command.HELP, add_help=False)
        else:
            sub = subparsers[group].add_parser(verb, help=command.HELP)
            command.add_arguments(sub)
            sub.set_defaults(run=command.run)
    return parser


def _untouched_command(argv: list[str]) -> tuple[str, list[str]] | None:
    """(name, the rest of ``argv``) where ``argv`` names a command that takes the rest untouched (one
    with ``check``); None for the others, which megatron-kd's parser parses."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and hasattr(COMMANDS.get(name), "check"):
            return name, argv[words:]
    return None


def megatron_help(name: str, megatron: bool) -> int:
    """``--help`` of a command that takes Megatron-LM's flags: its own flags and ours, and how to list
    Megatron-LM's (``--help-megatron``: all of them)."""
    from megatron_kd.megatron.args import add_kd_args

    if megatron:  # listed by hand: argparse cannot format some of Megatron-LM's help strings (a bare %)
        import textwrap

        from megatron_kd.megatron.flags import megatron_parser

        for group in megatron_parser(prog=f"megatron-kd {name}")._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
            if actions:
                print(f"\n{group.title}:")
            for action in actions:
                print("  " + ", ".join(action.option_strings))
                if action.help:
                    print(textwrap.indent(textwrap.fill(" ".join(action.help.split()), 90), "      "))
        return 0
    command = COMMANDS[name]
    parser = argparse.ArgumentParser(
        prog=f"megatron-kd {name}", usage=f"megatron-kd {name} <Megatron-LM flags> [--kd-* flags]",
        description=command.DESCRIPTION, add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Every Megatron-LM flag is accepted as well: megatron-kd {name} --help-megatron lists them.\n"
               "Missing, unknown or invalid flags stop with one line and exit status 2.")
    if hasattr(command, "add_arguments"):
        command.add_arguments(parser)
    add_kd_args(parser).print_help()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = False
    while argv[:1] == ["--verbose"]:
        verbose, argv = True, argv[1:]
    from megatron_kd import console

    console.setup(verbose)  # before megatron / modelopt are imported: their notices come at import
    from megatron_kd.cache.codec import CacheError
    from megatron_kd.errors import UserError

    checking = True  # every rank meets the same mistakes here: rank 0 reports them
    try:
        found = _untouched_command(argv)
        if found is None:
            args = build_parser().parse_args(argv)
            checking = False
            return args.run(args)
        name, rest = found
        command = COMMANDS[name]
        if getattr(command, "MEGATRON", False) and any(a in ("-h", "--help", "--help-megatron") for a in rest):
            return megatron_help(name, megatron="--help-megatron" in rest)
        checked = command.check(rest)  # Megatron-LM's flags (or the command's own parser's) untouched
        checking = False
        return command.run(checked)
    except (CacheError, UserError) as e:
        rank = console.rank()
        if rank == 0 or not checking or console.is_verbose(verbose):
            where = "" if rank == 0 else f" (rank {rank})"
            print(f"megatron-kd: error{where}: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
