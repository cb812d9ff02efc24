"""benchmarks/bench_qad.py's report (the run itself needs a GPU: the quantized experts train in bf16
on the grouped path): the recovery it reports, its table, and its refusals before any work."""

import pytest
import torch

from benchmarks import bench_qad
from benchmarks.common.qad import markdown, recovery


def test_recovery_is_the_fraction_of_the_ptq_loss_won_back():
    assert recovery(bf16=2.0, ptq=2.5, qad=2.1) == pytest.approx(0.8)
    assert recovery(bf16=2.0, ptq=2.5, qad=2.5) == 0.0
    assert recovery(bf16=2.0, ptq=2.5, qad=1.9) == pytest.approx(1.2)  # better than the bf16 student


def test_the_report_names_every_arm_and_the_goal():
    arm = lambda ce, kl, step=None: {"ce": ce, "kl": kl, **({"seconds_per_step": step} if step else {})}  # noqa: E731
    results = {
        "qad": {"experts": 8, "topk": 2, "variant": "sampled64", "base_steps": 800, "more_steps": 120,
                "lr_ratio": 0.3},
        "preset": {"student": {"layers": 6, "hidden": 384, "heads": 6, "ffn": None}},
        "teacher": {"heldout_ce": 3.1},
        "arms": {"bf16": arm(3.5, 0.4, 0.05), "bf16+": arm(3.49, 0.39, 0.05), "ptq-mxfp4": arm(3.7, 0.6),
                 "qad-mxfp4": arm(3.54, 0.44, 0.06)},
        "recovery": {"mxfp4": {"vs_bf16": recovery(3.5, 3.7, 3.54), "vs_bf16_continued": recovery(3.49, 3.7, 3.54)}},
        "goal": {"mxfp4_recovery": recovery(3.5, 3.7, 3.54), "target": 0.8, "met": True},
    }
    text = markdown(results)
    for row in ("| bf16 | 3.5000 | 0.4000 | 50.0 |", "| ptq-mxfp4 | 3.7000 | 0.6000 |  |",
                "| qad-mxfp4 | 3.5400 | 0.4400 | 60.0 |", "| mxfp4 | +0.2000 | 80.0% | 76.2% |",
                "Goal: MXFP4 recovery >= 80%: 80.0%, met."):
        assert row in text, (row, text)


@pytest.mark.parametrize("argv, message", [
    (["--formats", "int4"], "--formats 'int4': name one or more of mxfp4, nvfp4"),
    (["--fraction", "0"], "--fraction 0.0: a fraction of the bf16 run's steps in (0, 1]"),
    (["--set", "students=3"], "'students' is not a preset field"),
])
def test_bad_settings_stop_before_any_work(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench_qad.main([*argv, "--out", str(tmp_path)])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_it_says_so(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench_qad.main(["--out", str(tmp_path)])
    assert stop.value.code == 2 and "the QAD benchmark needs a GPU" in capsys.readouterr().err
