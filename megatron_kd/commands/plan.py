"""``megatron-kd plan``: memory per GPU of a run before launching it, on CPU (``megatron/plan.py``
estimates, ``--search`` lists the layouts that fit).

    megatron-kd plan <the Megatron-LM flags of the run> [--gpus 8] [--gpu-memory 141GB]
                     [--host-memory 2TB] [--loss fused|dense|ce] [--search [--top 8]]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_kd.errors import FlagError, FlagParser

MEGATRON = True
HELP = "Memory per GPU of a run before launching it; --search for layouts that fit."
DESCRIPTION = "Memory per GPU of a run before launching it (the run's Megatron-LM flags; CPU, no GPU needed)."


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from megatron_kd.megatron.plan import DEFAULT_GPU_MEMORY

    parser.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8).")
    parser.add_argument("--gpu-memory", default=DEFAULT_GPU_MEMORY,
                        help=f"Memory of one GPU (default {DEFAULT_GPU_MEMORY}, an H200).")
    parser.add_argument("--host-memory", default=None, help="Host memory of a node, for offloaded optimizer state.")
    parser.add_argument("--loss", choices=("fused", "dense", "ce"), default="fused",
                        help="fused (default), ce or dense: the loss path to plan for.")
    parser.add_argument("--search", action="store_true", help="List the layouts that fit, fastest first.")
    parser.add_argument("--top", type=int, default=8, metavar="N", help="How many layouts --search lists (default 8).")
    return parser


@dataclass
class Planned:
    opts: argparse.Namespace
    gpu_memory: float
    host_memory: float | None
    args: argparse.Namespace
    layout: object  # megatron.plan.Layout


def check(argv: list[str]) -> Planned:
    """plan's own flags and the run's, each mistake one ``FlagError``; layouts Megatron would refuse too."""
    from megatron_kd.megatron.plan import parse_size, plan_args

    opts, rest = add_arguments(FlagParser(prog="megatron-kd plan", add_help=False)).parse_known_args(argv)
    for flag, value in (("--gpus", opts.gpus), ("--top", opts.top)):
        if value < 1:
            raise FlagError(f"{flag} must be >= 1, got {value}")
    try:
        gpu_memory = parse_size(opts.gpu_memory)
        host_memory = parse_size(opts.host_memory) if opts.host_memory else None
    except ValueError as e:
        raise FlagError(f"--gpu-memory / --host-memory: {e}") from None
    for flag, value in (("--gpu-memory", gpu_memory), ("--host-memory", host_memory)):
        if value is not None and value <= 0:
            raise FlagError(f"{flag} must be > 0, got {value:g} bytes")
    args, layout = plan_args(rest, opts.gpus)
    return Planned(opts, gpu_memory, host_memory, args, layout)


def run(planned: Planned) -> int:
    from megatron_kd.console import code_path_line, say
    from megatron_kd.megatron.args import cache_entries
    from megatron_kd.megatron.plan import GIB, estimate, format_plan, search, step_cost

    opts, args, gpus = planned.opts, planned.args, planned.opts.gpus
    say(code_path_line(args.transformer_impl, planned=True))
    kd_topk = cache_entries(args)
    plans = {loss: estimate(args, planned.layout, gpus=gpus, loss=loss, kd_topk=kd_topk) for loss in ("fused", "ce", "dense")}
    print(format_plan(plans[opts.loss], planned.gpu_memory, planned.host_memory, gpus))
    print("  loss paths: " + ", ".join(f"{loss} {p.total / GIB:.1f} GiB" for loss, p in plans.items()))
    if opts.search:
        fits = search(args, gpus, gpu_memory=planned.gpu_memory, host_memory=planned.host_memory, loss=opts.loss,
                      kd_topk=kd_topk)
        print(f"\nlayouts that fit ({len(fits)}), fastest first:" if fits else
              "\nno layout fits: more GPU or host memory, more nodes, or LoRA (see README)")
        for p in fits[:opts.top]:
            print(f"  {p.layout.describe():48s} {p.total / GIB:6.1f} GiB/GPU"
                  + (f", host {p.host_bytes * gpus / GIB:.0f} GiB" if p.host_bytes else "")
                  + f", relative step time {step_cost(args, p.layout, gpus) * gpus:.2f}"
                  + (f"  ({' '.join(p.layout.recompute_flags())})" if p.layout.recompute_flags() else ""))
    return 0
