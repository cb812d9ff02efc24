"""The GPU commands end to end through megatron.training (skipped without CUDA; CI is CPU-only).

1. ``megatron-kd train`` without --kd-cache trains a small teacher and saves a Megatron checkpoint
2. ``megatron-kd cache build`` loads it (--load) and writes the cache for a student run's samples
3. ``megatron-kd train --kd-cache`` distills a smaller student; its log reports kd loss
4. a cache built for other data stops the student at start-up: the cache holds none of its samples
5. a distillation killed after 6 of 12 iterations (``--exit-interval``) and relaunched with ``--load``
   continues with the same losses as an uninterrupted run (same samples, same teacher rows); so does
   an MoE student training its experts fake-quantized (``--kd-quant mxfp4``)
Launched with torchrun on 1 GPU (and TP=2 on 2 GPUs when the machine has them), on the local spec and,
where Transformer Engine is installed, on megatron-core's TE spec (1-4 also with packed documents,
TE's THD attention; 5 with a dense student).
"""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures.cli_utils import run_cli

pytestmark = pytest.mark.cuda

SPECS = {"local": "local", "te": "transformer_engine"}  # --transformer-impl of each layer spec
requires_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="megatron-core's TE spec needs Transformer Engine")
# packed documents kept apart (Megatron-LM's flags); on the TE spec attention takes its THD path
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
VOCAB = 256  # --tokenizer-type NullTokenizer --vocab-size 256: ids 0..254, end-of-document 255
EOD = VOCAB - 1


def _data(tmp: Path, seed=0, n_docs=400) -> str:
    from megatron_kd.megatron.data import write_indexed_dataset

    rng = np.random.default_rng(seed)
    # a learnable source: a random order-1 Markov chain over 256 symbols
    trans = rng.dirichlet(np.full(EOD, 0.05), size=EOD)
    docs = []
    for _ in range(n_docs):
        x = [int(rng.integers(EOD))]
        for _ in range(int(rng.integers(100, 400))):
            x.append(int(rng.choice(EOD, p=trans[x[-1]])))
        docs.append(x + [EOD])
    return str(write_indexed_dataset(tmp / f"data{seed}" / "docs", docs, VOCAB))


def _common(data: str, tmp: Path, iters: int, tp: int, spec: str = "local") -> list[str]:
    return [
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--data-path", data, "--split", "90,5,5",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--bf16", "--seed", "7",
        "--transformer-impl", SPECS[spec], "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--no-rope-fusion", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--tensor-model-parallel-size", str(tp), "--eval-iters", "2", "--eval-interval", "1000",
        "--log-interval", "5", "--num-workers", "0", "--calculate-per-token-loss",
        "--data-cache-path", str(tmp / "index-cache"),
    ]


def _model(layers: int, hidden: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--ffn-hidden-size", str(4 * hidden)]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                               reason="needs 2 GPUs"))])
@pytest.mark.parametrize("spec, packing", [pytest.param("local", [], id="local"),
                                           pytest.param("te", [], marks=requires_te, id="te"),
                                           pytest.param("te", PACKED, marks=requires_te, id="te-packed")])
def test_teacher_cache_student_pipeline(tmp_path, tp, spec, packing):
    data = _data(tmp_path)
    common = lambda data, iters: [*_common(data, tmp_path, iters, tp, spec), *packing]  # noqa: E731
    teacher_ckpt = tmp_path / "teacher"
    run_cli(["train", *common(data, 60), *_model(4, 256), "--save", str(teacher_ckpt),
             "--save-interval", "60"], tmp_path, "teacher", tp)

    cache = tmp_path / "cache"
    student_iters = 30
    log = run_cli(["cache", "build", *common(data, student_iters), *_model(4, 256), "--load", str(teacher_ckpt),
                   "--kd-cache", str(cache), "--kd-cache-mode", "topk", "--kd-topk", "16"], tmp_path, "build", tp)
    assert f"{student_iters * 8} samples" in log, log[-3000:]

    log = run_cli(["train", *common(data, student_iters), *_model(2, 128), "--kd-cache", str(cache),
                   "--kd-tail", "ghost", "--tensorboard-dir", str(tmp_path / "tb")], tmp_path, "student", tp)
    assert "kd loss" in log and "teacher mass" in log, log[-3000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))

    other = _data(tmp_path, seed=1)
    log = run_cli(["train", *common(other, student_iters), *_model(2, 128), "--kd-cache", str(cache)],
                  tmp_path, "mismatch", tp, expect_ok=False)
    assert f"this run needs {student_iters * 8} samples; the cache holds 0 of them" in log, log[-3000:]


def _losses(log: str) -> dict[int, float]:
    """iteration -> lm loss, from Megatron's training log lines."""
    return {int(it): float(loss) for it, loss in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)", log)}


def _scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """iteration -> value of a TensorBoard scalar, over every event file in tb_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in sorted(tb_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


# What is compared: Megatron's per-iteration TensorBoard scalars. Its stdout lines are not per
# iteration across a restart: megatron.training logs the first iteration of every run without
# resetting its loss accumulators ("so normal interval stats remain accurate"), so the next line
# averages two iterations. With --log-interval 1 that is iteration 2 of a fresh run and iteration 8
# of the run resumed at 6, which is why the log's iteration 8 reads (l7 + l8) / 2 after the resume.
# Probed on one H200 (2026-11-30, commit 859a96c): the 24 micro-batches of the straight and of the
# killed + resumed runs had identical tokens and teacher rows (hashes), identical loss sums and
# identical parameters (checksums) before each.
# "qad": an MoE student whose grouped experts train fake-quantized to MXFP4 (--kd-quant): the
# quantized forward resumes as exactly as the plain one
QAD_STUDENT = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
               "--kd-quant", "mxfp4"]


@pytest.mark.parametrize("spec, student_flags", [("local", []), ("local", QAD_STUDENT),
                                                 pytest.param("te", [], marks=requires_te)],
                         ids=["dense", "qad", "te"])
def test_killed_distillation_resumes_with_the_same_losses(tmp_path, spec, student_flags):
    data = _data(tmp_path)
    teacher_ckpt = tmp_path / "teacher"
    run_cli(["train", *_common(data, tmp_path, 20, 1, spec), *_model(2, 128), "--save", str(teacher_ckpt),
             "--save-interval", "20"], tmp_path, "teacher", 1)
    cache = tmp_path / "cache"
    run_cli(["cache", "build", *_common(data, tmp_path, 12, 1, spec), *_model(2, 128), "--load", str(teacher_ckpt),
             "--kd-cache", str(cache), "--kd-cache-mode", "topk", "--kd-topk", "16"], tmp_path, "build", 1)
    student = [*_common(data, tmp_path, 12, 1, spec), *_model(2, 64), *student_flags, "--kd-cache", str(cache),
               "--kd-tail", "ghost", "--log-interval", "1"]
    straight_tb, resumed_tb = tmp_path / "tb-straight", tmp_path / "tb-resumed"
    run_cli(["train", *student, "--tensorboard-dir", str(straight_tb)], tmp_path, "straight", 1)
    ckpt = tmp_path / "student"
    resumable = [*student, "--save", str(ckpt), "--save-interval", "6", "--tensorboard-dir", str(resumed_tb)]
    log = run_cli(["train", *resumable, "--exit-interval", "6"], tmp_path, "killed", 1, expect_ok=False)
    assert "exiting program at iteration 6" in log, log[-3000:]
    assert max(_losses(log)) == 6
    run_cli(["train", *resumable, "--load", str(ckpt)], tmp_path, "resumed", 1)
    for tag in ("lm loss", "kd loss", "teacher mass"):
        straight, resumed = _scalars(straight_tb, tag), _scalars(resumed_tb, tag)
        assert sorted(straight) == sorted(resumed) == list(range(1, 13)), (tag, sorted(straight), sorted(resumed))
        for it in range(1, 13):  # same samples, teacher rows and weights: the same numbers
            assert abs(resumed[it] - straight[it]) <= 1e-5 * abs(straight[it]), (tag, it, resumed[it], straight[it])
