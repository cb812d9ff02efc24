"""The distillation-fidelity benchmark at CPU size, end to end (``benchmarks/bench_fidelity.py --size cpu``).

A byte-level BPE trained on real text (the installed Python's and packages' files), a megatron-core
teacher, its top-32 cache, and one student architecture trained three ways for the same steps from
the same start: cross-entropy only, online full-vocabulary KD (teacher in memory) and offline fused
top-32 KD (ghost tail). The claim checked is the product's: on the held-out split, which neither
the tokenizer nor any model trained on, every distilled student has lower cross-entropy than the
CE-only one. Seeds are fixed, so the numbers repeat run to run.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fidelity  # noqa: E402

KD_VARIANTS = ("online", "top32-ghost")


def test_distilled_students_beat_cross_entropy_on_held_out_text(tmp_path):
    results = bench_fidelity.run("cpu", tmp_path, ["ce", *KD_VARIANTS], log=lambda _: None)
    heldout = {name: r["heldout_ce"] for name, r in results["variants"].items()}
    print(f"teacher {results['teacher']['heldout_ce']:.4f}, "
          + ", ".join(f"{name} {ce:.4f}" for name, ce in heldout.items()), "(held-out nats/token)")
    for name in KD_VARIANTS:
        assert heldout[name] < heldout["ce"], heldout
