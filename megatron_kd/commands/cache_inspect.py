"""``megatron-kd cache inspect``: a teacher cache's summary (``cache/inspect.py``)."""

from __future__ import annotations

import argparse

HELP = "Print samples, tokens, bytes/token, mean teacher mass, K, vocab, fingerprints."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="Path of the cache store.")
    parser.add_argument("--json", action="store_true", help="Print the summary as JSON (no progress bar).")


def run(args: argparse.Namespace) -> int:
    import json

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
