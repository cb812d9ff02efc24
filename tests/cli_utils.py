"""Running the ``megatron-kd`` CLI under torchrun from GPU tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(args: list[str], tmp: Path, name: str, gpus: int, expect_ok=True) -> str:
    """``torchrun --nproc-per-node gpus -m megatron_kd.cli args``; the log goes to tmp/name.log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
           "-m", "megatron_kd.cli", *args]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    if expect_ok:
        assert proc.returncode == 0, f"{name} failed:\n{log[-6000:]}"
    return log
