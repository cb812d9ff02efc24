"""Quantization-aware distillation (``--kd-quant``): how much of what post-training quantization of
an MoE student's experts to FP4 loses does a short QAD run from the same cache win back?

    python -m benchmarks.bench_qad --out runs/qad                    # one GPU, the fidelity GPU preset
    python -m benchmarks.bench_qad --out runs/qad --formats mxfp4 --set student_steps=400

Stages 1-4 are the fidelity benchmark's (benchmarks/common/fidelity.py, its GPU preset): the
corpus of the installed Python's text files, a byte-level BPE, a megatron-core GPT teacher trained
with cross-entropy, and one teacher pass into the product's default cache (64 sampled draws per
token). Then, with an MoE student (the preset student's layers and width, 8 SwiGLU experts of that
width, top-2; its experts are ``GroupedGemmExperts``, the layers ``--kd-quant`` fake-quantizes), all
on the same cache and the fused loss ``megatron-kd train`` runs (benchmarks/common/qad.py):

  bf16       the student distilled for the preset's student steps
  ptq-FMT    that student with its experts' weights rounded to nearest in FMT (MXFP4: E2M1 in blocks
             of 32 with an E8M0 scale, GPT-OSS's release format; NVFP4: blocks of 16, E4M3 scale and
             a tensor scale), nvidia-modelopt's rules bit for bit; no training
  bf16+      the bf16 student distilled for ``--fraction`` as many steps more on the next samples, at
             ``--lr-ratio`` times the learning rate: the control, what the extra steps alone give
  qad-FMT    the same steps from the bf16 student with its experts fake-quantized in every forward
             (straight-through gradient, the optimizer keeps the unquantized weights)

Reported: held-out cross-entropy and KL(teacher||student) of every arm (under bf16 autocast, the
quantized arms with their experts quantized: what the exported release-format model computes), the
steady-state time per step, and per format the fraction of PTQ's loss QAD recovers,
(CE_ptq - CE_qad) / (CE_ptq - CE_bf16), and the same against the control. Goal: MXFP4 >= 80%.
Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from benchmarks.common.fidelity import PRESETS, _setup, _start_process, preset_overrides, write_results
from benchmarks.common.qad import QADBench, QADSettings, markdown
from megatron_kd.ops.quant import FORMATS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(PRESETS), default="gpu", help="fidelity preset (default: gpu)")
    parser.add_argument("--out", default="runs/qad")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    parser.add_argument("--fraction", type=float, default=QADSettings.fraction,
                        help="QAD (and control) steps / bf16 steps (default: %(default)s)")
    parser.add_argument("--lr-ratio", type=float, default=QADSettings.lr_ratio,
                        help="QAD (and control) learning rate / the bf16 run's (default: %(default)s)")
    parser.add_argument("--variant", default=QADSettings.variant,
                        help="the cache and loss every arm trains with, a bench_fidelity variant (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="preset field overrides")
    opts = parser.parse_args(argv)
    formats = tuple(f for f in opts.formats.split(",") if f)
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--formats {opts.formats!r}: name one or more of {', '.join(FORMATS)}")
    if not 0 < opts.fraction <= 1:
        parser.error(f"--fraction {opts.fraction}: a fraction of the bf16 run's steps in (0, 1]")
    try:
        overrides = preset_overrides(opts.set)
        preset, _, device, autocast, out = _setup(opts.size, opts.out, [opts.variant], "auto", overrides)
    except ValueError as e:
        parser.error(str(e))
    if device.type != "cuda":
        parser.error("the QAD benchmark needs a GPU: the fake-quantized experts train in bf16 on the grouped path")
    settings = QADSettings(formats=formats, fraction=opts.fraction, lr_ratio=opts.lr_ratio, variant=opts.variant)
    bench = QADBench(preset, settings, out, device, autocast, lambda m: print(m, flush=True))
    for stale in (out / "work", out / "tensorboard"):
        shutil.rmtree(stale, ignore_errors=True)
    _start_process(preset, device)
    results = bench.run_qad()
    write_results(out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
