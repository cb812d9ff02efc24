"""benchmarks/bench_node.py's reading of Megatron's log (the full-node runs need 8 GPUs; this runs on CPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_node import data_flags, loss_flags, parse, parse_log  # noqa: E402

# megatron.training's log lines, as printed by a 3-iteration run on an H200 (bench_offload.py)
LOG = """\
 [2026-11-30 11:56:58.358866] iteration        1/       3 | consumed samples:            1 | elapsed time per iteration (ms): 8951.9 | learning rate: 6.666667E-05 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 5440.89 | max allocated: 7168.52 | reserved: 7480.00 | max reserved: 7480.00
 [2026-11-30 11:56:59.263563] iteration        2/       3 | consumed samples:            2 | elapsed time per iteration (ms): 4928.2 | learning rate: 3.333333E-05 |
[Rank 0] (after 2 iterations) memory (MB) | allocated: 5440.89 | max allocated: 7268.52 | reserved: 7480.00 | max reserved: 7480.00
 [2026-11-30 11:57:00.224925] iteration        3/       3 | consumed samples:            3 | elapsed time per iteration (ms): 961.3 | learning rate: 0.000000E+00 |
"""


def test_step_time_skips_the_first_two_lines_and_peak_is_the_largest():
    r = parse_log(LOG)
    # line 1 includes start-up and line 2 averages iterations 1 and 2 (Megatron's first log line
    # does not reset its timers): only iteration 3 is a steady step
    assert r["step_s"] == pytest.approx(0.9613)
    assert r["iteration_s"] == pytest.approx([8.9519, 4.9282, 0.9613])
    assert r["peak_gib"] == pytest.approx(7268.52 / 1024)
    assert not r["oom"]


def test_out_of_memory_is_recognized():
    r = parse_log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 24.55 GiB")
    assert r["oom"] and r["step_s"] is None and r["peak_gib"] is None


def test_cache_and_training_share_the_data_flags(tmp_path):
    opts = parse(["--gpus", "8", "--out", str(tmp_path)])
    flags = data_flags(opts, "/data/random")
    assert flags[flags.index("--global-batch-size") + 1] == "16"  # two micro-batches per GPU
    assert flags[flags.index("--seq-length") + 1] == "32768"
    assert loss_flags("dense", tmp_path) == ["--kd-cache", str(tmp_path), "--kd-impl", "dense"]
    assert loss_flags("ce", None) == ["--kd-ce-impl", "megatron"]
    with pytest.raises(SystemExit):
        parse(["--losses", "fused,bogus"])
