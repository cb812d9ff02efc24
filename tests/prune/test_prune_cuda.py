"""Healing on a GPU through the CLI, the README's three commands (skipped without CUDA):

1. ``cache build --kd-teacher-hf T``: the teacher's cache over the run's data
2. ``prune --kd-teacher-hf T --prune-num-experts 2``: a student with half the experts, chosen by
   routing mass over the same data
3. ``train --kd-student-hf S --num-experts 2`` on the teacher's cache: the pruned student distills
   (kd loss and teacher mass reported), starting from the teacher's kept experts
"""

import json

import numpy as np
import pytest

from tests.fixtures.cli_utils import run_cli
from tests.fixtures.tiny_gpt_oss import EOD, TOKENIZER_TOKENS, cli_flags, make_tiny_gpt_oss

pytestmark = pytest.mark.cuda


def test_cache_build_prune_distill(tmp_path):
    from megatron_kd.megatron.data import write_indexed_dataset

    teacher = make_tiny_gpt_oss(tmp_path / "teacher")
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(3, TOKENIZER_TOKENS, int(rng.integers(50, 200)))) + [EOD] for _ in range(200)]
    data = str(write_indexed_dataset(tmp_path / "data" / "docs", docs, TOKENIZER_TOKENS))
    cache, student = tmp_path / "cache", tmp_path / "student"
    run_cli(["cache", "build", *cli_flags(tmp_path, data, 2), "--kd-teacher-hf", str(teacher), "--kd-cache", str(cache),
             "--kd-cache-mode", "topk", "--kd-topk", "16"], tmp_path, "build", 1)
    log = run_cli(["prune", *cli_flags(tmp_path, data, 2), "--kd-teacher-hf", str(teacher), "--prune-num-experts", "2",
                   "--prune-calib-samples", "8", "--out", str(student)], tmp_path, "prune", 1)
    assert "--num-experts 2 --kd-student-hf" in log, log[-3000:]
    kept = json.loads((student / "prune.json").read_text())
    assert len(kept["experts"]) == 2 and all(len(e) == 2 for e in kept["experts"])
    assert json.loads((student / "config.json").read_text())["num_local_experts"] == 2
    log = run_cli(["train", *cli_flags(tmp_path, data, 2), "--num-experts", "2", "--kd-student-hf", str(student),
                   "--kd-cache", str(cache), "--lr", "1e-4"], tmp_path, "distill", 1)
    assert "kd loss" in log and "teacher mass" in log, log[-3000:]
