"""The GPU commands end to end through megatron.training (skipped without CUDA; CI is CPU-only).

1. ``megatron-kd train`` without --kd-cache trains a small teacher and saves a Megatron checkpoint
2. ``megatron-kd cache build`` loads it (--load) and writes the cache for a student run's samples
3. ``megatron-kd train --kd-cache`` distills a smaller student; its log reports kd loss
4. a cache built for other data stops the student at start-up with the dataset-fingerprint error
5. a distillation killed after 6 of 12 iterations (``--exit-interval``) and relaunched with ``--load``
   continues with the same losses as an uninterrupted run (same samples, same teacher rows)
Launched with torchrun on 1 GPU (and TP=2 on 2 GPUs when the machine has them).
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_utils import run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

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


def _common(data: str, tmp: Path, iters: int, tp: int) -> list[str]:
    return [
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--data-path", data, "--split", "90,5,5",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--bf16", "--seed", "7",
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
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
def test_teacher_cache_student_pipeline(tmp_path, tp):
    data = _data(tmp_path)
    teacher_ckpt = tmp_path / "teacher"
    run_cli(["train", *_common(data, tmp_path, 60, tp), *_model(4, 256), "--save", str(teacher_ckpt),
          "--save-interval", "60"], tmp_path, "teacher", tp)

    cache = tmp_path / "cache"
    student_iters = 30
    log = run_cli(["cache", "build", *_common(data, tmp_path, student_iters, tp), *_model(4, 256),
                "--load", str(teacher_ckpt), "--kd-cache", str(cache), "--kd-topk", "16"], tmp_path, "build", tp)
    assert f"{student_iters * 8} samples" in log, log[-3000:]

    log = run_cli(["train", *_common(data, tmp_path, student_iters, tp), *_model(2, 128), "--kd-cache", str(cache),
                "--kd-tail", "ghost", "--tensorboard-dir", str(tmp_path / "tb")], tmp_path, "student", tp)
    assert "kd loss" in log and "teacher mass" in log, log[-3000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))

    other = _data(tmp_path, seed=1)
    log = run_cli(["train", *_common(other, tmp_path, student_iters, tp), *_model(2, 128), "--kd-cache", str(cache)],
               tmp_path, "mismatch", tp, expect_ok=False)
    assert "dataset_fingerprint" in log, log[-3000:]


def _losses(log: str) -> dict[int, float]:
    """iteration -> lm loss, from Megatron's training log lines."""
    return {int(it): float(loss) for it, loss in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)", log)}


# Seen on one H200 (2026-11-30): iterations 1-7 and 9-12 match bitwise after the resume, so the
# weights follow the same trajectory, but iteration 8's logged lm loss reads 1.6945e-2 resumed vs
# 1.6388e-2 uninterrupted. Unexplained yet; strict, so the test fails loudly once it is fixed.
@pytest.mark.xfail(strict=True, reason="one logged loss (iteration 8) differs after resume; see comment")
def test_killed_distillation_resumes_with_the_same_losses(tmp_path):
    data = _data(tmp_path)
    teacher_ckpt = tmp_path / "teacher"
    run_cli(["train", *_common(data, tmp_path, 20, 1), *_model(2, 128), "--save", str(teacher_ckpt),
             "--save-interval", "20"], tmp_path, "teacher", 1)
    cache = tmp_path / "cache"
    run_cli(["cache", "build", *_common(data, tmp_path, 12, 1), *_model(2, 128), "--load", str(teacher_ckpt),
             "--kd-cache", str(cache), "--kd-topk", "16"], tmp_path, "build", 1)
    student = [*_common(data, tmp_path, 12, 1), *_model(2, 64), "--kd-cache", str(cache), "--kd-tail", "ghost",
               "--log-interval", "1"]
    straight = _losses(run_cli(["train", *student], tmp_path, "straight", 1))
    ckpt = tmp_path / "student"
    log = run_cli(["train", *student, "--save", str(ckpt), "--save-interval", "6", "--exit-interval", "6"],
                  tmp_path, "killed", 1, expect_ok=False)
    assert "exiting program at iteration 6" in log, log[-3000:]
    first = _losses(log)
    second = _losses(run_cli(["train", *student, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "6"],
                             tmp_path, "resumed", 1))
    assert sorted(straight) == list(range(1, 13)) and max(first) == 6 and sorted(second) == list(range(7, 13))
    for it in range(1, 13):
        resumed = first.get(it, second.get(it))
        assert abs(resumed - straight[it]) <= 1e-2 * abs(straight[it]), (it, resumed, straight[it])
