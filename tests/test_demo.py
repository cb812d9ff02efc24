"""The CPU demo says nothing false and refuses what it cannot run, in one line, before any work.

1. settings: every number of DemoConfig finite and in its range (generic over its fields), the
   divergence and its beta; a workdir that is a file, a corpus too small for the samples asked, a
   size beyond the machine's memory: FlagError before anything is written (and exit status 2)
2. the memory estimate bounds the peak a small demo really reaches, within a factor 1.6; it counts
   the models' parameters with megatron-kd plan's model
3. the cache: never deleted while another demo's writer holds it (other settings included); a
   rerun after the teacher pass reports the cache's real content and the throughput of the run
   that built it; a damaged cache (a file corrupted, a shard deleted) is rebuilt, said in one line;
   the divergence settings reach the loss
(the end-to-end run and the resume after a kill: tests/megatron/test_kd_training.py)
"""

import json
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest

from megatron_kd.cache import CacheBusyError, CacheWriter
from megatron_kd.demo import DemoConfig, check_memory, estimate_peak_bytes, open_cache_writer, run_demo
from megatron_kd.errors import FlagError
from tests.fixtures.cache_store import sample_tokens
from tests.fixtures.kd_inputs import teacher_topk

# a few seconds per run on 2 CPU cores: a few steps of one-layer models. Evaluation reads the whole
# held-out split: 545 KB is 24 files, whose last (5% of the files, by name) is 3,423 tokens
TINY = dict(seq_length=64, micro_batch_size=8, corpus_bytes=545_000, teacher_layers=1, teacher_hidden=32,
            student_layers=1, student_hidden=16, heads=2, teacher_steps=4, student_steps=4, eval_samples=8,
            topk=8, log_interval=2)


def _tiny(workdir, **overrides):
    return DemoConfig(workdir=str(workdir), **{**TINY, **overrides})


# ------------------------------------------------------------------ settings

def _numeric_fields():
    return [f for f in fields(DemoConfig) if type(f.default) in (int, float)]


@pytest.mark.parametrize("name", [f.name for f in _numeric_fields()])
def test_every_numeric_setting_refuses_nan_inf_negative_and_zero(name):
    kind = type(getattr(DemoConfig(), name))
    bad = [-1, 2.5] if kind is int else [float("nan"), float("inf"), -float("inf"), -0.5]
    if name not in ("kd_ce_weight", "seed"):  # 0 is a meaningful value of those two
        bad.append(0)
    for value in bad:
        with pytest.raises(FlagError, match=f"--{name.replace('_', '-')} must be"):
            DemoConfig(**{name: value})


@pytest.mark.parametrize("settings, match", [
    ({"kd_ce_weight": float("nan")}, r"--kd-ce-weight must be finite and in \[0, inf\), got nan"),
    ({"lr": float("nan")}, "--lr must be finite and > 0, got nan"),
    ({"kd_temperature": float("inf")}, "--kd-temperature must be finite and > 0, got inf"),
    ({"seed": 2**32}, r"--seed must be finite and in \[0, 2\^32\)"),
    ({"kd_jsd_beta": 1.0}, r"--kd-jsd-beta must be finite and in \(0, 1\), got 1.0"),
    ({"kd_divergence": "backward"}, "--kd-divergence must be one of"),
    ({"kd_divergence": "reverse", "kd_tail": "none"}, "--kd-divergence reverse needs --kd-tail renorm or ghost"),
    ({"seq_length": True}, "--seq-length must be an integer, got True"),
])
def test_bad_settings_are_one_line(settings, match):
    with pytest.raises(FlagError, match=match):
        DemoConfig(**settings)


def test_divergence_settings_are_accepted():
    cfg = DemoConfig(kd_divergence="jsd", kd_jsd_beta=0.3, kd_tail="renorm")
    assert (cfg.kd_divergence, cfg.kd_jsd_beta) == ("jsd", 0.3)


def _refused_before_any_work(cfg, match):
    with pytest.raises(FlagError, match=match) as info:
        run_demo(cfg, log=lambda _: None)
    assert "\n" not in str(info.value)
    return info


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    _refused_before_any_work(_tiny(tmp_path / "file"), "--workdir .*file is a file, expected a directory")
    _refused_before_any_work(_tiny(tmp_path / "file" / "below"), "is a file, expected a directory")


def test_a_corpus_too_small_for_the_samples_is_refused(tmp_path):
    work = tmp_path / "demo"
    # the held-out split (1 file of 3,423 tokens) holds 53 samples of 64 tokens, none of 5,000
    _refused_before_any_work(_tiny(work, eval_samples=5000), "gives 53 held-out samples, --eval-samples asks 5000")
    _refused_before_any_work(_tiny(work, seq_length=5000, eval_samples=1, micro_batch_size=1),
                             "gives 0 held-out samples, --eval-samples asks 1")
    _refused_before_any_work(_tiny(work, corpus_bytes=1000), "--corpus-bytes 1000 holds 1 standard-library files")
    assert not work.exists()


def test_a_size_beyond_the_machine_memory_is_refused_at_once(tmp_path):
    work = tmp_path / "demo"
    cfg = DemoConfig(workdir=str(work), seq_length=1_000_000)  # `megatron-kd demo --seq-length 1000000`
    info = _refused_before_any_work(cfg, r"--seq-length 1000000 x --micro-batch-size 16 .* needs about [\d,.]+ GiB "
                                         r"of memory, this machine has [\d,.]+ GiB available")
    assert not work.exists()
    assert estimate_peak_bytes(cfg) > 1e12 and info  # > 1 TB: activations of 16 M tokens
    # refused exactly when the estimate passes what is available, with both numbers in the line
    small = _tiny(work, seq_length=1024)
    need = estimate_peak_bytes(small)
    check_memory(small, available=need)
    with pytest.raises(FlagError, match=rf"needs about {need / 2**30:.1f} GiB of memory, this machine has 0\.5 GiB"):
        check_memory(small, available=2**29)


def test_the_memory_check_counts_parameters_with_the_plan():
    """The models' parameters are megatron-kd plan's count of the demo's models given as Megatron-LM
    flags, not a formula of the demo's: 853,632 for the 4 x 128 teacher, whose real GPTModel has
    20,992 more (Megatron-LM's estimator leaves out 9 biases per layer and hidden unit and the
    128 x 128 learned position table)."""
    from megatron_kd.demo import _init_single_process, _model, model_flags, model_parameters
    from megatron_kd.megatron.plan import estimate, plan_args

    args, layout = plan_args(model_flags(4, 128, 4, 128), gpus=1)
    assert model_parameters(4, 128, 4, 128) == sum(estimate(args, layout, gpus=1).params.values()) == 853_632
    _init_single_process()
    real = sum(p.numel() for p in _model(DemoConfig(), 4, 128, 258, seed=0).parameters())
    assert real == 853_632 + 4 * 9 * 128 + 128 * 128


def test_bad_setting_through_the_cli_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_kd.cli", "demo", "--workdir", str(tmp_path / "d"),
                           "--kd-ce-weight", "nan"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "kd-ce-weight" in ln]
    assert len(lines) == 1 and "--kd-ce-weight must be finite" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "d").exists()


# The child's own peak is VmHWM, its address space's high-water mark. Not ru_maxrss: when the
# parent starts the child with vfork, exec folds the parent's high-water mark (the pytest process,
# gigabytes by the end of the suite) into the child's ru_maxrss.
_PEAK_CHILD = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path
    from megatron_kd.demo import DemoConfig, estimate_peak_bytes, run_demo
    cfg = DemoConfig(**json.loads(sys.argv[1]))
    run_demo(cfg, log=lambda _: None)
    peak_kib = int(re.search(r"^VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))
    print(json.dumps({{"peak": peak_kib * 1024, "estimate": estimate_peak_bytes(cfg)}}))
""")


def test_memory_estimate_bounds_a_measured_peak(tmp_path):
    """A demo whose activations dominate (4,096 tokens per micro-batch through a 4 x 128 teacher):
    its peak resident memory is below the estimate and above 1/1.6 of it."""
    settings = {**TINY, "workdir": str(tmp_path / "demo"), "seq_length": 1024, "micro_batch_size": 4,
                "teacher_layers": 4, "teacher_hidden": 128, "heads": 4, "teacher_steps": 1, "student_steps": 1,
                "eval_samples": 2}
    proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD.format(), json.dumps(settings)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["peak"] <= got["estimate"] <= 1.6 * got["peak"], got


# ------------------------------------------------------------------ the cache

VOCAB, K, SEQ, N = 258, 8, 16, 6
_PARAMS = dict(vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=N, micro_batch_size=2, rows_per_shard=3,
               metadata={"tokenizer_fingerprint": "tok", "dataset_fingerprint": "data"})


def _tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_demo_keeps_a_cache_another_writer_holds(tmp_path, seed):
    """The demo starts a cache of other settings again, but never deletes one that another demo
    is writing: with the same settings (the writer's lock is busy) or other ones (every
    partition's lock is taken before anything is deleted), CacheBusyError and every file stays."""
    path = tmp_path / "c"
    holder = CacheWriter(path, **_PARAMS)
    for s in range(3):  # one whole shard on disk, the writer still open
        holder.write(s, *teacher_topk(SEQ, VOCAB, K), tokens=sample_tokens(s, seq=SEQ, vocab=VOCAB))
    before = _tree_bytes(path)
    with pytest.raises(CacheBusyError, match="another writer holds partition 0"):
        open_cache_writer(path, log=lambda _: None, **_PARAMS)
    with pytest.raises(CacheBusyError, match=r"another demo is writing this cache \(it holds .*dp_00000/.writer.lock"):
        open_cache_writer(path, log=lambda _: None, **{**_PARAMS, "topk": K - 1})  # a demo with --topk 7
    assert _tree_bytes(path) == before
    holder.close()
    lines = []
    other = open_cache_writer(path, log=lines.append, **{**_PARAMS, "topk": K + 1})  # other settings: started again
    assert other.meta.topk == K + 1 and len(other.pending_samples()) == N
    other.close()
    assert len(lines) == 1 and "cannot be resumed" in lines[0] and "building it again" in lines[0], lines


def test_demo_keeps_a_cache_it_cannot_write(tmp_path, monkeypatch):
    """A store that is not writable here (CacheWriteError: a read-only mount, a full disk) may be
    fine: the demo stops with that one line and deletes nothing."""
    import megatron_kd.cache as cache_module
    from megatron_kd.cache import CacheWriteError

    path = tmp_path / "c"
    with CacheWriter(path, **_PARAMS) as writer:
        for s in writer.pending_samples():
            writer.write(int(s), *teacher_topk(SEQ, VOCAB, K), tokens=sample_tokens(s, seq=SEQ, vocab=VOCAB))
    before = _tree_bytes(path)

    def not_writable(store, **_):  # what the writer raises on EROFS / ENOSPC (root ignores chmod here)
        raise CacheWriteError(f"{store}/zarr.json: cannot write the cache (Read-only file system)")

    monkeypatch.setattr(cache_module, "CacheWriter", not_writable)
    with pytest.raises(CacheWriteError, match="Read-only file system"):
        open_cache_writer(path, log=lambda _: None, **_PARAMS)
    assert _tree_bytes(path) == before


def _results(work):
    return json.loads((work / "results.json").read_text())


def _one_line_about(lines, word):
    found = [ln for ln in lines if "teacher cache" in ln and word in ln]
    assert len(found) == 1, lines
    return found[0]


def test_rerun_reports_the_cache_it_found_and_rebuilds_a_damaged_one(tmp_path):
    """One workdir, four runs: built; run again (the pass skipped: the cache's own content and the
    first run's throughput are reported); a shard file corrupted (verified, found, rebuilt); a shard
    file deleted (the writer finds it missing: those samples computed again)."""
    work = tmp_path / "demo"
    cfg = _tiny(work, kd_divergence="jsd", kd_jsd_beta=0.3, kd_tail="renorm")
    lines = []
    reference = run_demo(cfg, log=lines.append)
    first = reference["teacher_pass"]
    assert first["status"] == "built" and first["samples"] == first["samples_computed_now"] == 4 * 8
    assert any("divergence=jsd (beta 0.3), tail=renorm" in ln for ln in lines), lines

    lines.clear()
    again = run_demo(cfg, log=lines.append)["teacher_pass"]
    assert again == _results(work)["teacher_pass"]
    assert again["status"] == "skipped" and again["samples_computed_now"] == 0
    for key in ("samples", "tokens", "mean_teacher_mass", "tokens_per_s", "seconds", "bytes"):
        assert again[key] == first[key], key
    assert again["samples"] == 32 and again["tokens"] == 32 * 64 and 0 < again["mean_teacher_mass"] <= 1.0
    (line,) = [ln for ln in lines if ln.startswith("[3/5]")]
    assert "teacher pass skipped" in line and "32 samples, 2,048 tokens" in line
    assert f"mean top-K mass {first['mean_teacher_mass']:.3f}" in line
    assert f"built at {first['tokens_per_s']:,.0f} tokens/s" in line

    cache = work / "teacher-cache"
    (logprobs,) = [p for p in (cache / "dp_00000" / "logprobs" / "c").rglob("*") if p.is_file()]
    data = bytearray(logprobs.read_bytes())  # one byte changed, the size kept
    data[len(data) // 2] ^= 0xFF
    logprobs.write_bytes(bytes(data))
    lines.clear()
    rebuilt = run_demo(cfg, log=lines.append)
    damaged = _one_line_about(lines, "damaged")
    assert "is damaged" in damaged and "building it again" in damaged
    assert rebuilt["teacher_pass"]["status"] == "built" and rebuilt["curves"] == reference["curves"]

    (ids,) = [p for p in (cache / "dp_00000" / "ids" / "c").rglob("*") if p.is_file()]
    ids.unlink()
    lines.clear()
    repaired = run_demo(cfg, log=lines.append)
    assert "computing their 32 samples again" in _one_line_about(lines, "damaged")
    assert repaired["heldout"] == reference["heldout"] and repaired["teacher_pass"]["samples"] == 32
    assert repaired["teacher_pass"]["mean_teacher_mass"] == pytest.approx(first["mean_teacher_mass"], rel=1e-6)
