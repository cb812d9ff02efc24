"""``megatron-kd cache verify``: a teacher cache's metadata, completeness and every chunk checked
(``cache/inspect.py``)."""

from __future__ import annotations

import argparse

HELP = "Check metadata, every partition's completeness and that every chunk decodes."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="Path of the cache store.")


def run(args: argparse.Namespace) -> int:
    from megatron_kd.cache.inspect import verify

    summary = verify(args.path, progress=True)
    # chat data: entries only where the loss mask keeps the loss
    masked = summary["tokens_with_entries"] < summary["tokens"]
    print(f"{summary['path']}: OK ({summary['samples']} samples, {summary['tokens']} tokens"
          + (f", {summary['tokens_with_entries']} with teacher entries)" if masked else ")"))
    return 0
