"""The CLI's promise: every user mistake is one line on stderr and exit status 2, before any work;
``train`` / ``cache build`` / ``export-hf`` document their flags with ``--help``."""

import pytest

from megatron_kd.cli import main

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "1"]


@pytest.mark.parametrize("argv, message", [
    (["train"], "missing required flags: --num-layers, --hidden-size"),
    (["cache", "build", "--num-layers", "2"], "missing required flags: --hidden-size"),
    (["export-hf", "--out", "x"], "missing required flags: --num-layers"),
    (["train", *MODEL, "--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
    (["train", *MODEL, "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["train", *MODEL, "--kd-tail", "bogus"], "argument --kd-tail: invalid choice: 'bogus'"),
    (["train", *MODEL, "--global-batch-size", "3"],
     "Megatron-LM rejected the arguments: eval_global_batch_size (3) must be divisible"),
    (["train", *MODEL, "--global-batch-size", "2", "--kd-temperature", "0"], "--kd-temperature must be > 0"),
    (["demo", "--kd-tail", "bogus"], "--kd-tail must be one of"),
    (["demo", "--topk", "0"], "--topk must be >= 1, got 0"),
    (["demo", "--student-hidden", "50"], "--student-hidden (50) must be divisible by --heads (4)"),
])
def test_user_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-kd: error: ") and "\n" not in err, err
    assert message in err, err


@pytest.mark.parametrize("command", [["train"], ["cache", "build"], ["export-hf"]])
def test_megatron_commands_have_help(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--kd-cache" in out and "--kd-tail" in out and "--kd-student-hf" in out
    assert f"megatron-kd {' '.join(command)} --help-megatron" in out
    assert main([*command, "--help-megatron"]) == 0
    assert "--num-layers" in capsys.readouterr().out
