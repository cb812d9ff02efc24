"""Distillation fidelity on a real corpus: does the offline top-K student learn what the online
full-vocabulary student learns, and what does each cache choice cost?

    python -m benchmarks.bench_fidelity --size gpu --out runs/fidelity      # one H200: ~12 minutes
    python -m benchmarks.bench_fidelity --size gpu --out runs/fidelity --resume   # after a stop
    python -m benchmarks.bench_fidelity --size cpu --out /tmp/fidelity --variants ce,online,top32-ghost
    python -m benchmarks.bench_fidelity --size gpu --set teacher_steps=2000 --set student=4,256,4 ...
    python -m benchmarks.bench_fidelity --size gpu --out runs/divergences --divergence-ablation \
        --variants ce,online,top100-renorm,sampled                  # + reverse / jsd on both caches
    python -m benchmarks.bench_fidelity --size cpu --out /tmp/packing --packing-ablation \
        --variants ce,online,top32-renorm,sampled       # documents kept apart vs attending across

End to end, nothing precomputed:

1. Corpus: the text files (.py .pyi .md .rst .txt) of the installed Python's standard library and
   site-packages, read at run time, taken in an order fixed by a hash of each file's relative path
   (so a budget samples every package, not the first ones alphabetically), exact duplicates
   (whitespace-normalized) dropped. Each document goes to the held-out split or to the training
   split by a hash of its content, so a copy of a file cannot sit on both sides; no model and not
   the tokenizer ever sees a held-out document.
2. Tokenizer: a byte-level BPE trained with the `tokenizers` package on the training documents
   (32,768 entries in the gpu preset, so a top-100 really truncates), behind megatron-core's
   tokenizer interface; both splits become Megatron indexed datasets read by GPTDataset.
3. Teacher: a megatron-core GPTModel trained with cross-entropy; its held-out cross-entropy is
   measured along the way, so the report shows whether it had flattened.
4. Teacher passes (``capture_teacher``), one per cache, each written with its own K so that its
   bytes/token (``store_bytes`` / tokens) is what that cache really costs: top-K for every K the
   variants use, and a sampled cache (Random-Sampling KD) whose number of draws is the largest
   candidate whose bytes/token, measured on a calibration slice of both, stays within top-100's
   (candidates are bounded: a sampled cache stores one slot per draw, and writing them is what a
   teacher pass spends its time on).
5. Students: one smaller architecture, the same initialization, samples, order and steps for every
   variant; only the loss differs:
     ce                    cross-entropy only
     online                full-vocabulary KL(teacher || student), the teacher in memory, both
                           models' logits materialized (the dense reference; no cache)
     top{K}-{tail}         the fused top-K loss from the cache (``KDForwardStep``, what
                           ``megatron-kd train`` runs), tail none / renorm / ghost
     sampled[N][-ghost]    the fused loss on the sampled cache (tail renorm, or ghost: the student's
                           mass outside the draws as one more outcome; N draws, or chosen); -ce{W}
                           and -reverse / -jsd[B] as for top-K, e.g. sampled64-reverse-ce0.1
     top{K}-{tail}-ce{W}   the same with hard-label cross-entropy weight W; tail "best" is the
                           tail whose plain top-K variants scored best on held-out cross-entropy
     ...-reverse, ...-jsd[B]  a top-K or sampled variant with another divergence of the same cached
                           support (tail renorm or ghost): KL(student || teacher), or the
                           Jensen-Shannon divergence with teacher weight B (default 0.5), e.g.
                           top100-renorm-reverse, top100-ghost-jsd0.9-ce0.1, sampled-jsd.
                           --divergence-ablation adds reverse and jsd to every top-100 and sampled
                           variant of the run (forward KL, tail renorm or ghost)
6. Held-out metrics of every model on the held-out split: cross-entropy and full-vocabulary
   KL(teacher || student), both in fp32 from fp32 weights. Wall time per training step is the
   steady state (after the first few steps, which also compile kernels) of everything a step
   costs: reading the batch and its teacher rows, forward, backward, optimizer, and for ``online``
   the teacher's forward.

Packed documents (``--packing``, ``--packing-ablation``). GPTDataset packs documents back to back
into each sample. ``--packing MODE`` runs teacher and students alike with Megatron-LM's
--reset-attention-mask / --reset-position-ids as megatron_kd implements them (``DocumentPacking``
applied to every batch: the teacher's training and held-out metric, its teacher passes, whose caches
record the mode, and every student, offline ones through ``KDForwardStep(packing=)``); the default
"none" lets attention cross documents, positions running through the sample. ``--packing-ablation``
runs the whole benchmark twice over the same data (the second setting reuses the first's
tokenizer), "none" and "documents+positions", and compares the models on whole held-out documents
(``--document-eval``, on in the ablation): each document evaluated on its own from its first token,
one document per row, so cross-document context favours neither setting; a document longer than
seq_length tokens is cut into windows of seq_length tokens every seq_length/2, each window scoring
only the predictions the one before it did not reach (``document_windows``). The loss mask is the
same in both settings (no --eod-mask-loss). results.json then holds {"packing_ablation": [modes],
"settings": {mode: the run's results}}; results.md a side-by-side table (a "packing" column), then
each run's tables.

Training uses megatron_kd.demo's loop (AdamW, warm-up + cosine). Batches are read in order by a
DataLoader (sample i·b .. (i+1)·b - 1 at step i+1, as ``demo.batch_at`` reads them), with worker
processes on GPU machines so that decoding teacher rows overlaps the step, as in Megatron training.
On CUDA the models keep fp32 weights and run under bf16 autocast; the fused KD loss and the
teacher's top-K get bf16 hidden states and a bf16 copy of the output weight (what Megatron's bf16
training hands them). Students see less than one epoch, so a student's cross-entropy on each batch,
taken before it learns from it, is an estimate on text it has not seen: those are the student
curves in curves.png (the teacher's panel adds its held-out curve).

Writes OUT/results.json (every number, curves, stage times), OUT/results.md (tables and its
goals), OUT/curves.png and OUT/tensorboard; datasets and caches live in OUT/work during the run.
After every stage OUT/results.partial.json holds what is done; ``--resume`` continues a stopped run
(same settings) from there, keeping the tokenizer, the teacher's weights, complete caches and
finished students.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common.fidelity import (DEFAULT_VARIANTS, PRESETS, autocast_dtype, default_device, parse_variant,
                                        preset_overrides, run, with_divergence_ablation)
from megatron_kd.cache.meta import PACKING_MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(PRESETS), default="gpu", help="preset (default: gpu)")
    parser.add_argument("--out", default="runs/fidelity", help="output directory (default: runs/fidelity)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated variants (default: all the goals need): ce, online, "
                             "top{K}-{none|renorm|ghost|best}[-ce{W}], sampled[N]")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="autocast dtype of training and teacher passes (auto: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--divergence-ablation", action="store_true",
                        help="add reverse KL and JSD (beta 0.5) to every top-100 and sampled variant of the run: "
                             "the same cached support, another divergence")
    parser.add_argument("--packing", choices=PACKING_MODES, default="none",
                        help="how teacher and students treat the documents packed into a sample: Megatron-LM's "
                             "--reset-attention-mask (documents) / --reset-position-ids (positions) as megatron_kd "
                             "implements them (default: none, attention crosses documents)")
    parser.add_argument("--document-eval", action="store_true",
                        help="also evaluate every model on whole held-out documents, each on its own from its first "
                             "token (heldout_doc_ce / heldout_doc_kl)")
    parser.add_argument("--packing-ablation", action="store_true",
                        help="run the benchmark twice over the same data, documents attending across (none) and "
                             "kept apart (documents+positions), teacher and students alike; whole-document "
                             "held-out metrics in both")
    parser.add_argument("--resume", action="store_true",
                        help="continue a run stopped in --out (same settings): keeps its teacher, caches and "
                             "finished students")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change one preset field, e.g. --set teacher_steps=2000 --set student=4,256,4")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:  # bad settings stop here, not after minutes of work
        for name in variants:
            parse_variant(name)
        if args.divergence_ablation:
            variants = with_divergence_ablation(variants)
        autocast_dtype(args.dtype, default_device())
        overrides = preset_overrides(args.set)
        if args.packing_ablation and args.packing != "none":
            raise ValueError("--packing-ablation runs both settings: leave out --packing")
    except ValueError as e:
        parser.error(str(e))
    run(args.size, args.out, variants, dtype=args.dtype, log=lambda m: print(m, flush=True), resume=args.resume,
        packing=args.packing, document_eval=args.document_eval, packing_ablation=args.packing_ablation,
        **overrides)
    print(Path(args.out, "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
