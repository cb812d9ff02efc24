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

``train``, ``cache build``, ``export-hf`` and ``prune`` take every Megatron-LM flag: ``--help`` lists ours,
``--help-megatron`` Megatron-LM's. Errors in the input print one line to stderr and exit with
status 2; ``train`` and ``cache build`` check everything they can (flags, Hugging Face directories,
Megatron-LM's validation, that the machine has CUDA) before any work.

``megatron-kd --verbose <command>`` (or ``MEGATRON_KD_VERBOSE=1``) shows what the console filters
(``megatron_kd/console.py``): third-party notices, and the stdout of ranks other than 0 under
torchrun. Checks that run before any work are the same on every rank, so only rank 0 reports
their mistakes (every rank with --verbose); later errors are reported by each rank that meets
them, naming the rank.
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_cache_inspect(args) -> int:
    from megatron_kd.cache.inspect import inspect

    summary = inspect(args.path, progress=not args.json)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(map(len, summary))
        for key, value in summary.items():
            if isinstance(value, float):
                value = f"{value:.4g}"
            print(f"{key:<{width}}  {value}")
    return 0


def _cmd_cache_verify(args) -> int:
    from megatron_kd.cache.inspect import verify

    summary = verify(args.path, progress=True)
    # chat data: entries only where the loss mask keeps the loss
    masked = summary["tokens_with_entries"] < summary["tokens"]
    print(f"{summary['path']}: OK ({summary['samples']} samples, {summary['tokens']} tokens"
          + (f", {summary['tokens_with_entries']} with teacher entries)" if masked else ")"))
    return 0


def _cmd_demo(args) -> int:
    from dataclasses import fields

    from megatron_kd.demo import DemoConfig, run_demo

    overrides = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if getattr(args, f.name, None) is not None}
    if args.quick:  # a smoke run (CI): same pipeline, a few steps
        overrides = {"teacher_steps": 12, "student_steps": 8, "eval_samples": 32, "corpus_bytes": 600_000,
                     "log_interval": 4, **overrides}
    run_demo(DemoConfig(**overrides))
    return 0


def _cmd_train(args) -> int:
    from megatron_kd.megatron.train import main as train_main

    train_main(args.megatron_args)
    return 0


def _cmd_export_hf(args) -> int:
    from megatron_kd.megatron.export_hf import main as export_main

    return export_main(args.megatron_args)


def _cmd_prune(args) -> int:
    from megatron_kd.prune.command import main as prune_main

    return prune_main(args.megatron_args)


def _cmd_hf_flags(args) -> int:
    import shlex

    from transformers import AutoConfig

    from megatron_kd.megatron.hf_check import check_hf_dir
    from megatron_kd.models.llama import megatron_flags

    check_hf_dir(args.path, "hf-flags", tokenizer=False)
    print(shlex.join(megatron_flags(AutoConfig.from_pretrained(args.path))))
    return 0


def _cmd_gguf_to_hf(args) -> int:
    import time

    from megatron_kd.models.gguf import hf_from_gguf

    start = time.perf_counter()
    s = hf_from_gguf(args.gguf, args.out)
    types = ", ".join(f"{count} {kind}" for kind, count in s["tensor_types"].items())
    print(f"{s['out']}: {s['architecture']}, {s['layers']} layers, hidden size {s['hidden_size']}, vocabulary "
          f"{s['vocab_size']}; tensors {types} -> float32 ({time.perf_counter() - start:.0f} s)")
    return 0


def _cmd_plan(args) -> int:
    from megatron_kd.megatron.plan import main as plan_main

    return plan_main(args.megatron_args)


def _cmd_data_chat(args) -> int:
    from megatron_kd.data.chat import main as chat_main

    return chat_main(args.chat_args)


def _cmd_data_text(args) -> int:
    from megatron_kd.data.text import main as text_main

    return text_main(args.text_args)


def _cmd_cache_build(args) -> int:
    from megatron_kd.teacher.build import main as build_main

    return build_main(args.megatron_args)


MEGATRON_COMMANDS = {
    ("train",): "Distill a student (or pretrain without --kd-cache) with megatron.training; launch with torchrun.",
    ("cache", "build"): "Teacher pass: the student run's data flags, the teacher's model flags and --load "
                        "(or --kd-teacher-hf), and --kd-cache PATH; launch with torchrun.",
    ("export-hf",): "Write a student checkpoint as a Hugging Face directory: the student's model flags, "
                    "--load CKPT and --out DIR (torchrun, one GPU).",
    ("prune",): "A student cut from a Hugging Face teacher (experts, layers, FFN width) by importance from a "
                "calibration pass over the run's data: the teacher's model flags, the data flags, --kd-teacher-hf "
                "DIR, the --prune-* targets and --out DIR; launch with torchrun.",
    ("plan",): "Memory per GPU of a run before launching it (the run's Megatron-LM flags; CPU, no GPU needed).",
}


def _megatron_command_help(command: tuple[str, ...], megatron: bool) -> int:
    """``--help``: our flags, and how to list Megatron-LM's (``--help-megatron``: all of them)."""
    from megatron_kd.megatron.args import add_kd_args

    name = " ".join(command)
    if megatron:  # listed by hand: argparse cannot format some of Megatron-LM's help strings (a bare %)
        import textwrap

        from megatron_kd.megatron.train import megatron_parser

        for group in megatron_parser(prog=f"megatron-kd {name}")._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
            if actions:
                print(f"\n{group.title}:")
            for action in actions:
                print("  " + ", ".join(action.option_strings))
                if action.help:
                    print(textwrap.indent(textwrap.fill(" ".join(action.help.split()), 90), "      "))
        return 0
    parser = argparse.ArgumentParser(
        prog=f"megatron-kd {name}", usage=f"megatron-kd {name} <Megatron-LM flags> [--kd-* flags]",
        description=MEGATRON_COMMANDS[command], add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Every Megatron-LM flag is accepted as well: megatron-kd {name} --help-megatron lists them.\n"
               "Missing, unknown or invalid flags stop with one line and exit status 2.")
    if command == ("export-hf",):
        parser.add_argument("--out", metavar="DIR", help="Where to write the Hugging Face directory.")
    if command == ("prune",):
        from megatron_kd.prune.command import add_prune_args

        add_prune_args(parser)
    if command == ("plan",):
        parser.add_argument("--gpus", help="GPUs in all (default 8).")
        parser.add_argument("--gpu-memory", help="Memory of one GPU (default 141GB, an H200).")
        parser.add_argument("--host-memory", help="Host memory of a node, for offloaded optimizer state.")
        parser.add_argument("--loss", help="fused (default), ce or dense: the loss path to plan for.")
        parser.add_argument("--search", action="store_true", help="List the layouts that fit, fastest first.")
    add_kd_args(parser).print_help()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from megatron_kd.demo import DemoConfig
    from megatron_kd.errors import FlagParser

    parser = FlagParser(prog="megatron-kd", description="Offline knowledge distillation for Megatron-Core.")
    parser.add_argument("--verbose", action="store_true",
                        help="Before the command: show third-party notices and every rank's output (also "
                             "MEGATRON_KD_VERBOSE=1).")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="End-to-end distillation on CPU: corpus, teacher, cache, KD and CE students.")
    demo.add_argument("--quick", action="store_true", help="A few steps of everything (a smoke test).")
    for name, default in DemoConfig().__dict__.items():
        demo.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(default), default=None,
                          help=f"(default: {default})")
    demo.set_defaults(func=_cmd_demo)

    train = commands.add_parser("train", help="Distill a student with megatron.training (GPUs; launch with torchrun). "
                                              "Takes every Megatron-LM flag plus the --kd-* flags.", add_help=False)
    train.add_argument("megatron_args", nargs=argparse.REMAINDER)
    train.set_defaults(func=_cmd_train)

    plan = commands.add_parser("plan", help="Memory per GPU of a run before launching it; --search for layouts "
                                            "that fit.", add_help=False)
    plan.add_argument("megatron_args", nargs=argparse.REMAINDER)
    plan.set_defaults(func=_cmd_plan)

    export = commands.add_parser("export-hf", help="Write a student checkpoint as a Hugging Face directory "
                                                   "(GPT-OSS, Llama, Qwen3; torchrun, 1 GPU): the student's model "
                                                   "flags, "
                                                   "--load CKPT and --out DIR.", add_help=False)
    export.add_argument("megatron_args", nargs=argparse.REMAINDER)
    export.set_defaults(func=_cmd_export_hf)

    prune = commands.add_parser("prune", help="A student cut from a Hugging Face teacher by importance from a "
                                              "calibration pass (GPUs; torchrun): --prune-num-experts / "
                                              "--prune-num-layers / --prune-ffn-hidden-size, --out DIR.",
                                add_help=False)
    prune.add_argument("megatron_args", nargs=argparse.REMAINDER)
    prune.set_defaults(func=_cmd_prune)

    hf_flags = commands.add_parser("hf-flags", help="Print the Megatron-LM model flags that build a Llama / Qwen3 "
                                                    "Hugging Face directory (for --kd-student-hf / --kd-teacher-hf).")
    hf_flags.add_argument("path", metavar="DIR")
    hf_flags.set_defaults(func=_cmd_hf_flags)

    gguf_to_hf = commands.add_parser("gguf-to-hf", help="Write a llama.cpp GGUF file (Llama / Qwen3) as a Hugging "
                                                        "Face directory, its weights dequantized to float32 (needs "
                                                        "pip install 'megatron_kd[gguf]').")
    gguf_to_hf.add_argument("gguf", metavar="FILE", help="The .gguf file.")
    gguf_to_hf.add_argument("--out", metavar="DIR", required=True, help="The directory to write (new or empty).")
    gguf_to_hf.set_defaults(func=_cmd_gguf_to_hf)

    cache = commands.add_parser("cache", help="Teacher top-K caches (Zarr v3 stores).")
    cache_cmds = cache.add_subparsers(dest="cache_command", required=True)
    p = cache_cmds.add_parser("build", help="Teacher pass (GPUs; launch with torchrun): the student's Megatron-LM data "
                                            "flags, the teacher's model flags and --load (or --kd-teacher-hf), and "
                                            "--kd-cache PATH.", add_help=False)
    p.add_argument("megatron_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_cache_build)
    p = cache_cmds.add_parser("inspect", help="Print samples, tokens, bytes/token, mean teacher mass, K, vocab, fingerprints.")
    p.add_argument("path", help="Path of the cache store.")
    p.add_argument("--json", action="store_true", help="Print the summary as JSON (no progress bar).")
    p.set_defaults(func=_cmd_cache_inspect)
    p = cache_cmds.add_parser("verify", help="Check metadata, every partition's completeness and that every chunk decodes.")
    p.add_argument("path", help="Path of the cache store.")
    p.set_defaults(func=_cmd_cache_verify)
    data = commands.add_parser("data", help="Training data: conversations rendered with a per-token loss mask, "
                                            "plain text documents.")
    data_cmds = data.add_subparsers(dest="data_command", required=True)
    p = data_cmds.add_parser("chat", help="OpenAI-style conversations (JSONL) -> a Megatron indexed dataset in "
                                          "harmony format (or the tokenizer's chat template) with a loss mask on "
                                          "the assistant's tokens; --help lists the flags.", add_help=False)
    p.add_argument("chat_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_data_chat)
    p = data_cmds.add_parser("text", help="Plain text documents (JSONL, one per line) -> a Megatron indexed "
                                          "dataset, EOD after each document (Megatron-LM's "
                                          "tools/preprocess_data.py); --help lists the flags.", add_help=False)
    p.add_argument("text_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_data_text)
    return parser


# the commands that run on GPUs under torchrun: checked in full before any work
GPU_COMMANDS = (("train",), ("cache", "build"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = False
    while argv[:1] == ["--verbose"]:
        verbose, argv = True, argv[1:]
    from megatron_kd import console

    console.setup(verbose)  # before megatron / modelopt are imported: their notices come at import
    from megatron_kd.cache.codec import CacheError
    from megatron_kd.errors import UserError

    commands = {("train",): _cmd_train, ("cache", "build"): _cmd_cache_build, ("export-hf",): _cmd_export_hf,
                ("plan",): _cmd_plan, ("prune",): _cmd_prune}
    checking = True  # every rank meets the same mistakes here: rank 0 reports them
    try:
        if argv[:2] == ["data", "chat"]:  # its own parser (Megatron-LM's --tokenizer-* flags among them)
            checking = False
            return _cmd_data_chat(argparse.Namespace(chat_args=argv[2:]))
        if argv[:2] == ["data", "text"]:  # likewise
            checking = False
            return _cmd_data_text(argparse.Namespace(text_args=argv[2:]))
        # train / cache build / export-hf / prune take Megatron-LM's own flags: hand them over untouched
        for command, run in commands.items():
            if tuple(argv[:len(command)]) == command:
                rest = argv[len(command):]
                if any(a in ("-h", "--help", "--help-megatron") for a in rest):
                    return _megatron_command_help(command, megatron="--help-megatron" in rest)
                if command in GPU_COMMANDS:
                    from megatron_kd.megatron.train import check_megatron_run

                    flags = check_megatron_run(rest, " ".join(command))
                    console.say(console.code_path_line(flags.transformer_impl))
                checking = False
                return run(argparse.Namespace(megatron_args=rest))
        args = build_parser().parse_args(argv)
        checking = False
        return args.func(args)
    except (CacheError, UserError) as e:
        rank = console.rank()
        if rank == 0 or not checking or console.is_verbose(verbose):
            where = "" if rank == 0 else f" (rank {rank})"
            print(f"megatron-kd: error{where}: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
