"""``data chat`` and ``data text`` never delete or overwrite a user's file: existing output refused
without --overwrite, a failed or killed re-run leaves the old dataset byte for byte, the files moved
into place at the end (the sidecar last), no temporary file left; bad --output paths as one line
before any work; a chat sidecar's ``loss_mask`` is a name beside the tokens, never a path."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_kd.cli import main as cli_main
from tests.fixtures.chat_inputs import HARMONY_SPECIALS, megatron_tokenizer, save_tokenizer, write_jsonl

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
OTHER = {"messages": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao, see you"}]}
SUFFIXES = {"chat": ["", ".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx", "_chat.json"],
            "text": ["", ".bin", ".idx", "_text.json"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return megatron_tokenizer(save_tokenizer(tmp_path_factory.mktemp("harmony"), HARMONY_SPECIALS, eos="<|return|>"))


def _input(path: Path, command: str, lines: list) -> Path:
    if command == "text":
        lines = [ln if isinstance(ln, str) else {"text": ln["messages"][1]["content"]} for ln in lines]
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _argv(command, tokenizer, inp, out, *flags):
    return ["data", command, "--input", str(inp), "--output", str(out), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tokenizer.path), *flags]


def _snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _one_line(capsys, pattern):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("megatron-kd: error:") and re.search(pattern, err[0]), err


def _written(tmp_path, command, tokenizer, lines=(GOOD,), name="data"):
    out = tmp_path / "out"
    assert cli_main(_argv(command, tokenizer, _input(tmp_path / "first.jsonl", command, list(lines)),
                          out / name)) == 0
    return out, _snapshot(out)


@pytest.mark.parametrize("command", ["chat", "text"])
def test_existing_dataset_refused_then_replaced_with_overwrite(tokenizer, tmp_path, capsys, command):
    out, before = _written(tmp_path, command, tokenizer)
    assert sorted(before) == sorted(f"data{s}" for s in SUFFIXES[command][1:])
    second = _input(tmp_path / "second.jsonl", command, [OTHER, OTHER])
    capsys.readouterr()
    assert cli_main(_argv(command, tokenizer, second, out / "data")) == 2
    _one_line(capsys, r"--output \S*data: \S*data\.bin, .* already exist; pass --overwrite")
    assert _snapshot(out) == before
    assert cli_main(_argv(command, tokenizer, second, out / "data", "--overwrite")) == 0
    after = _snapshot(out)
    assert sorted(after) == sorted(before) and after[f"data_{command}.json"] != before[f"data_{command}.json"]
    assert after["data.bin"] != before["data.bin"]
    assert all(os.stat(out / name).st_mode & 0o777 == 0o666 & ~_umask() for name in after)  # not mkstemp's 0600


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("command", ["chat", "text"])
@pytest.mark.parametrize("failure", ["typo in --input", "bad line", "interrupted"])
def test_failed_rerun_leaves_the_old_dataset_and_no_temporary_file(tokenizer, tmp_path, capsys, monkeypatch,
                                                                   command, failure):
    out, before = _written(tmp_path, command, tokenizer)
    lines = [OTHER, "{\"messages\": [}" if command == "chat" else "{\"text\": }", OTHER]
    bad = _input(tmp_path / "bad.jsonl", command, lines if failure == "bad line" else [OTHER, OTHER, OTHER])
    if failure == "typo in --input":
        bad = tmp_path / "bda.jsonl"
    if failure == "interrupted":  # Ctrl-C on the second document
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        add, calls = IndexedDatasetBuilder.add_document, []

        def add_then_interrupt(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 2:
                raise KeyboardInterrupt
            return add(self, *args, **kwargs)

        monkeypatch.setattr(IndexedDatasetBuilder, "add_document", add_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            cli_main(_argv(command, tokenizer, bad, out / "data", "--overwrite"))
    else:
        capsys.readouterr()
        assert cli_main(_argv(command, tokenizer, bad, out / "data", "--overwrite")) == 2
        typo = failure == "typo in --input"
        _one_line(capsys, r"bda\.jsonl: cannot read it" if typo else r"bad\.jsonl:2: not a JSON")
    assert _snapshot(out) == before  # the same files, byte for byte, and nothing else (no .partial)


@pytest.mark.parametrize("command", ["chat", "text"])
def test_killed_run_leaves_the_old_dataset_whole(tokenizer, tmp_path, command):
    """A process killed midway (no Python cleanup at all) leaves the old files as they were; its own
    files are only hidden temporaries beside them."""
    out, before = _written(tmp_path, command, tokenizer)
    bad = _input(tmp_path / "many.jsonl", command, [OTHER] * 5)
    script = (
        "import os, sys\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder\n"
        "add, calls = IndexedDatasetBuilder.add_document, []\n"
        "def killed(self, *a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 3: os._exit(9)\n"
        "    return add(self, *a, **k)\n"
        "IndexedDatasetBuilder.add_document = killed\n"
        "from megatron_kd.cli import main\n"
        f"main({_argv(command, tokenizer, bad, out / 'data', '--overwrite')!r})\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True).returncode == 9
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if not k.startswith(".")} == before
    assert all(re.fullmatch(r"\.data.*\.partial", k) for k in after if k not in before), sorted(after)


@pytest.mark.parametrize("command", ["chat", "text"])
def test_terminated_run_removes_its_temporary_files(tokenizer, tmp_path, command):
    """``kill`` (SIGTERM) midway: the old files as they were, and no temporary file left."""
    out, before = _written(tmp_path, command, tokenizer)
    many = _input(tmp_path / "many.jsonl", command, [OTHER] * 5)
    script = (
        "import os, signal\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder\n"
        "add, calls = IndexedDatasetBuilder.add_document, []\n"
        "def terminated(self, *a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 3: os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return add(self, *a, **k)\n"
        "IndexedDatasetBuilder.add_document = terminated\n"
        "from megatron_kd.cli import main\n"
        f"main({_argv(command, tokenizer, many, out / 'data', '--overwrite')!r})\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True).returncode == 143
    assert _snapshot(out) == before


def test_commit_moves_the_sidecar_last_and_removes_the_old_one_first(tokenizer, tmp_path, monkeypatch):
    from megatron_kd.data import chat

    out, _ = _written(tmp_path, "chat", tokenizer)
    events = []
    replace, unlink = os.replace, Path.unlink
    monkeypatch.setattr(chat.os, "replace", lambda a, b: (events.append(("replace", Path(b).name)), replace(a, b)))

    def recording_unlink(self, missing_ok=False):
        if not self.name.endswith(".partial"):
            events.append(("unlink", self.name))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", recording_unlink)
    chat.build_chat_dataset(write_jsonl(tmp_path / "o.jsonl", [OTHER]), out / "data", tokenizer,
                            chat.MaskSettings(), overwrite=True)
    assert events == [("unlink", "data_chat.json"), ("replace", "data.bin"), ("replace", "data.idx"),
                      ("replace", "data_loss_mask.bin"), ("replace", "data_loss_mask.idx"),
                      ("replace", "data_chat.json")]


@pytest.mark.parametrize("command", ["chat", "text"])
@pytest.mark.parametrize("case", ["directory", "trailing slash", "parent is a file", "under a file",
                                  "not writable"])
def test_bad_output_is_one_line_before_any_work(tokenizer, tmp_path, capsys, monkeypatch, command, case):
    inp = _input(tmp_path / "in.jsonl", command, [GOOD])
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("a file\n")
    output, pattern = {
        "directory": (str(tmp_path / "dir"), r"--output \S*dir: is a directory; expected a file prefix"),
        "trailing slash": (str(tmp_path / "new") + "/", r"--output \S*new/: is a directory; expected a file prefix"),
        "parent is a file": (str(tmp_path / "file" / "data"), r"\S*file is a file, expected a directory"),
        "under a file": (str(tmp_path / "file" / "sub" / "data"), r"\S*file is a file, expected a directory"),
        "not writable": (str(tmp_path / "dir" / "data"), r"--output \S*data: cannot write in \S*dir \(Permission"),
    }[case]
    if case == "not writable":  # as root a read-only directory is writable: refuse creating files in it instead
        from megatron_kd.data import chat

        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(tmp_path / "dir"))

        monkeypatch.setattr(chat.tempfile, "mkstemp", refused)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer.path)]
    assert cli_main(["data", command, "--input", str(inp), "--output", output, *flags]) == 2
    _one_line(capsys, pattern)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, beside it either
    if case != "not writable":  # the output is checked before the tokenizer is loaded
        no_tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "nowhere")]
        assert cli_main(["data", command, "--input", str(inp), "--output", output, *no_tokenizer]) == 2
        _one_line(capsys, pattern)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_read_only_directory_is_one_line(tokenizer, tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    try:
        capsys.readouterr()
        assert cli_main(_argv("chat", tokenizer, _input(tmp_path / "in.jsonl", "chat", [GOOD]),
                              tmp_path / "ro" / "data")) == 2
        _one_line(capsys, r"cannot write in \S*ro \(permission denied\)")
        assert not list((tmp_path / "ro").iterdir())
    finally:
        os.chmod(tmp_path / "ro", 0o755)


@pytest.mark.parametrize("value", ["../elsewhere/data_loss_mask", "/tmp/data_loss_mask", "other_loss_mask",
                                   "sub/data_loss_mask"])
def test_sidecar_loss_mask_is_a_name_beside_the_tokens(tokenizer, tmp_path, value):
    from megatron_kd.megatron.loss_mask import LossMaskError, read_sidecar

    out, _ = _written(tmp_path, "chat", tokenizer)
    assert read_sidecar(out / "data")["loss_mask"] == "data_loss_mask"
    sidecar = json.loads((out / "data_chat.json").read_text())
    (out / "data_chat.json").write_text(json.dumps({**sidecar, "loss_mask": value}))
    with pytest.raises(LossMaskError, match=rf"data_chat\.json: field 'loss_mask' is {re.escape(repr(value))}, "
                                            r"expected 'data_loss_mask'"):
        read_sidecar(out / "data")
