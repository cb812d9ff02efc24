"""``megatron-kd data text``: plain text documents (JSONL) -> a Megatron indexed dataset, what
Megatron-LM's ``tools/preprocess_data.py`` does (``data/text.py`` tokenizes and writes it).

    megatron-kd data text --input docs.jsonl [--input more.jsonl ...] --output PREFIX [--json-key text] \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR [--append-eod | --no-append-eod] \\
        [--overwrite]
"""

from __future__ import annotations

import argparse

from megatron_kd.errors import FlagParser

HELP = ("Plain text documents (JSONL, one per line) -> a Megatron indexed dataset, EOD after each document "
        "(Megatron-LM's tools/preprocess_data.py); --help lists the flags.")


def text_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import _add_tokenizer_args

    parser = FlagParser(prog="megatron-kd data text",
                        description="Plain text documents (JSONL, one per line) -> a Megatron indexed dataset, as "
                                    "Megatron-LM's tools/preprocess_data.py. Megatron-LM's --tokenizer-* flags name "
                                    "the tokenizer.")
    group = parser.add_argument_group("text data")
    group.add_argument("--input", required=True, action="append", metavar="JSONL",
                       help="Documents, one JSON object per line; repeat the flag for more files (read in order).")
    group.add_argument("--output", required=True, metavar="PREFIX",
                       help="Writes PREFIX.bin/.idx (tokens, one document per line) and PREFIX_text.json (counts, "
                            "tokenizer fingerprint), each under a temporary name first, moved into place once "
                            "every input was read.")
    group.add_argument("--overwrite", action="store_true",
                       help="Replace a dataset already at PREFIX (only once the new one is complete); without it, "
                            "existing files there are refused.")
    group.add_argument("--json-key", default="text", metavar="KEY",
                       help="The key of each line that holds the document's text (default: text).")
    group.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                       help="End each document with the tokenizer's EOD token (default: yes), so "
                            "--reset-attention-mask finds the documents' boundaries.")
    return _add_tokenizer_args(parser)


def check(argv: list[str]) -> argparse.Namespace:
    return text_parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from megatron_kd.data.chat import build_tokenizer, check_output
    from megatron_kd.data.text import build_text_dataset, text_files

    check_output(args.output, text_files(args.output), overwrite=args.overwrite)  # before loading the tokenizer
    summary = build_text_dataset(args.input, args.output, build_tokenizer(args, "data text"),
                                 json_key=args.json_key, append_eod=args.append_eod, overwrite=args.overwrite)
    rate = summary["tokens"] / max(summary["seconds"], 1e-9)
    print(f"{args.output}: {summary['documents']:,} documents, {summary['tokens']:,} tokens "
          f"({rate:,.0f} tokens/s, {summary['dtype']}"
          + (", EOD appended" if summary["append_eod"] else ", no EOD")
          + (f"; {summary['empty_skipped']} empty skipped" if summary["empty_skipped"] else "") + ")")
    return 0
