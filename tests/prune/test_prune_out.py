"""``prune --out``: the student never lands on the teacher or beside an older model, and never half-written.

1. ``megatron-kd prune`` refuses, in one line and before any work (before Megatron-LM's validation
   and the CUDA check, which is the line a good --out reaches on this CPU machine): --out that is the
   teacher's directory (the same path, another spelling of it, a link to it), a directory holding
   anything (an older model's config.json / weights), a file, a place it cannot write; the
   teacher's files and the refused directory stay as they were, and a good --out is not created
2. ``write_pruned_hf`` writes into a directory beside --out and renames it into place: into an
   absent or empty directory; a write stopped halfway (an error, a kill) leaves no --out and no
   partial directory; the teacher's own directory and an older model's are refused
"""

import os
from pathlib import Path

import numpy as np
import pytest

from megatron_kd.cli import main
from megatron_kd.prune import KeptParts, PruneError, write_pruned_hf
from tests.fixtures.tiny_gpt_oss import make_tiny_gpt_oss, tiny_flags

NO_CUDA = "needs CUDA GPUs and this machine has none"


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _prune(teacher: Path, out) -> list[str]:
    flags = tiny_flags(teacher)
    i = flags.index("--kd-student-hf")
    return ["prune", *flags[:i], *flags[i + 2:], "--kd-teacher-hf", str(teacher), "--prune-num-experts", "2",
            "--out", str(out)]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-kd: error: ") and "\n" not in err, err
    return err


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory nothing can be created in: read-only by mode, or (as root, whom modes do not stop)
    /sys."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):
        return ro
    try:
        (Path("/sys") / ".megatron-kd-test").mkdir()
    except OSError:
        return Path("/sys")
    pytest.skip("no read-only place here")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a good --out goes on to run on CUDA")
def test_prune_refuses_an_out_that_would_lose_data(tmp_path, capsys):
    teacher = make_tiny_gpt_oss(tmp_path / "teacher")
    capsys.readouterr()  # the fixture's progress bars
    before = _tree(teacher)
    link = tmp_path / "teacher-link"
    link.symlink_to(teacher)
    older = tmp_path / "older"
    older.mkdir()
    (older / "config.json").write_text("{}")
    (older / "model.safetensors").write_bytes(b"older weights")
    older_files = _tree(older)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (teacher, "is the teacher's directory (--kd-teacher-hf"),
        (tmp_path / "teacher" / ".." / "teacher", "is the teacher's directory"),
        (str(teacher) + "/", "is the teacher's directory"),
        (link, "is the teacher's directory"),
        (older, "not empty (holds config.json, model.safetensors); prune writes the student into an empty or absent"),
        (a_file, "a file, not a directory"),
        (a_file / "student", "is a file, not a directory"),
        (_unwritable_dir(tmp_path) / "student", "cannot write in"),
    ]
    for out, message in cases:
        assert main(_prune(teacher, out)) == 2
        err = _one_line(capsys)
        assert f"--out {out}" in err and message in err, err
    assert _tree(teacher) == before and _tree(older) == older_files and a_file.read_text() == "x"
    # absent or empty: checked and accepted (the next line is the machine's), nothing created
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new" / "student", empty):
        assert main(_prune(teacher, out)) == 2
        assert NO_CUDA in _one_line(capsys)
    assert not (tmp_path / "new").exists() and not list(empty.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".megatron-kd-probe")]


def test_the_student_is_renamed_into_place_whole(tmp_path, monkeypatch):
    import megatron_kd.prune.hf_checkpoint as hf_checkpoint

    teacher = make_tiny_gpt_oss(tmp_path / "teacher")
    before = _tree(teacher)
    kept = KeptParts(layers=[0, 1], experts=[[0, 1, 2]] * 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "deep" / "student", empty):
        assert write_pruned_hf(teacher, out, kept) == out
        assert (out / "config.json").is_file() and (out / "prune.json").is_file()
        assert list(out.glob("*.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "empty", "teacher"]  # no partial directory left

    # stopped halfway, after the weights, before the record: no student at --out, nothing beside it
    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(np, "savez_compressed", killed)
    with pytest.raises(KeyboardInterrupt):
        write_pruned_hf(teacher, tmp_path / "killed", kept)
    monkeypatch.undo()
    with pytest.raises(PruneError, match="kept layer 5 is beyond"):  # an error after the weights
        write_pruned_hf(teacher, tmp_path / "bad", KeptParts(layers=[0, 5]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "empty", "teacher"]

    for out, match in [(teacher, "is the teacher's directory"), (tmp_path / "empty", r"not empty \(holds config.json")]:
        with pytest.raises(PruneError, match=match):
            write_pruned_hf(teacher, out, kept)
    assert _tree(teacher) == before
    assert hf_checkpoint.check_student_dir(tmp_path / "fresh", teacher) is None
