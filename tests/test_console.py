"""A quiet command line: the known third-party notices are filtered, rank 0 speaks, --verbose restores.

Warnings are per process, so the commands run as subprocesses:
1. ``plan`` of the 20B recipe: stderr holds our one code-path line and none of the known
   third-party notices; stdout the table
2. the same on rank 1 (env RANK, as torchrun sets it): nothing on stdout or stderr;
   ``--verbose`` brings both back (the table and the notices)
3. on rank 1, a mistake found before any work is left to rank 0 (exit 2, nothing printed);
   ``MEGATRON_KD_VERBOSE=1`` prints it there too, with the notices
4. ``train --help`` and ``cache inspect`` print no notices
In-process: the filters are scoped to the third-party modules and loggers (the same message from
the user's own code still shows), and cover megatron's compile-time SyntaxWarnings.
"""

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_kd.console import KNOWN_LOG_RECORDS, KNOWN_WARNINGS, filter_third_party_notices
from tests.fixtures.tiny_gpt_oss import recipe_flags

# as examples/gpt_oss/distill.sh runs it where Transformer Engine is not installed
PLAN = ["plan", *recipe_flags("20b"), "--transformer-impl", "local", "--vocab-size", "201088", "--bf16",
        "--global-batch-size", "64"]
TRAIN = ["train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--train-iters", "1", "--kd-temperature", "0"]
# what megatron-core prints, without the filters, on a machine without Transformer Engine / Apex
APEX_NOTICE = "Apex is not installed"


def _known(text: str) -> list[str]:
    """The known third-party notices found in ``text``."""
    patterns = [m for _, m, _ in KNOWN_WARNINGS] + list(KNOWN_LOG_RECORDS.values())
    return [p for p in patterns if re.search(p, text)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_kd.cache import CacheWriter
    from tests.fixtures.cache_store import sample_tokens
    from tests.fixtures.kd_inputs import teacher_topk

    cache = tmp_path_factory.mktemp("console") / "cache"
    with CacheWriter(cache, vocab_size=64, topk=4, seq_length=8, num_samples=2,
                     metadata={"tokenizer_fingerprint": "t", "dataset_fingerprint": "d"}) as w:
        for s in w.pending_samples():
            w.write(int(s), *teacher_topk(8, 64, 4), tokens=sample_tokens(s, seq=8, vocab=64))
    cases = {
        "plan": (PLAN, {}),
        "plan rank 1": (PLAN, {"RANK": "1"}),
        "plan rank 1 verbose": (["--verbose", *PLAN], {"RANK": "1"}),
        "train rank 1": (TRAIN, {"RANK": "1"}),
        "train rank 1 verbose": (TRAIN, {"RANK": "1", "MEGATRON_KD_VERBOSE": "1"}),
        "help": (["train", "--help"], {}),
        "inspect": (["cache", "inspect", str(cache), "--json"], {}),
    }
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "MEGATRON_KD_VERBOSE")}
    results = {}
    for name, (argv, env) in cases.items():
        proc = subprocess.run([sys.executable, "-m", "megatron_kd.cli", *argv], env={**base, **env},
                              capture_output=True, text=True, timeout=300)
        results[name] = proc.returncode, proc.stdout, proc.stderr
    return results


def test_plan_prints_its_answer_and_one_line(runs):
    rc, out, err = runs["plan"]
    assert rc == 0 and "fits" in out, err
    assert err.strip() == "megatron_kd: --transformer-impl local: megatron-core local spec with megatron_kd attention " \
                          "and experts", err


def test_other_ranks_are_quiet_unless_verbose(runs):
    rc, out, err = runs["plan rank 1"]
    assert rc == 0 and out == "" and err == "", (out, err)
    rc, out, err = runs["plan rank 1 verbose"]
    assert rc == 0 and "fits" in out and APEX_NOTICE in err, err


def test_rank_0_reports_the_mistakes_found_before_any_work(runs):
    rc, out, err = runs["train rank 1"]  # the same mistake on every rank: rank 0 reports it
    assert rc == 2 and out == "" and err == "", (out, err)
    rc, out, err = runs["train rank 1 verbose"]  # MEGATRON_KD_VERBOSE=1: every rank, and the notices
    assert rc == 2 and "megatron-kd: error (rank 1): --kd-temperature must be" in err and APEX_NOTICE in err, err


@pytest.mark.parametrize("name", ["help", "inspect"])
def test_commands_print_no_third_party_notices(runs, name):
    rc, out, err = runs[name]
    assert rc == 0 and out and not _known(err) and "Warning" not in err, err


def test_filters_are_scoped_to_third_party_modules():
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        filter_third_party_notices()
        # as megatron-core and the compiler raise them: module from the warning site
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                               "backends.py", 34, module="megatron.core.models.backends")
        warnings.warn_explicit("invalid escape sequence '\\-'", SyntaxWarning,
                               "/x/site-packages/megatron/core/inference/kv_block_allocator.py", 426)
        # the same texts from the user's own code stay
        warnings.warn_explicit("Apex is not installed", UserWarning, "train_mine.py", 1, module="train_mine")
        warnings.warn_explicit("invalid escape sequence '\\-'", SyntaxWarning, "/home/me/train_mine.py", 3)
    assert [(w.category, w.filename) for w in seen] == [(UserWarning, "train_mine.py"),
                                                         (SyntaxWarning, "/home/me/train_mine.py")]


def test_log_filter_drops_only_the_known_record():
    filter_third_party_notices()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("something else about GPTModel")
    finally:
        logger.removeHandler(handler)
    assert records == ["something else about GPTModel"]
