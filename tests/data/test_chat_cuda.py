"""Chat data through the GPU commands (skipped without CUDA; CI is CPU-only): ``data chat`` ->
``train`` (a small teacher) -> ``cache build`` (entries only at the answer tokens, the mask recorded)
-> ``train --kd-cache`` (the student's KD loss on the masked batches), on 1 GPU with torchrun."""

import json
from pathlib import Path

import numpy as np
import pytest
from megatron_kd.cli import main as cli_main
from tests.fixtures.chat_inputs import HARMONY_SPECIALS, save_tokenizer, write_jsonl
from tests.fixtures.cli_utils import run_cli

pytestmark = pytest.mark.cuda


def _flags(tmp: Path, iters: int) -> list[str]:
    return [
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--data-path", str(tmp / "data" / "chat"),
        "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp / "tok"),
        "--bf16", "--seed", "7", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--no-rope-fusion", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "5",
        "--num-workers", "0", "--calculate-per-token-loss", "--data-cache-path", str(tmp / "index-cache"),
        "--reset-attention-mask", "--reset-position-ids",  # conversations kept apart by their EOD
    ]


def _model(layers: int, hidden: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--ffn-hidden-size", str(4 * hidden)]


def test_chat_data_through_cache_build_and_train(tmp_path):
    save_tokenizer(tmp_path / "tok", HARMONY_SPECIALS, eos="<|return|>")
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefgh"))
    lines = []
    for _ in range(400):
        question = "".join(rng.choice(letters, rng.integers(10, 40)))
        lines.append({"messages": [{"role": "user", "content": question},
                                   {"role": "assistant", "reasoning": "copy", "content": question[:12]}]})
    assert cli_main(["data", "chat", "--input", str(write_jsonl(tmp_path / "c.jsonl", lines)), "--output",
                     str(tmp_path / "data" / "chat"), "--seq-length", "128", "--tokenizer-type",
                     "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]) == 0
    sidecar = json.loads((tmp_path / "data" / "chat_chat.json").read_text())

    teacher = tmp_path / "teacher"
    run_cli(["train", *_flags(tmp_path, 40), *_model(2, 128), "--save", str(teacher), "--save-interval", "40"],
            tmp_path, "teacher", 1)
    cache = tmp_path / "cache"
    log = run_cli(["cache", "build", *_flags(tmp_path, 20), *_model(2, 128), "--load", str(teacher),
                   "--kd-cache", str(cache), "--kd-cache-mode", "topk", "--kd-topk", "16"], tmp_path, "build", 1)
    assert "entries only where the loss mask" in log, log[-3000:]
    from megatron_kd.cache.inspect import inspect

    summary = inspect(cache, progress=False)
    assert summary["loss_mask"] == sidecar["mask"]
    fraction = summary["tokens_with_entries"] / summary["tokens"]
    assert 0.2 < fraction < 0.7, summary

    log = run_cli(["train", *_flags(tmp_path, 20), *_model(1, 64), "--kd-cache", str(cache), "--kd-tail", "ghost"],
                  tmp_path, "student", 1)
    assert "kd loss" in log and "teacher mass" in log, log[-3000:]
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "answer_fraction": sidecar["loss_tokens"]
                                                       / sidecar["tokens"]}))
