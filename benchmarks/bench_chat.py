"""Answer-only chat distillation against full-sequence distillation, on the same conversations.

    python -m benchmarks.bench_chat --size cpu --out /tmp/chat          # 2 CPU cores: 4-6 minutes
    python -m benchmarks.bench_chat --size cpu --variant top100-renorm --set student_steps=120

Conversations, made at run time from the installed Python's standard library (its .py sources
outside test directories, private modules left out, parsed with ``ast``, never imported), visited
in the order of a hash of the module's name. A module's subjects are the module itself, its public
top-level functions and classes and the public methods of those classes, each with a docstring
whose first paragraph (at most ``ANSWER_LINES`` lines, joined into one) is a real answer (at least
``MIN_ANSWER_CHARS`` characters, not a doctest; a paragraph seen before is skipped). A module's
subjects, in source order, make conversations of 1 to ``MAX_TURNS`` turns (the count drawn per
conversation), each

    system     ``SYSTEM`` (the same for every conversation)
    user       a question about the subject, one of ``QUESTIONS[kind]`` ("What does {module}.{name}() do?")
    assistant  the docstring's first paragraph (harmony's final channel); in the last turn of a third
               of the conversations, first an analysis message (``reasoning``) naming the subject
               with what ``ast`` says of it: a function's or method's parameters, a class's bases, a
               module's count of public functions and classes

(draws from ``random.Random(f"{seed}:{module}")``, so a module's conversations do not depend on the
others). A module goes to the held-out split by a hash of its name: no model and not the tokenizer
ever sees a held-out module's documentation.

The pipeline is the fidelity benchmark's (``Bench`` of benchmarks/common/fidelity.py) with the product's chat path:

1. Tokenizer: bench_fidelity's byte-level BPE trained on the training conversations' text pieces,
   with harmony's special tokens (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
   ``<|return|>``, ``<|call|>``, ``<|constrain|>``) as ids of their own.
2. Data: each split written as JSONL and rendered by ``megatron_kd.data.chat.build_chat_dataset``
   (what ``megatron-kd data chat`` runs: the harmony renderer, the default mask: the assistant's
   messages, analysis and final, their generated headers and end tokens) into an indexed dataset,
   its loss mask and sidecar; GPTDataset packs conversations back to back into samples, and
   ``LossMaskedDataset`` joins the mask.
3. Teacher: trained with cross-entropy on the full conversations (every token).
4. Two teacher passes of the same teacher over the same samples, each into a cache of its own K
   (``--variant``, a bench_fidelity cache variant): under the chat mask (entries only at answer
   tokens, the cache's ``loss_mask`` recorded, as ``cache build`` writes it) and over every token.
5. Two students from the same start, the same samples in the same order, the same steps, the
   fused KD loss of ``megatron-kd train``: answer-only (its cache, its loss masked to the answer
   tokens) and full-sequence (its cache, the loss over every token).

Reported: held-out answer-token cross-entropy and KL(teacher || student) of the untrained start,
of each student and of the teacher (and the same over every held-out token), each cache's bytes
(all of the store's files), bytes per token of the sequence and per answer token, tokens with
entries, and its teacher pass's wall time. Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common.chat import CHAT_PRESETS, DEFAULT_VARIANT, chat_students, run
from benchmarks.common.fidelity import preset_overrides
from megatron_kd.cache.meta import PACKING_MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(CHAT_PRESETS), default="cpu", help="preset (default: cpu)")
    parser.add_argument("--out", default="runs/chat", help="output directory (default: runs/chat)")
    parser.add_argument("--variant", default=DEFAULT_VARIANT,
                        help=f"the students' cache and loss, a bench_fidelity cache variant (default: "
                             f"{DEFAULT_VARIANT})")
    parser.add_argument("--packing", choices=PACKING_MODES, default="none",
                        help="how teacher and students treat the conversations packed into a sample (bench_fidelity)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="preset field overrides")
    args = parser.parse_args(argv)
    try:
        chat_students(args.variant)
        overrides = preset_overrides(args.set)
    except ValueError as e:
        parser.error(str(e))
    run(args.size, args.out, args.variant, dtype=args.dtype, packing=args.packing,
        log=lambda m: print(m, flush=True), **overrides)
    print(Path(args.out, "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
