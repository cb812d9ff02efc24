"""What can be checked of the packaging without a Docker engine or a second node.

1. docker/Dockerfile installs exactly setup.py's dependencies (less torch, which is the NGC
   image's own) and its "flash4" extra, and copies only files that exist
2. the launchers start real torchrun jobs on this machine: launch/torchrun.sh and
   launch/multinode.sh (one node, c10d rendezvous) run ``megatron-kd cache inspect`` on a cache,
   named by a path relative to where the command is typed; launch/slurm.sbatch is valid bash
"""

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import torch

from tests.fixtures.dist_utils import free_port

ROOT = Path(__file__).parents[1]


def _setup_requires() -> set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return {ast.literal_eval(e) for e in node.value.elts}
    raise AssertionError("setup.py has no install_requires")


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_dockerfile_pins_agree_with_setup_py():
    runs = [args for op, args in _dockerfile_instructions() if op == "RUN" and "pip install" in args]
    requirements = [r for r in shlex.split(runs[0]) if re.match(r"^[A-Za-z]", r) and r not in ("pip", "install")]
    expected = {r for r in _setup_requires() if not r.startswith("torch")}
    assert set(requirements) == expected
    assert any("--no-deps -e ." in args for args in runs[1:])  # the package itself, without replacing torch


def test_dockerfile_installs_the_flash4_extra():
    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.keyword) and node.arg == "extras_require")
    runs = [shlex.split(args) for op, args in _dockerfile_instructions() if op == "RUN" and "flash-attn-4" in args]
    assert len(runs) == 1 and set(extras["flash4"]) <= set(runs[0])


def test_dockerfile_copies_existing_files():
    copies = [args.split()[:-1] for op, args in _dockerfile_instructions() if op == "COPY"]
    assert copies
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), src


def _tiny_cache(path: Path) -> Path:
    from megatron_kd.cache import CacheWriter
    from tests.fixtures.cache_store import sample_tokens

    with CacheWriter(path, vocab_size=50, topk=4, seq_length=8, num_samples=2) as writer:
        for sample in writer.pending_samples():
            logprobs, ids = torch.log_softmax(torch.randn(8, 50), -1).topk(4, -1)
            writer.write(int(sample), ids, logprobs, tokens=sample_tokens(sample, seq=8, vocab=50))
    return path


def _launch(script: str, args: list[str], cwd: Path | None = None, **env) -> str:
    run_env = {**os.environ, "GPUS": "1", "MASTER_PORT": str(free_port()), **env}
    proc = subprocess.run(["bash", str(ROOT / "launch" / script), *args], capture_output=True, text=True,
                          env=run_env, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_single_node_launcher_runs_a_command(tmp_path):
    out = _launch("torchrun.sh", ["cache", "inspect", str(_tiny_cache(tmp_path / "cache"))])
    assert re.search(r"samples\s+2", out), out


def test_a_relative_path_resolves_where_the_user_stands(tmp_path):
    """A recipe's relative --data-path, --save or --kd-cache names a place below the directory the
    command was typed in, not below this checkout."""
    _tiny_cache(tmp_path / "here")
    out = _launch("torchrun.sh", ["cache", "inspect", "here"], cwd=tmp_path)
    assert re.search(r"samples\s+2", out), out


def test_multinode_launcher_runs_a_command(tmp_path):
    out = _launch("multinode.sh", ["cache", "inspect", str(_tiny_cache(tmp_path / "cache"))],
                  NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", RDZV_ID="test")
    assert re.search(r"samples\s+2", out), out


def test_multinode_launcher_needs_its_variables():
    proc = subprocess.run(["bash", str(ROOT / "launch" / "multinode.sh"), "cache", "inspect", "x"],
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                               if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")})
    assert proc.returncode != 0 and "set NNODES" in proc.stderr


def test_slurm_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "launch" / "slurm.sbatch")], check=True)
