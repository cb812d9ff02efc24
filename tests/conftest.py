"""Shared pytest setup: fresh random inputs every run, with the seed printed for replay.

Set MEGATRON_KD_TEST_SEED to replay a failing run.
"""

import os
import random
import zlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # dist_utils and shared input builders

# megatron-core warns at import about Transformer Engine / Apex being absent; that is expected here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

# Without a GPU (CI) the Triton kernels run in Triton's interpreter, so the CPU tests check the very
# kernels the GPU runs, at tiny shapes. Set before any kernel module is imported (jit reads it then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SEED = int(os.environ.get("MEGATRON_KD_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"megatron_kd test seed: {_SEED} (replay with MEGATRON_KD_TEST_SEED={_SEED})"


@pytest.fixture
def seed(request) -> int:
    """A seed derived from the run's seed and the test's id; torch's global RNG is seeded too."""
    s = (_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    print(f"run seed {_SEED} (MEGATRON_KD_TEST_SEED={_SEED} replays it), test seed {s}")
    torch.manual_seed(s)
    return s
