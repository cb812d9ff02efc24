"""Shared pytest setup: one run seed, fixed by default, fresh on request, printed for replay.

The run seed (``MEGATRON_KD_TEST_SEED``):
- unset: ``CI_SEED``. CI (``.ci/run``) and a plain ``pytest`` draw the same inputs on every run of
  a commit, so the gate passes or fails by the code alone.
- ``random``: a fresh seed from the OS. ``launch/fresh_seeds.sh`` runs the suite so, a given
  number of times: fresh inputs are how precision defects are found, outside the gate.
- an integer: that seed (a failure's report prints the line that replays it).

Every test starts with torch's, numpy's and Python's global generators seeded from the run seed and
its own node id, so one test replays alone with the inputs it had in the whole run. The ``seed``
fixture hands that per-test seed to tests that build their own generators.

Tests marked ``cuda`` need a GPU: skipped without one, and ``pytest -m cuda tests`` runs them all
on a GPU machine (README, "Tests").
"""

import os
import random
import warnings
import zlib

import numpy as np
import pytest
import torch

# the shared helpers' asserts report their operands as the tests' own do (registered before any is imported)
pytest.register_assert_rewrite("tests.fixtures")

# megatron-core warns at import about Transformer Engine / Apex being absent; that is expected here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

# Without a GPU (CI) the Triton kernels run in Triton's interpreter, so the CPU tests check the very
# kernels the GPU runs, at tiny shapes. Set before any kernel module is imported (jit reads it then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Megatron-LM's training module installs a logging handler on the stderr of the moment it is first
# imported (logging.basicConfig at import). Imported inside a test, that is the test's capture, closed
# when the test ends, and every later Megatron log record prints "--- Logging error ---" into the
# stderr of whichever test runs next (the one-line error checks then see it). Imported here, at
# collection, it writes to pytest's own stderr for the whole run.
import megatron.training.training  # noqa: E402, F401

CI_SEED = 20261202


def _run_seed() -> int:
    value = os.environ.get("MEGATRON_KD_TEST_SEED", "").strip()
    if not value:
        return CI_SEED
    if value == "random":
        return random.SystemRandom().randrange(2**31)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"MEGATRON_KD_TEST_SEED={value!r}: expected an integer, 'random' or unset") from None


_SEED = _run_seed()


def pytest_report_header(config):
    return f"megatron_kd test seed: {_SEED} (replay with MEGATRON_KD_TEST_SEED={_SEED})"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one; `pytest -m cuda` runs them)")
    # pytest-xdist's: tests of one group run on one worker (`--dist loadgroup`), one after another;
    # "gpu_memory" holds the CUDA tests whose references take tens of GiB, so two never meet
    config.addinivalue_line("markers", "xdist_group(name): run on one pytest-xdist worker with its group")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("replay", f"MEGATRON_KD_TEST_SEED={_SEED} .venv/bin/python -m pytest -q '{item.nodeid}'"))


def seed_of_test(nodeid: str) -> int:
    """The per-test seed: the run seed and the test's node id."""
    return (_SEED + zlib.crc32(nodeid.encode())) % 2**31


@pytest.fixture(autouse=True)
def _seed_generators(request):
    s = seed_of_test(request.node.nodeid)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


@pytest.fixture
def seed(request) -> int:
    """The test's seed (torch's global generator is already seeded with it)."""
    s = seed_of_test(request.node.nodeid)
    print(f"run seed {_SEED} (MEGATRON_KD_TEST_SEED={_SEED} replays it), test seed {s}")
    return s
