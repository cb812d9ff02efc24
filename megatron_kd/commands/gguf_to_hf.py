"""``megatron-kd gguf-to-hf``: a llama.cpp GGUF file (Llama / Qwen3) -> a Hugging Face directory, its
weights dequantized to float32 (``models/gguf.py``)."""

from __future__ import annotations

import argparse

HELP = ("Write a llama.cpp GGUF file (Llama / Qwen3) as a Hugging Face directory, its weights dequantized to float32 "
        "(needs pip install 'megatron_kd[gguf]').")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="FILE", help="The .gguf file.")
    parser.add_argument("--out", metavar="DIR", required=True, help="The directory to write (new or empty).")


def run(args: argparse.Namespace) -> int:
    import time

    from megatron_kd.models.gguf import hf_from_gguf

    start = time.perf_counter()
    s = hf_from_gguf(args.gguf, args.out)
    types = ", ".join(f"{count} {kind}" for kind, count in s["tensor_types"].items())
    print(f"{s['out']}: {s['architecture']}, {s['layers']} layers, hidden size {s['hidden_size']}, vocabulary "
          f"{s['vocab_size']}; tensors {types} -> float32 ({time.perf_counter() - start:.0f} s)")
    return 0
