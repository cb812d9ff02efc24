"""The heal benchmark end to end at a toy size (``benchmarks/bench_heal.py``; its numbers are for the
CPU and GPU presets): teacher, caches, calibration, cuts, healing.

A cut that keeps every layer and channel is the teacher itself: its held-out metrics before healing
are the teacher's, exactly (KL 0). A real cut starts worse than the teacher, and every variant's
gap closed is reported from the same start.
"""

import math

from benchmarks.common import fidelity, heal
from tests.fixtures.tiny_fidelity import TINY


def test_heal_from_a_cut_teacher(tmp_path):
    preset, variants, device, autocast, out = fidelity._setup(
        "cpu", tmp_path, ["ce", "top8-renorm", "online"], "auto", TINY)
    fidelity._start_process(preset, device)
    bench = heal.HealBench(preset, out, device, autocast, lambda msg: None)
    results = bench.heal({"none": 1.0, "heavy": 0.5}, variants, calib_samples=8)
    teacher = results["teacher"]["heldout_ce"]
    whole, heavy = results["levels"]["none"], results["levels"]["heavy"]
    assert whole["layers"] == [0, 1] and whole["ffn_hidden_size"] == 128
    assert abs(whole["before"]["ce"] - teacher) < 1e-6 and whole["before"]["kl"] < 1e-6, whole["before"]
    assert len(heavy["layers"]) == 1 and heavy["ffn_hidden_size"] == 64
    assert heavy["parameters"] < whole["parameters"]
    assert heavy["before"]["ce"] > teacher and heavy["gap"] > 0
    for name in ("ce", "top8-renorm", "online"):
        assert math.isfinite(heavy["variants"][name]["gap_closed"])
    assert set(results["goal"]["ratios"]["heavy"]) == {"top8-renorm"}
    md = heal.markdown({**results, "preset_name": "tiny"})
    assert "| pruned, before healing |" in md and "| top8-renorm |" in md


def test_resume_keeps_what_a_stopped_run_finished(tmp_path):
    """A run stopped after its first level (results.partial.json and OUT/work kept) resumes where it
    stopped: the teacher loads, the finished level's numbers stay as they were, only the rest trains."""
    def bench(log):
        preset, variants, device, autocast, out = fidelity._setup(
            "cpu", tmp_path, ["ce", "top8-renorm"], "auto", TINY)
        fidelity._start_process(preset, device)
        return heal.HealBench(preset, out, device, autocast, log), variants

    first, variants = bench(lambda msg: None)
    light = first.heal({"light": 0.5}, variants, calib_samples=8)["levels"]["light"]
    lines = []
    second, variants = bench(lines.append)
    assert second.resume()
    results = second.heal({"light": 0.5, "heavy": 0.25}, variants, calib_samples=8)
    assert any("teacher: loaded" in line for line in lines)
    assert not any(line.split("] ", 1)[-1].startswith("cache ") for line in lines)  # caches kept
    trained = [line for line in lines if "held-out cross-entropy" in line and "ms/step" in line]
    assert len(trained) == 2, trained  # the second level's two variants only
    kept = results["levels"]["light"]["variants"]
    assert {k: r["heldout_ce"] for k, r in kept.items()} == {k: r["heldout_ce"] for k, r in light["variants"].items()}
    assert set(results["levels"]["heavy"]["variants"]) == {"ce", "top8-renorm"}
