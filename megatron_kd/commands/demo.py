"""``megatron-kd demo``: end-to-end distillation on CPU (``megatron_kd/demo.py``): a corpus, a teacher,
its cache, and students distilled from it and trained with cross-entropy alone."""

from __future__ import annotations

import argparse

HELP = "End-to-end distillation on CPU: corpus, teacher, cache, KD and CE students."
# --quick: the same pipeline, a few steps of everything (CI's smoke run)
QUICK = {"teacher_steps": 12, "student_steps": 8, "eval_samples": 32, "corpus_bytes": 600_000, "log_interval": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_kd.demo import DemoConfig

    parser.add_argument("--quick", action="store_true", help="A few steps of everything (a smoke test).")
    for name, default in DemoConfig().__dict__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(default), default=None,
                            help=f"(default: {default})")


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from megatron_kd.demo import DemoConfig, run_demo

    overrides = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if getattr(args, f.name, None) is not None}
    if args.quick:
        overrides = {**QUICK, **overrides}
    run_demo(DemoConfig(**overrides))
    return 0
