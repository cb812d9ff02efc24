"""The distillation-fidelity benchmark at CPU size, end to end (``benchmarks/bench_fidelity.py --size cpu``).

A byte-level BPE trained on real text (the installed Python's and packages' files), a megatron-core
teacher, its top-32 cache, and one student architecture trained three ways for the same steps from
the same start: cross-entropy only, online full-vocabulary KD (teacher in memory) and offline fused
top-32 KD (ghost tail). The claim checked is the product's: on the held-out split, which neither
the tokenizer nor any model trained on, every distilled student has lower cross-entropy than the
CE-only one. Seeds are fixed, so the numbers repeat run to run. The run is stopped after its
second student and finished with ``resume=True``, which must keep the teacher, the cache and the
finished students and train only the last one.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fidelity  # noqa: E402

KD_VARIANTS = ("online", "top32-ghost")


class Stop(Exception):
    pass


def test_distilled_students_beat_cross_entropy_on_held_out_text(tmp_path):
    def stop_after_online(msg):
        if "online: held-out" in msg:
            raise Stop

    variants = ["ce", *KD_VARIANTS]
    try:
        bench_fidelity.run("cpu", tmp_path, variants, log=stop_after_online)
        raise AssertionError("the run was to be stopped after the online student")
    except Stop:
        pass
    logs = []
    results = bench_fidelity.run("cpu", tmp_path, variants, log=logs.append, resume=True)
    log = "\n".join(logs)
    assert "resuming" in log and "teacher: loaded" in log, log
    assert "ce: held-out" not in log and "online: held-out" not in log and "top32-ghost: held-out" in log, log
    assert "cache top32" not in log, log  # reused, not rebuilt
    heldout = {name: r["heldout_ce"] for name, r in results["variants"].items()}
    print(f"teacher {results['teacher']['heldout_ce']:.4f}, "
          + ", ".join(f"{name} {ce:.4f}" for name, ce in heldout.items()), "(held-out nats/token)")
    for name in KD_VARIANTS:
        assert heldout[name] < heldout["ce"], heldout
