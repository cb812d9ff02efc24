"""The CLI's promise: every user mistake is one line on stderr and exit status 2, before any work;
``train`` / ``cache build`` / ``export-hf`` document their flags with ``--help``."""

import pytest

from megatron_kd.cli import main

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "1",
         "--no-gradient-accumulation-fusion"]


@pytest.mark.parametrize("argv, message", [
    (["train"], "missing required flags: --num-layers, --hidden-size"),
    (["cache", "build", "--num-layers", "2"], "missing required flags: --hidden-size"),
    (["export-hf", "--out", "x"], "missing required flags: --num-layers"),
    (["train", *MODEL, "--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
    (["train", *MODEL, "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["train", *MODEL, "--kd-tail", "bogus"], "argument --kd-tail: invalid choice: 'bogus'"),
    (["train", *MODEL, "--global-batch-size", "3"],
     "Megatron-LM rejected the arguments: eval_global_batch_size (3) must be divisible"),
    (["train", *MODEL, "--global-batch-size", "2", "--kd-temperature", "0"],
     "--kd-temperature must be a finite number > 0, got 0.0"),
    (["train", *MODEL, "--kd-weight", "nan"], "--kd-weight must be a finite number >= 0, got nan"),
    (["train", *MODEL, "--kd-chunk-size", "0"], "--kd-chunk-size must be an integer >= 1, got 0"),
    (["train", *MODEL, "--kd-divergence", "jsd", "--kd-jsd-beta", "1"], "--kd-jsd-beta must be a finite number in (0, 1)"),
    (["train", *MODEL, "--kd-divergence", "reverse", "--kd-tail", "none"],
     "--kd-divergence reverse needs --kd-tail renorm or ghost"),
    (["train", *MODEL, "--kd-student-hf", "/nonexistent"], "--kd-student-hf /nonexistent: not a directory"),
    (["cache", "build", *MODEL, "--kd-cache-mode", "topk", "--kd-topk", "0"], "--kd-topk must be an integer >= 1, got 0"),
    (["cache", "build", *MODEL, "--kd-topk", "100"], "--kd-topk 100 is for --kd-cache-mode topk (this run's mode is "
                                                     "sampled, the default: --kd-draws sets its draws, 64 unless given)"),
    (["cache", "build", *MODEL, "--kd-capture-temperature", "inf"], "--kd-capture-temperature must be a finite number > 0"),
    (["cache", "build", *MODEL, "--kd-cache-mode", "sampled", "--kd-draws", "0"], "--kd-draws must be an integer >= 1"),
    (["cache", "build", *MODEL, "--kd-cache-mode", "topk", "--kd-cache-codec", "sampled-counts-v1"],
     "--kd-cache-codec sampled-counts-v1 stores draw counts: it needs --kd-cache-mode sampled"),
    (["cache", "build", *MODEL, "--kd-cache-codec", "topk-v9"], "--kd-cache-codec: invalid choice: 'topk-v9'"),
    (["train", *MODEL, "--kd-cache", "/nonexistent"], "--kd-cache /nonexistent: no such directory"),
    (["cache", "build", *MODEL], "cache build needs --kd-cache PATH"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["cache", "verify"], "the following arguments are required: path"),
    (["plan", "--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
    (["plan", "--gpus", "0", "--num-layers", "2"], "--gpus must be >= 1, got 0"),
    (["bogus"], "argument command: invalid choice: 'bogus'"),
    (["demo", "--kd-tail", "bogus"], "--kd-tail must be one of"),
    (["demo", "--topk", "0"], "--topk must be"),  # the demo's own check (its message is the demo's)
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
