"""Healing a pruned student: the teacher cut at two levels, each cut recovered by distillation from
the teacher's cache, against cross-entropy training and online KD for the same steps.

    python -m benchmarks.bench_heal --size cpu --out /tmp/heal          # the CPU preset, ~4 minutes
    python -m benchmarks.bench_heal --size gpu --out runs/heal          # one H200, ~10 minutes
    python -m benchmarks.bench_heal --size gpu --out runs/heal --resume # after a stop

Stages 1-4 are the fidelity benchmark's (``Bench`` of benchmarks/common/fidelity.py, its presets with
``HEAL_PRESETS``' changes): the corpus of the installed Python's text files, a byte-level BPE, a
megatron-core GPT teacher trained with cross-entropy, and the teacher passes into a top-100 cache and
a sampled cache of 64 draws. Then, with the product's own pruning code (benchmarks/common/heal.py):

5. Calibration: ``megatron_kd.prune.calibrate`` runs the teacher over the first ``--calib-samples``
   samples the students train on (the samples the caches hold: one cache serves every cut) and
   scores its layers (block influence) and MLP channels (activation L2).
6. Cuts: at each level, ``choose_kept`` keeps the most important layers and channels and
   ``pruned_megatron_state`` cuts the teacher's state dict; the student is the GPT of the cut sizes
   loading it (``LEVELS``: "light" keeps 3/4 of the layers and of the MLP width, "heavy" 1/2).
7. Healing: from that start, the same samples, order and steps (the preset's student steps, at
   ``--lr``), one run per variant: ``ce`` (cross-entropy only), ``top100-renorm`` and ``sampled64``
   (the fused loss from the caches, what ``megatron-kd train`` runs) and ``online`` (full-vocabulary
   KL with the teacher in memory, the reference).

Reported per level: held-out cross-entropy (and KL(teacher‖student)) of the pruned student before
healing and after each variant, and the fraction of the pruned-to-teacher gap each closes,
(CE_pruned − CE_healed) / (CE_pruned − CE_teacher); the goal is a cache variant closing at least
80% of what online KD closes. Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from benchmarks.common.fidelity import PRESETS, _setup, _start_process, preset_overrides, write_results
from benchmarks.common.heal import HEAL_PRESETS, LEVELS, VARIANTS, HealBench, markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--out", default="runs/heal")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="bench_fidelity variant names")
    parser.add_argument("--levels", default=",".join(LEVELS), help=f"of {', '.join(LEVELS)}")
    parser.add_argument("--lr", type=float, default=None, help="healing learning rate (default: the preset's "
                                                                "student rate / 3: the start is a trained model)")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="preset field overrides")
    parser.add_argument("--resume", action="store_true",
                        help="continue a run stopped in --out with the same settings (teacher, caches, finished "
                             "students kept)")
    opts = parser.parse_args(argv)
    overrides = {**HEAL_PRESETS.get(opts.size, {}), **preset_overrides(opts.set)}
    overrides["student_lr"] = opts.lr if opts.lr is not None else \
        overrides.get("student_lr", PRESETS[opts.size].student_lr) / 3
    preset, variants, device, autocast, out = _setup(opts.size, opts.out, opts.variants.split(","), opts.dtype,
                                                     overrides)
    bench = HealBench(preset, out, device, autocast, lambda m: print(m, flush=True))
    if not (opts.resume and bench.resume()):
        for stale in (out / "work", out / "tensorboard"):  # datasets, caches and curves are rebuilt
            shutil.rmtree(stale, ignore_errors=True)
        (out / "results.partial.json").unlink(missing_ok=True)
    _start_process(preset, device)
    results = bench.heal({k: LEVELS[k] for k in opts.levels.split(",")}, variants, opts.calib_samples)
    results["preset_name"] = opts.size
    write_results(out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
