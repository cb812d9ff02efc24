"""The teacher pass: the cache equals torch.topk of the teacher's own full log-softmax.

1. megatron-core GPT teacher on gloo at TP=1 and TP=2 (padded vocabulary rows excluded)
2. sampled mode: the draws follow the teacher's distribution (chi-square), TP=2 draws the very
   tokens TP=1 does, and the draws are splitmix64 of (seed, sample, position) as documented
3. a pass killed with SIGKILL and re-run ends with a byte-identical store; a sampled pass killed
   mid-micro-batch and resumed, or run with other micro-batch and chunk sizes, too
4. a tiny transformers causal LM (random weights, built here) gives its own top-K
"""

import contextlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_kd.cache import CacheReader, CacheWriter
from megatron_kd.megatron.data import ByteTokenizer
from megatron_kd.ops.teacher.sample import draw_uniforms, sample_row_keys, splitmix64, vocab_parallel_sample
from megatron_kd.teacher import CaptureConfig, HFTeacher, MegatronTeacher, capture_teacher
from tests.fixtures.codec_bounds import assert_within_codec
from tests.fixtures.dist_utils import init_tensor_parallel, megatron_cpu_patches, spawn
from tests.fixtures.tiny_teacher import K, SEQ, make_dataset, tiny_model

VOCAB = ByteTokenizer().vocab_size  # 258 real tokens; rows 258..263 are padding


def _full_topk(model, dataset, samples, tp_group):
    """Reference: the model's ordinary forward, logits gathered over TP, log-softmax, topk."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens = torch.stack([dataset[s]["tokens"] for s in samples])
    pos = torch.stack([dataset[s]["position_ids"] for s in samples])
    with torch.no_grad():
        logits = model(tokens, pos, None)  # [b, s, V_local]
        if tp_group is not None and tp_group.size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)
    lp = torch.log_softmax(logits[..., :VOCAB].double(), -1)
    return lp.topk(K, -1)


def _capture_worker(rank, world, tmp):
    with megatron_cpu_patches():
        group = init_tensor_parallel(world)
        dataset = make_dataset(tmp)
        model = tiny_model(world)
        writer = None
        if rank == 0:
            writer = CacheWriter(f"{tmp}/cache", vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=len(dataset),
                                 rows_per_shard=4)
        teacher = MegatronTeacher(model, tp_group=group, vocab_size=VOCAB)
        summary = capture_teacher(teacher, dataset, writer, CaptureConfig(topk=K, micro_batch_size=3, chunk_size=7),
                                  progress=False)
        assert summary["samples"] == len(dataset) and summary["tokens"] == len(dataset) * SEQ
        ref_lp, ref_ids = _full_topk(model, dataset, list(range(len(dataset))), group)
        if rank == 0:
            assert writer.close()
            reader = CacheReader(f"{tmp}/cache")
            ids, lps = reader.read(range(len(dataset)))
            # the cache stores entries sorted by id: compare as sorted sets
            got_ids, order = ids.long().sort(-1)
            got_lps = lps.gather(-1, order)
            want_ids, worder = ref_ids.sort(-1)
            want_lps = ref_lp.gather(-1, worder)
            assert torch.equal(got_ids, want_ids)
            assert_within_codec(got_lps, want_lps, reader.meta.codec, slack=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_teacher_cache_equals_full_topk(tmp_path, seed, tp):
    make_dataset(tmp_path)  # build the index caches once, before the ranks read them
    spawn(_capture_worker, str(tmp_path), world_size=tp)


def _sample_worker(rank, world, seed):
    with megatron_cpu_patches() if world > 1 else contextlib.nullcontext():
        group = init_tensor_parallel(world) if world > 1 else None
        torch.manual_seed(seed)
        vocab, n_tok, draws = 12, 3000, 16
        hidden = torch.randn(1, 8, dtype=torch.float64).expand(n_tok, 8)
        weight = torch.randn(vocab, 8, dtype=torch.float64) * 1.5
        shard = weight.chunk(world)[rank]
        keys = sample_row_keys(seed, torch.arange(n_tok), 1)[0]  # [n_tok]: one position of n_tok samples
        ids, lps = vocab_parallel_sample(hidden, shard, draws, row_keys=keys, tp_group=group, chunk_size=500)
        assert ids.shape == (n_tok, draws)
        counts = torch.where(ids >= 0, lps.exp(), 0.0) * draws
        assert torch.allclose(counts.sum(-1), torch.full((n_tok,), float(draws)), atol=1e-4)
        valid = ids >= 0
        assert (ids[valid] < vocab).all()
        # n_tok·draws = 48,000 independent draws from p: a chi-square test over the tokens expected at
        # least 5 times, the others pooled into one bin (a token expected 0.03 times and drawn twice
        # adds 111 to the sum alone: the statistic is not chi-square distributed there)
        observed = torch.zeros(vocab, dtype=torch.float64).scatter_add_(0, ids[valid], counts[valid].double())
        expected = torch.softmax(hidden[0] @ weight.t(), -1) * n_tok * draws
        rare = expected < 5
        if rare.any():
            observed = torch.cat([observed[~rare], observed[rare].sum().reshape(1)])
            expected = torch.cat([expected[~rare], expected[rare].sum().reshape(1)])
        chi2 = ((observed - expected) ** 2 / expected).sum()
        p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2.0, dtype=torch.float64), chi2 / 2)
        assert p_value > 1e-6, (chi2, observed, expected)
        # TP=2 draws the tokens TP=1 does (fp64 logits: rounding never moves an inverse-CDF boundary here)
        alone = vocab_parallel_sample(hidden, weight, draws, row_keys=keys, chunk_size=700)
        assert torch.equal(ids, alone[0]) and torch.equal(lps, alone[1])


@pytest.mark.parametrize("tp", [1, 2])
def test_sampled_mode_matches_teacher_distribution(seed, tp):
    if tp == 1:
        _sample_worker(0, 1, seed)
    else:
        spawn(_sample_worker, seed, world_size=2)


def test_sample_draws_are_splitmix64_of_seed_sample_and_position():
    """The documented construction, against a plain-Python splitmix64 (torch's int64 wraps like
    uint64; its >> is arithmetic and must be masked)."""
    mask = (1 << 64) - 1

    def mix(x):
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & mask
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & mask
        return x ^ (x >> 31)

    def absorb(state, value):
        return mix(((state ^ (value & mask)) + 0x9E3779B97F4A7C15) & mask)

    words = [0, 1, 12345, -1, -(1 << 63), (1 << 63) - 1]
    assert [w & mask for w in splitmix64(torch.tensor(words)).tolist()] == [mix(w & mask) for w in words]
    seed, samples, seq = 1234, torch.tensor([7, 1 << 40]), 3
    keys = sample_row_keys(seed, samples, seq)
    assert keys.shape == (seq, 2)
    for i, sample in enumerate(samples.tolist()):
        for pos in range(seq):
            key = absorb(absorb(absorb(0, seed), sample), pos)
            assert keys[pos, i].item() & mask == key
            u = draw_uniforms(keys[pos, i], 4).tolist()
            assert u == [(mix((key + j * 0x9E3779B97F4A7C15) & mask) >> 11) * 2.0 ** -53 for j in range(1, 5)]


class _StoppedTeacher:
    """A teacher whose forward raises after ``batches`` micro-batches (a kill, in process)."""

    def __init__(self, teacher, batches):
        self.teacher, self.batches = teacher, batches
        self.model, self.tp_group, self.vocab_size = teacher.model, teacher.tp_group, teacher.vocab_size

    def __call__(self, *inputs):
        if self.batches is not None:
            if self.batches == 0:
                raise KeyboardInterrupt("killed")
            self.batches -= 1
        return self.teacher(*inputs)


_SAMPLED = dict(vocab_size=VOCAB, topk=K, seq_length=SEQ, rows_per_shard=3, micro_batch_size=2,
                metadata={"mode": "sampled", "sampled_draws": K})


def _sampled_store(path, dataset, *, mbs, chunk_size=None, stop_after_batches=None):
    """A sampled pass with CaptureConfig(micro_batch_size=mbs, chunk_size=...); the writer's layout
    (micro-batch size 2, shards of 3 rows) is the same for every store compared. Stopped after
    ``stop_after_batches`` micro-batches, its buffered rows are lost as in a crash."""
    teacher = _StoppedTeacher(MegatronTeacher(tiny_model(1), vocab_size=VOCAB), stop_after_batches)
    cfg = CaptureConfig(draws=K, mode="sampled", micro_batch_size=mbs, chunk_size=chunk_size, seed=99)
    with contextlib.suppress(KeyboardInterrupt), CacheWriter(path, num_samples=16, **_SAMPLED) as writer:
        capture_teacher(teacher, dataset, writer, cfg, progress=False)


def _tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _resume_worker(rank, world, tmp):
    with megatron_cpu_patches():
        init_tensor_parallel(world)
        dataset = make_dataset(tmp, num_samples=16)
        _sampled_store(f"{tmp}/ref", dataset, mbs=2)
        # stopped after 2 micro-batches: shard 0 (rows 0-2) on disk, row 3 lost; the resumed pass
        # starts at sample 3, mid-micro-batch, so its micro-batches are [3, 4], [5, 6], ...
        _sampled_store(f"{tmp}/resumed", dataset, mbs=2, stop_after_batches=2)
        assert not CacheReader(f"{tmp}/resumed", allow_incomplete=True).meta.complete
        with CacheWriter(f"{tmp}/resumed", num_samples=16, **_SAMPLED) as pending:
            assert pending.pending_samples()[0] == 3
        _sampled_store(f"{tmp}/resumed", dataset, mbs=2)
        _sampled_store(f"{tmp}/regrouped", dataset, mbs=3, chunk_size=5)
        reference = _tree_bytes(f"{tmp}/ref")
        assert _tree_bytes(f"{tmp}/resumed") == reference
        assert _tree_bytes(f"{tmp}/regrouped") == reference


def test_sampled_pass_is_the_same_however_it_is_batched_or_stopped(tmp_path):
    make_dataset(tmp_path, num_samples=16)
    spawn(_resume_worker, str(tmp_path), world_size=1)


_KILLABLE_PASS = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from megatron_kd.distributed import init_process_group
    init_process_group("gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1)
    from megatron_kd.cache import CacheWriter
    from megatron_kd.teacher import CaptureConfig, MegatronTeacher, capture_teacher
    from tests.fixtures.tiny_teacher import K, SEQ, make_dataset, tiny_model
    dataset = make_dataset({tmp!r}, num_samples=16)
    writer = CacheWriter({path!r}, vocab_size=258, topk=K, seq_length=SEQ, num_samples=16, rows_per_shard=3,
                         metadata={{"mode": "{mode}"}})

    class Slow:  # a teacher slow enough to be killed mid-pass
        def __init__(self, t):
            self.t, self.tp_group, self.vocab_size, self.model = t, t.tp_group, t.vocab_size, t.model
        def __call__(self, *a):
            print("batch", flush=True)
            time.sleep(0.1)
            return self.t(*a)

    capture_teacher(Slow(MegatronTeacher(tiny_model(1), vocab_size=258)), dataset, writer,
                    CaptureConfig(topk=K, draws=K, mode="{mode}", micro_batch_size=2), progress=False)
    writer.close()
""")


def _run_pass(tmp, path, mode, kill_after=None):

    script = _KILLABLE_PASS.format(tmp=str(tmp), path=str(path), mode=mode)
    # from the repository root, where the child finds tests.fixtures
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parents[2])
    batches = 0
    for line in child.stdout:
        batches += line.startswith("batch")
        if kill_after is not None and batches == kill_after:
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    return child.returncode


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_killed_pass_resumes_byte_identical(tmp_path, seed, mode):
    make_dataset(tmp_path, num_samples=16)
    assert _run_pass(tmp_path, tmp_path / "ref", mode) == 0
    assert _run_pass(tmp_path, tmp_path / "resumed", mode, kill_after=5) == -signal.SIGKILL
    assert not CacheReader(tmp_path / "resumed", allow_incomplete=True).meta.complete
    assert _run_pass(tmp_path, tmp_path / "resumed", mode) == 0

    def tree(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert tree(tmp_path / "resumed") == tree(tmp_path / "ref")
    assert CacheReader(tmp_path / "ref").meta.mode == mode


def test_hf_teacher_cache_equals_its_topk(tmp_path, seed):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    dataset = make_dataset(tmp_path, num_samples=6)
    teacher = HFTeacher(model)
    with CacheWriter(tmp_path / "cache", vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=len(dataset),
                     metadata={"teacher_fingerprint": teacher.fingerprint}) as writer:
        capture_teacher(teacher, dataset, writer, CaptureConfig(topk=K, micro_batch_size=2), device="cpu",
                        progress=False)
    tokens = torch.stack([dataset[s]["tokens"] for s in range(len(dataset))])
    with torch.no_grad():
        ref_lp, ref_ids = torch.log_softmax(model(input_ids=tokens).logits.double(), -1).topk(K, -1)
    reader = CacheReader(tmp_path / "cache")
    ids, lps = reader.read(range(len(dataset)))
    got_ids, order = ids.long().sort(-1)
    want_ids, worder = ref_ids.sort(-1)
    assert torch.equal(got_ids, want_ids)
    assert_within_codec(lps.gather(-1, order), ref_lp.gather(-1, worder), reader.meta.codec, slack=1e-5)


def test_hf_teacher_refuses_scaled_logits_checked_on_a_prefix(monkeypatch):
    """HFTeacher compares the model's logits with lm_head(hidden states) on the first sample's first
    LOGITS_CHECK_TOKENS tokens (a whole 128K sample's logits do not fit on a GPU): a model that
    soft-caps its logits after lm_head is refused, a plain one passes, and the model's forward sees
    only the prefix."""
    transformers = pytest.importorskip("transformers")
    import megatron_kd.teacher.sources as sources

    monkeypatch.setattr(sources, "LOGITS_CHECK_TOKENS", 8)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))

    class SoftCapped(transformers.LlamaForCausalLM):
        lengths: list[int] = []

        def forward(self, input_ids=None, **kwargs):
            self.lengths.append(input_ids.shape[1])
            out = super().forward(input_ids=input_ids, **kwargs)
            out.logits = 30 * torch.tanh(out.logits / 30)
            return out

    torch.manual_seed(0)
    plain = HFTeacher(transformers.LlamaForCausalLM(config))
    hidden, weight = plain(tokens)
    assert hidden.shape == (SEQ, 2, 32) and plain._checked
    capped = SoftCapped(config)
    with torch.no_grad():
        capped.lm_head.weight.mul_(300)  # logits far past the cap's linear range
    with pytest.raises(ValueError, match="soft-capping"):
        HFTeacher(capped)(tokens)
    assert SoftCapped.lengths == [8]


def test_hf_teacher_with_a_tokenizer_without_vocabulary_table(tmp_path):
    """``cache build --kd-teacher-hf`` with Megatron's NullTokenizer (no vocabulary table, as
    benchmarks/bench_node.py runs it): the sizes are checked, the missing table is not an error."""
    transformers = pytest.importorskip("transformers")
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from megatron_kd.cache import CacheError
    from megatron_kd.teacher.build import _hf_teacher

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "teacher")
    teacher = _hf_teacher(str(tmp_path / "teacher"), NullTokenizer(VOCAB), "cpu")
    assert teacher.vocab_size == VOCAB
    with pytest.raises(CacheError, match=f"vocabulary of {VOCAB} tokens, the dataset's tokenizer {VOCAB + 8}"):
        _hf_teacher(str(tmp_path / "teacher"), NullTokenizer(VOCAB + 8), "cpu")
