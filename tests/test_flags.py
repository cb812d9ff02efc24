"""``train`` / ``cache build`` stop on a mistake with one line and exit status 2, before any work.

1. every numeric --kd-* flag of add_kd_args, given NaN, ±inf, 0 and -1: one line naming the flag
   and exit 2 wherever its rule (NUMERIC_FLAG_RULES) refuses the value, accepted by the shared
   flag check where the rule allows it; a numeric flag without a rule cannot be added
2. KDConfig refuses the same values when built in code, and the divergence / tail rule
3. a Hugging Face directory with a missing or damaged config.json, weight file or tokenizer: one
   line naming the file, at the flag check
4. on a machine without CUDA, valid flags end in one line saying so (flag mistakes first)
5. argparse mistakes of the CLI's own parsers are one line, not a usage block
6. an unset --eval-interval sizes one evaluation at the end of training
7. a run validates Megatron-LM's arguments once: train starts from what its check validated and
   prints the validation's output then, once
"""

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_kd.cli import main
from megatron_kd.errors import FlagError
from megatron_kd.megatron.args import NUMERIC_FLAG_RULES, KDConfig, _check_rules_cover, add_kd_args
from megatron_kd.megatron.flags import check_megatron_flags
from megatron_kd.megatron.hf_check import HFDirError
from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.tiny_gpt_oss import make_tiny_gpt_oss, tiny_flags

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--no-gradient-accumulation-fusion",
         "--vocab-size", "100", "--train-iters", "1", "--global-batch-size", "2"]
VALUES = ("nan", "inf", "-inf", "0", "-1")
# flags a value needs beside it to be meaningful (--kd-draws counts draws of sampled mode, --kd-topk
# entries of top-K mode)
CONTEXT = {"kd_draws": ["--kd-cache-mode", "sampled"], "kd_topk": ["--kd-cache-mode", "topk"]}
NO_CUDA = "needs CUDA GPUs and this machine has none"


def _numeric_actions():
    parser = add_kd_args(argparse.ArgumentParser())
    return [a for a in parser._actions if a.dest.startswith("kd_") and a.type in (int, float)]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-kd: error: ") and "\n" not in err, err
    return err


def test_every_numeric_kd_flag_has_a_rule():
    assert {a.dest for a in _numeric_actions()} == set(NUMERIC_FLAG_RULES)
    group = argparse.ArgumentParser().add_argument_group()
    group.add_argument("--kd-new-weight", type=float)
    with pytest.raises(RuntimeError, match="kd_new_weight"):
        _check_rules_cover(group)


@pytest.mark.parametrize("action", _numeric_actions(), ids=lambda a: a.option_strings[0])
def test_numeric_kd_flags_refuse_what_makes_no_sense(action, capsys):
    flag, rule = action.option_strings[0], NUMERIC_FLAG_RULES[action.dest]
    for text in VALUES:
        argv = [*MODEL, *CONTEXT.get(action.dest, []), f"{flag}={text}"]
        try:
            value = action.type(text)
        except ValueError:
            value = None  # an int flag given nan / inf: argparse refuses it
        if value is not None and rule.allows(value):
            check_megatron_flags(argv)  # the shared check lets it through
            continue
        for command in (["train"], ["cache", "build", "--kd-cache", "/tmp/unused"]):
            assert main([*command, *argv]) == 2, (command, flag, text)
            err = _one_line(capsys)
            assert flag in err and NO_CUDA not in err, err


@pytest.mark.parametrize("fields, message", [
    ({"temperature": math.nan}, "--kd-temperature must be a finite number > 0, got nan"),
    ({"weight": math.inf}, "--kd-weight must be a finite number >= 0, got inf"),
    ({"ce_weight": -1.0}, "--kd-ce-weight must be a finite number >= 0"),
    ({"chunk_size": 0}, "--kd-chunk-size must be an integer >= 1, got 0"),
    ({"jsd_beta": 1.0}, "--kd-jsd-beta must be a finite number in (0, 1), got 1.0"),
    ({"divergence": "backward"}, "--kd-divergence must be one of ('forward', 'reverse', 'jsd')"),
    ({"divergence": "reverse", "tail": "none"}, "--kd-divergence reverse needs --kd-tail renorm or ghost"),
    ({"divergence": "jsd", "tail": "none"}, "--kd-divergence jsd needs --kd-tail renorm or ghost"),
    ({"cache": "c", "weight": 0.0, "ce_weight": 0.0}, "--kd-weight and --kd-ce-weight are both 0"),
])
def test_kd_config_refuses(fields, message):
    with pytest.raises(FlagError) as e:
        KDConfig(**fields)
    assert message in str(e.value)


def test_kd_config_accepts():
    KDConfig(divergence="jsd", jsd_beta=0.1, tail="ghost")
    KDConfig(divergence="reverse", tail="none", weight=0.0, ce_weight=1.0)  # no KD term: the divergence is unused
    KDConfig(weight=0.0, ce_weight=0.0)  # no cache: the CE-only batches set their own weights


def test_divergence_flags(capsys):
    assert check_megatron_flags([*MODEL, "--kd-divergence", "jsd", "--kd-jsd-beta", "0.25"]).kd_jsd_beta == 0.25
    assert main(["train", *MODEL, "--kd-divergence", "reverse", "--kd-tail", "none"]) == 2
    assert "--kd-divergence reverse needs --kd-tail renorm or ghost" in _one_line(capsys)
    assert main(["train", *MODEL, "--kd-cache-mode", "topk", "--kd-draws", "8"]) == 2
    assert "--kd-draws 8 is for --kd-cache-mode sampled" in _one_line(capsys)


def test_cache_defaults_are_sampled_64(capsys):
    """cache build's default cache: 64 draws per token (README, "Which cache"); --kd-topk only with
    --kd-cache-mode topk."""
    from megatron_kd.megatron.args import cache_entries

    args = check_megatron_flags(MODEL)
    assert (args.kd_cache_mode, cache_entries(args)) == ("sampled", 64)
    assert cache_entries(check_megatron_flags([*MODEL, "--kd-draws", "128"])) == 128
    assert cache_entries(check_megatron_flags([*MODEL, "--kd-cache-mode", "topk"])) == 100
    assert cache_entries(check_megatron_flags([*MODEL, "--kd-cache-mode", "topk", "--kd-topk", "32"])) == 32
    assert main(["cache", "build", *MODEL, "--kd-cache", "/tmp/unused", "--kd-topk", "32"]) == 2
    assert "--kd-topk 32 is for --kd-cache-mode topk" in _one_line(capsys)


# ---------------------------------------------------------------------------- Hugging Face dirs


@pytest.fixture(scope="module")
def hf_template(tmp_path_factory):
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("hf") / "gpt-oss")


def _truncate(path: Path, keep: float = 0.5):
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])


def _safetensors_index(root: Path):
    """Turn the single model.safetensors into a one-shard index naming a second, absent shard."""
    from safetensors import safe_open

    with safe_open(root / "model.safetensors", "pt") as f:
        names = list(f.keys())
    (root / "model.safetensors").rename(root / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root / "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("damage", ["no config", "truncated config", "config without model_type", "no weights",
                                    "truncated weights", "truncated header", "absent shard", "no tokenizer",
                                    "truncated tokenizer"])
def test_broken_hf_dir_is_one_line_naming_the_file(hf_template, tmp_path, damage, capsys):
    root = tmp_path / "hf"
    shutil.copytree(hf_template, root)
    if damage == "no config":
        named = root / "config.json"
        named.unlink()
    elif damage == "truncated config":
        named = root / "config.json"
        _truncate(named)
    elif damage == "config without model_type":
        named = root / "config.json"
        config = json.loads(named.read_text())
        del config["model_type"]
        named.write_text(json.dumps(config))
    elif damage == "no weights":
        named = root
        (root / "model.safetensors").unlink()
    elif damage == "truncated weights":
        named = root / "model.safetensors"
        _truncate(named, 0.9)
    elif damage == "truncated header":
        named = root / "model.safetensors"
        named.write_bytes(named.read_bytes()[:100])
    elif damage == "absent shard":
        named = _safetensors_index(root)
    elif damage == "no tokenizer":
        named = root
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
            (root / name).unlink(missing_ok=True)
    else:
        named = root / "tokenizer.json"
        _truncate(named)
    flags = tiny_flags(root)
    with pytest.raises(HFDirError) as e:
        check_megatron_flags(flags)
    assert str(named) in str(e.value) and "--kd-student-hf" in str(e.value)
    assert main(["train", *flags]) == 2
    assert str(named) in _one_line(capsys)


def test_complete_hf_dirs_pass(hf_template, tmp_path):
    check_megatron_flags(tiny_flags(hf_template))
    root = tmp_path / "hf"
    shutil.copytree(hf_template, root)
    _safetensors_index(root).unlink(missing_ok=True)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"  # every tensor in the one shard
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "tokenizer.json").unlink()
    # the tokenizer comes from elsewhere: the directory needs none
    check_megatron_flags([*tiny_flags(root), "--tokenizer-model", str(hf_template)])


# ---------------------------------------------------------------------------- no CUDA, argparse


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
@pytest.mark.parametrize("command", [["train"], ["cache", "build", "--kd-cache", "/tmp/unused"],
                                     ["export-hf", "--out", "/tmp/unused", "--load", "/tmp"]])
def test_no_cuda_is_one_line_after_the_flag_check(command, capsys, monkeypatch):
    assert main([*command, *MODEL]) == 2
    name = " ".join(c for c in command if not c.startswith("/") and not c.startswith("--"))
    assert _one_line(capsys) == (
        f"megatron-kd: error: megatron-kd {name} needs CUDA GPUs and this machine has none "
        "(torch.cuda.is_available() is False): launch it on a GPU node with torchrun (launch/torchrun.sh); "
        "megatron-kd plan sizes a run on CPU")
    if command[0] == "export-hf":  # one process at tensor-parallel size 1 whatever the flags say
        return
    # tensor parallelism: Megatron-LM's validation asks the GPU's architecture; that is the same line
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    assert main([*command, *MODEL, "--tensor-model-parallel-size", "2"]) == 2
    assert NO_CUDA in _one_line(capsys)
    assert main([*command, *MODEL, "--kd-temperature", "0"]) == 2  # a flag mistake still gets its own line
    assert "--kd-temperature must be" in _one_line(capsys)


@pytest.mark.parametrize("argv, message", [
    (["demo", "--bogus"], "unrecognized arguments: --bogus (see megatron-kd --help)"),
    (["demo", "--topk", "x"], "argument --topk: invalid int value: 'x'"),
    (["cache", "verify"], "the following arguments are required: path (see megatron-kd cache verify --help)"),
    (["cache", "bogus"], "argument cache_command: invalid choice: 'bogus'"),
    (["bogus"], "argument command: invalid choice: 'bogus'"),
    ([], "the following arguments are required: command"),
    (["plan", "--gpus", "x"], "argument --gpus: invalid int value: 'x' (see megatron-kd plan --help)"),
])
def test_argparse_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in _one_line(capsys)


def _eval_interval_worker(rank, world_size):
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_kd.megatron.flags import parse_megatron_args

    with megatron_cpu_patches():
        args = parse_megatron_args([*MODEL[:-4], "--train-iters", "30", "--global-batch-size", "4", "--eval-iters", "2"])
        assert args.eval_interval == 31  # no evaluation during training, one at its end
        assert list(get_train_valid_test_num_samples()) == [120, 8, 8]


def test_an_unset_eval_interval_sizes_one_evaluation_at_the_end():
    """megatron-core 0.19 divides by --eval-interval when it sizes the validation split, though it
    documents an unset one as "no evaluation during training"; every command that builds the
    datasets (cache build, prune, train) would stop there with a TypeError."""
    spawn(_eval_interval_worker, world_size=1)


def test_train_validates_megatron_arguments_once(monkeypatch, capsys):
    """train's check validates Megatron-LM's arguments quietly; the run starts from that namespace and
    shows what the validation printed, once (CUDA and megatron.training's pretrain stubbed)."""
    from megatron.training import arguments, global_vars

    from megatron_kd.megatron import run

    validated, started = [], []
    validate = arguments.validate_args

    def counted(args, defaults={}):
        validated.append(args)
        return validate(args, defaults)

    monkeypatch.setattr(arguments, "validate_args", counted)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "pretrain", lambda args, step=None: started.append(args))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the run sets it to its command line, as Megatron-LM reads it
    global_vars.unset_global_variables()
    try:
        assert main(["train", *MODEL]) == 0
        assert global_vars.get_args() is started[0]
    finally:
        global_vars.unset_global_variables()
    assert len(validated) == 1 and started == validated
    assert capsys.readouterr().out.count("-------- arguments --------") == 1
