"""Teacher fingerprints follow the weights' bytes, not their names, sizes or mtimes.

1. a Hugging Face teacher directory (what ``cache build --kd-teacher-hf`` fingerprints): one byte of
   its safetensors changed in place, with the size and mtime kept, gives another fingerprint
2. a Megatron checkpoint (``--load``): the same for a file of the loaded iteration's directory; the
   tracker picks the directory (another iteration, another fingerprint); no tracker is one line
3. split over two gloo ranks, the fingerprint equals the one-process fingerprint
4. an in-memory teacher (HFTeacher without files) is fingerprinted by its tensors
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_kd.errors import UserError
from megatron_kd.teacher.fingerprint import files_fingerprint, hf_fingerprint, megatron_fingerprint
from tests.fixtures.dist_utils import spawn

QUIET = dict(progress=False, log=None)


def _flip_byte_in_place(file: Path, offset_from_end: int = 3) -> None:
    """Change one byte, keeping the size and the mtime (a cheap size+mtime check would pass it)."""
    before = file.stat()
    with open(file, "r+b") as f:
        f.seek(before.st_size - offset_from_end)
        byte = f.read(1)
        f.seek(before.st_size - offset_from_end)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _hf_dir(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_hf_fingerprint_changes_with_one_byte_of_the_weights(tmp_path):
    from megatron_kd.megatron.data import ByteTokenizer
    from megatron_kd.teacher.build import _hf_teacher

    path = _hf_dir(tmp_path)
    first = _hf_teacher(str(path), ByteTokenizer(), "cpu").fingerprint  # the build's own path
    assert first == hf_fingerprint(path, **QUIET)
    assert hf_fingerprint(path, **QUIET) == first  # unchanged files: the same fingerprint
    (weights,) = path.glob("*.safetensors")
    _flip_byte_in_place(weights)
    changed = hf_fingerprint(path, **QUIET)
    assert changed != first and changed.startswith("hf-")
    assert _hf_teacher(str(path), ByteTokenizer(), "cpu").fingerprint == changed
    copy = shutil.copytree(path, tmp_path / "elsewhere")
    assert hf_fingerprint(copy, **QUIET) == changed  # content-addressed: the path is not part of it


def test_hf_fingerprint_refuses_a_directory_without_weights(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"--kd-teacher-hf .*hf: no \*\.safetensors or \*\.bin weight files"):
        hf_fingerprint(tmp_path / "hf", **QUIET)
    with pytest.raises(UserError, match="not a directory"):
        hf_fingerprint(tmp_path / "missing", **QUIET)


def _megatron_checkpoint(root: Path, iteration: int) -> Path:
    """Megatron-LM's torch-format layout: the tracker, iter_NNNNNNN/mp_rank_00/model_optim_rng.pt."""
    directory = root / f"iter_{iteration:07d}" / "mp_rank_00"
    directory.mkdir(parents=True)
    model = {"embedding.word_embeddings.weight": torch.randn(264, 32), "output_layer.weight": torch.randn(264, 32)}
    torch.save({"model": model, "iteration": iteration, "checkpoint_version": 3.0}, directory / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return directory / "model_optim_rng.pt"


def test_megatron_fingerprint_changes_with_one_byte_of_the_loaded_iteration(tmp_path, seed):
    load = tmp_path / "ckpt"
    weights = _megatron_checkpoint(load, 100)
    first = megatron_fingerprint(load, **QUIET)
    assert megatron_fingerprint(load, **QUIET) == first and first.startswith("megatron-")
    _flip_byte_in_place(weights, offset_from_end=weights.stat().st_size // 2)
    changed = megatron_fingerprint(load, **QUIET)
    assert changed != first
    # the tracker names the iteration; its directory (and only it) is read
    shutil.copytree(load / "iter_0000100", load / "iter_0000200")
    (load / "latest_checkpointed_iteration.txt").write_text("200")
    assert megatron_fingerprint(load, **QUIET) not in (first, changed)
    assert megatron_fingerprint(load, ckpt_step=100, **QUIET) == changed
    (load / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(UserError, match="no latest_checkpointed_iteration.txt, so no checkpoint to load"):
        megatron_fingerprint(load, **QUIET)


def _split_worker(rank, world, files, root, expected):
    got = files_fingerprint(root, [Path(f) for f in files], kind="megatron", progress=False, log=None)
    assert got == expected, (rank, got, expected)


def test_fingerprint_split_over_ranks_equals_one_process(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    files = []
    for i, size in enumerate([5000, 300, 70_000, 1, 0]):
        files.append(root / f"__{i}_0.distcp")
        files[-1].write_bytes(os.urandom(size))
    expected = files_fingerprint(root, files, kind="megatron", **QUIET)
    spawn(_split_worker, [str(f) for f in files], str(root), expected, world_size=2)


def test_in_memory_teacher_is_fingerprinted_by_its_tensors():
    transformers = pytest.importorskip("transformers")
    from megatron_kd.teacher import HFTeacher

    config = transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    first = HFTeacher(model).fingerprint
    assert HFTeacher(model).fingerprint == first
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 5] += 1e-3
    assert HFTeacher(model).fingerprint != first  # same config, other weights
