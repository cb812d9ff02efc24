"""Offline KD inside Megatron-Bridge recipes (``megatron_kd.bridge``), on the CPU over gloo.

1. Bridge's GPT-OSS-20B and Llama-3.2-3B pretraining recipes, shrunk to tiny models on one CPU rank
   (``recipes.py``: sizes, layout, precision and GPU-only kernels; nothing of the loss or data path),
   distilled through ``python -m megatron_kd.bridge pretrain RECIPE --local-spec --kd-*``, train three
   steps with the losses of ``megatron-kd train`` on the same flags (the data flags
   ``python -m megatron_kd.bridge data-flags`` prints), samples and cache: every iteration's lm, kd and
   ce loss and teacher mass equal, bit for bit.
2. Bad input is one line and exit status 2: a recipe whose samples the cache lacks (the data shuffled
   with another seed) when training starts, with no traceback; Bridge's recipe as it ships (mock data,
   nothing a cache could be built from) before Bridge starts; a missing megatron-bridge and an
   unsupported version before Bridge is imported.
3. ``examples/bridge``: each recipe's data flags, as ``data-flags`` prints them, pass megatron-kd's flag
   check with a teacher's model flags, the recipe's sample length and batch kept.

Where Bridge imports Transformer Engine and nvidia-resiliency-ext without using them, they get
stand-ins for those imports alone (``harness.import_bridge`` says which and why); where both frameworks
assume a GPU, ``harness.cpu_training`` redirects to the CPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from megatron_kd.bridge.compat import installed_version
from tests.bridge.harness import ITERS
from tests.fixtures.dist_utils import spawn

needs_bridge = pytest.mark.skipif(
    installed_version() is None, reason="megatron-bridge is not installed (launch/setup.sh installs it with --no-deps)")
KINDS = {"gpt-oss": "gpt_oss", "llama": "llama"}
KD_FLAGS = ["--kd-ce-weight", "0.1"]
ERROR = "python -m megatron_kd.bridge: error: "


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Everything this process writes to stderr (file descriptor 2: logging, warnings, prints) into ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _bridge_child(work: Path):
    """A child process with the recipes' directories and data under ``work``, Bridge imported."""
    from tests.bridge import harness, recipes  # noqa: F401 (recipes: imported before the working directory changes)

    os.chdir(work)
    harness.prepare(work)
    harness.import_bridge()
    from megatron_kd.bridge import cli

    return harness, cli


def _bridge_runs(rank, world, work):
    """The Bridge side of test 1: per recipe, its data flags (the CLI's), a cache of its samples, the
    distilled run; the megatron-kd train command line of the same run for the other side."""
    work = Path(work)
    harness, cli = _bridge_child(work)
    from tests.bridge import recipes

    results = {}
    for kind, recipe in KINDS.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert cli.main(["data-flags", f"tests.bridge.recipes:{recipe}"]) == 0
        data_flags = shlex.split(printed.getvalue())
        cache = work / f"cache-{kind}"
        harness.write_cache(data_flags, cache)
        kd_flags = ["--kd-cache", str(cache), *KD_FLAGS]
        argv = harness.megatron_kd_train_argv(kind, getattr(recipes, recipe)(), kd_flags,
                                              work / f"tb-megatron-kd-{kind}")
        with harness.cpu_training():
            status = cli.main(["pretrain", f"tests.bridge.recipes:{recipe}", "--local-spec", *kd_flags])
        results[kind] = {"status": status, "data_flags": data_flags, "megatron_kd_train": argv,
                         "losses": harness.tensorboard_losses(work / f"tb-bridge-{kind}")}
    (work / "bridge.json").write_text(json.dumps(results))


def _megatron_kd_train_run(rank, world, work, kind):
    from tests.bridge import harness

    work = Path(work)
    argv = json.loads((work / "bridge.json").read_text())[kind]["megatron_kd_train"]
    harness.run_megatron_kd_train(argv)
    losses = harness.tensorboard_losses(work / f"tb-megatron-kd-{kind}")
    (work / f"megatron-kd-{kind}.json").write_text(json.dumps(losses))


@needs_bridge
def test_bridge_recipes_distill_with_the_losses_of_megatron_kd_train(tmp_path):
    spawn(_bridge_runs, str(tmp_path), world_size=1)
    bridge = json.loads((tmp_path / "bridge.json").read_text())
    for kind in KINDS:
        spawn(_megatron_kd_train_run, str(tmp_path), kind, world_size=1)
        megatron_kd = json.loads((tmp_path / f"megatron-kd-{kind}.json").read_text())
        run = bridge[kind]
        assert run["status"] == 0
        assert "--data-path" in run["data_flags"] and run["data_flags"][run["data_flags"].index("--seed") + 1] == "1234"
        assert all(len(values) == ITERS for values in run["losses"].values()), run["losses"]
        # the CE term is in the loss: lm = kd + 0.1 ce (the teacher's share), as in megatron-kd train
        assert run["losses"]["lm loss"] != run["losses"]["kd loss"]
        assert run["losses"] == megatron_kd, (kind, run["losses"], megatron_kd)


def _command_line(rank, world, work):
    """Test 2's and 3's runs of the CLI: each one's status, stdout and what it wrote to stderr."""
    work = Path(work)
    harness, cli = _bridge_child(work)
    from megatron_kd.bridge.flags import megatron_data_flags
    from tests.bridge import recipes

    cache = work / "cache"
    harness.write_cache(megatron_data_flags(recipes.gpt_oss()), cache)
    examples = Path(__file__).parents[2] / "examples" / "bridge"
    os.environ.update(KD_DATA=str(work / "corpus"), KD_TOKENIZER="/models/tokenizer", KD_TRAIN_ITERS="100")
    runs = {"other seed": ["pretrain", "tests.bridge.recipes:gpt_oss_other_seed", "--local-spec", "--kd-cache",
                           str(cache)],
            "mock data": ["pretrain", "megatron.bridge.recipes.gpt_oss:gpt_oss_20b_pretrain_config", "--kd-cache",
                          str(cache)],
            **{example: ["data-flags", f"{examples / 'recipes.py'}:{example}"] for example in EXAMPLES}}
    results = {}
    for name, argv in runs.items():
        printed = io.StringIO()
        with harness.cpu_training(), _stderr_to(work / "stderr"), contextlib.redirect_stdout(printed):
            status = cli.main(argv)
        results[name] = {"status": status, "stdout": printed.getvalue(), "stderr": (work / "stderr").read_text()}
    (work / "command-line.json").write_text(json.dumps(results))


EXAMPLES = {"gpt_oss_20b": {"--seq-length": "4096", "--global-batch-size": "512", "--micro-batch-size": "1"},
            "llama32_3b": {"--seq-length": "8192", "--global-batch-size": "512", "--micro-batch-size": "1"}}


@pytest.fixture(scope="module")
def command_line(tmp_path_factory):
    work = tmp_path_factory.mktemp("command-line")
    spawn(_command_line, str(work), world_size=1)
    return json.loads((work / "command-line.json").read_text())


@needs_bridge
def test_a_recipe_the_cache_cannot_serve_is_one_line(command_line):
    expected = {
        # the cache's 12 samples are the windows of seed 1234; another seed draws others
        "other seed": r"--kd-cache .*/cache: this run needs 12 samples; the cache holds \d+ of them\. The first it "
                      r"lacks is sample \d+: .* build one from this run's data \(megatron-kd cache build\)$",
        "mock data": r"cfg\.dataset is mock data \(no blend, blend_per_split or data_path\)",
    }
    for name, pattern in expected.items():
        run = command_line[name]
        errors = [line for line in run["stderr"].splitlines() if line.startswith(ERROR)]
        assert run["status"] == 2, (name, run["stderr"][-3000:])
        assert len(errors) == 1 and re.search(pattern, errors[0][len(ERROR):]), (name, errors)
        assert "Traceback" not in run["stderr"], (name, run["stderr"][-3000:])


@needs_bridge
def test_the_examples_give_cache_build_their_data_flags(command_line, tmp_path):
    """examples/bridge: each recipe's samples as Megatron-LM data flags, which megatron-kd's own parser and
    check take (with a teacher's model flags), the recipe's sizes kept."""
    from megatron_kd.megatron.flags import check_megatron_flags

    for example, sizes in EXAMPLES.items():
        run = command_line[example]
        assert run["status"] == 0, run["stderr"][-3000:]
        flags = shlex.split(run["stdout"])
        values = dict(zip(flags, flags[1:]))
        assert values["--data-path"].endswith("/corpus") and values["--tokenizer-model"] == "/models/tokenizer"
        assert values["--train-iters"] == "100" and values["--split"] == "9999,8,2" and values["--seed"] == "1234"
        assert {flag: values[flag] for flag in sizes} == sizes
        teacher = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                   "--no-gradient-accumulation-fusion"]  # this machine has no Apex
        parsed = check_megatron_flags([*teacher, *flags, "--kd-cache", str(tmp_path)])
        assert parsed.seq_length == int(sizes["--seq-length"]) and parsed.data_path == [values["--data-path"]]


def _error_line(argv, capsys) -> str:
    from megatron_kd.bridge.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR), lines
    return lines[0][len(ERROR):]


def test_a_missing_megatron_bridge_is_one_line(monkeypatch, capsys):
    # the import system's own mark of an absent module: None in sys.modules
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    line = _error_line(["pretrain", "tests.bridge.recipes:gpt_oss", "--kd-cache", "/data/cache"], capsys)
    assert line == ("megatron-bridge is not installed: megatron_kd.bridge needs megatron-bridge>=0.6.2,<0.7 "
                    "(pip install 'megatron_kd[bridge]')")
    assert not [name for name in sys.modules if name.startswith("megatron.bridge.")]  # nothing of Bridge imported


@needs_bridge
def test_an_unsupported_bridge_version_is_one_line(tmp_path, monkeypatch, capsys):
    # a megatron-bridge 0.7.0 distribution ahead of the installed one on the path: what importlib.metadata reads
    info = tmp_path / "megatron_bridge-0.7.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-bridge\nVersion: 0.7.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _error_line(["data-flags", "tests.bridge.recipes:gpt_oss"], capsys)
    assert line == ("megatron-bridge 0.7.0 is installed: megatron_kd.bridge runs with megatron-bridge>=0.6.2,<0.7 "
                    "(pip install 'megatron-bridge>=0.6.2,<0.7')")
    assert "megatron.bridge" not in sys.modules  # refused before Bridge was imported
