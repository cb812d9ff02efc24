"""Student training through Megatron's output_processor hook, the dataset join, and the CPU demo.

1. one step through GPTModel + KDForwardStep: the fused loss gives the same loss and parameter
   gradients as the dense reference on materialized logits, at TP=1 and TP=2, on gloo
2. KDDataset returns each sample's own teacher rows, for caches captured with DP 1 and DP 2, and
   the context-parallel split keeps each token's teacher row with it
3. a cache that does not match the run (vocabulary, sequence length, tokenizer, samples whose
   tokens its teacher did not read, too few samples) stops start-up
4. the demo pipeline runs end to end (a few steps)
"""

import json

import pytest
import torch

from megatron_kd.cache import CacheError, CacheWriter
from megatron_kd.megatron.args import KDConfig
from megatron_kd.megatron.data import ByteTokenizer, dataset_fingerprint, tokenizer_fingerprint
from megatron_kd.megatron.kd_data import KDDataset
from megatron_kd.megatron.loss import KDForwardStep
from tests.fixtures.dist_utils import init_tensor_parallel, megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err, teacher_topk
from tests.fixtures.tiny_teacher import PADDED_VOCAB, SEQ, make_dataset

K = 8


def _student(tp, sequence_parallel):
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
                            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, init_method_std=0.3)
    return build_gpt_model(cfg, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                           position_embedding_type="learned_absolute", use_te=False)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    b = 2
    tokens = torch.randint(0, 258, (b, SEQ), generator=g)
    torch.manual_seed(seed)
    ids, lps = teacher_topk(b * SEQ, 258, K)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": torch.arange(SEQ).expand(b, SEQ),
            "loss_mask": (torch.rand(b, SEQ, generator=g) > 0.2).float(),
            "teacher_ids": ids.view(b, SEQ, K).int(), "teacher_logprobs": lps.view(b, SEQ, K)}


def _step_worker(rank, world, seed, sequence_parallel):
    with megatron_cpu_patches():
        group = init_tensor_parallel(world)
        batch = _batch(seed)
        results = {}
        for impl in ("fused", "dense"):
            model = _student(world, sequence_parallel)
            step = KDForwardStep(KDConfig(impl=impl, ce_weight=0.5, temperature=2.0, tail="ghost", chunk_size=7),
                                 tp_group=group, device=torch.device("cpu"))
            output, loss_fn = step(iter([batch]), model)
            loss, num_tokens, report = loss_fn(output)
            loss.backward()
            results[impl] = (loss.detach(), report, {n: p.grad.clone() for n, p in model.named_parameters()})
        (l1, r1, g1), (l2, r2, g2) = results["fused"], results["dense"]
        # float32 model: the fused and dense losses differ only by summation order
        assert rel_err(l1, l2) < 1e-5
        for key in r1:
            assert rel_err(r1[key], r2[key]) < 1e-5, key
        assert g1.keys() == g2.keys()
        for name in g1:
            assert rel_err(g1[name], g2[name]) < 1e-4, name
        assert int(num_tokens) == int(batch["loss_mask"].sum())


def _ce_worker(rank, world, seed):
    with megatron_cpu_patches():
        group = init_tensor_parallel(world)
        batch = {k: v for k, v in _batch(seed).items() if not k.startswith("teacher")}  # no teacher: CE
        results = {}
        for ce_impl in ("fused", "megatron"):
            model = _student(world, False)
            step = KDForwardStep(KDConfig(ce_impl=ce_impl, chunk_size=7), tp_group=group, device=torch.device("cpu"))
            output, loss_fn = step(iter([batch]), model)
            loss, num_tokens, report = loss_fn(output)
            loss.backward()
            results[ce_impl] = loss.detach(), report, {n: p.grad.clone() for n, p in model.named_parameters()}
        (l1, r1, g1), (l2, r2, g2) = results["fused"], results["megatron"]
        assert rel_err(l1, l2) < 1e-5 and r1.keys() == r2.keys() == {"lm loss", "ce loss"}
        for key in r1:
            assert rel_err(r1[key], r2[key]) < 1e-5, key
        assert g1.keys() == g2.keys()
        for name in g1:
            assert rel_err(g1[name], g2[name]) < 1e-4, name


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_fused_cross_entropy_equals_megatron(seed, tp):
    """Batches without a teacher (training without --kd-cache, validation) through the fused op give
    Megatron's own output layer + vocab-parallel cross-entropy: loss, report and every gradient."""
    spawn(_ce_worker, seed, world_size=tp)


# Sequence parallelism needs Transformer Engine's (or Apex's) LayerNorm in megatron-core's layer
# specs; the op's sequence-parallel path is covered in tests/ops/test_topk_kl_parallel.py.
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_training_step_fused_equals_dense(seed, tp):
    spawn(_step_worker, seed, False, world_size=tp)


def _cp_worker(rank, world):
    from megatron.core import parallel_state

    from megatron_kd.megatron.kd_data import get_kd_batch

    with megatron_cpu_patches():
        parallel_state.initialize_model_parallel(context_parallel_size=world)
        b, s = 2, 16
        tokens = torch.arange(b * s).view(b, s)
        full = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, s),
                "position_ids": torch.arange(s).expand(b, s),
                "teacher_ids": tokens[..., None].expand(b, s, K).int().contiguous(),  # row t carries token t
                "teacher_logprobs": tokens[..., None].expand(b, s, K).float().contiguous()}
        got = get_kd_batch(iter([full]), cp_group=parallel_state.get_context_parallel_group(),
                           device=torch.device("cpu"))
        chunk = s // (2 * world)
        expect = torch.cat([tokens[:, rank * chunk:(rank + 1) * chunk],
                            tokens[:, (2 * world - 1 - rank) * chunk:(2 * world - rank) * chunk]], 1)
        assert torch.equal(got["tokens"], expect)
        assert torch.equal(got["position_ids"][0], expect[0])  # row 0 of tokens is 0..s-1, the positions
        for key in ("teacher_ids", "teacher_logprobs"):
            assert got[key].shape == (b, 2 * chunk, K)
            assert torch.equal(got[key][..., 0].long(), expect)  # teacher rows follow their tokens


def test_context_parallel_split_keeps_teacher_rows_with_tokens(seed):
    spawn(_cp_worker, world_size=2)


def _write_cache(path, dataset, dp_size, mbs, n):
    tok = ByteTokenizer()
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tok), "dataset_fingerprint": dataset_fingerprint(dataset)}
    params = dict(vocab_size=tok.vocab_size, topk=K, seq_length=SEQ, num_samples=n)
    expected = {}
    for rank in range(dp_size):
        with CacheWriter(path, dp_rank=rank, dp_size=dp_size, micro_batch_size=mbs, metadata=meta, **params) as w:
            for s in w.pending_samples():
                torch.manual_seed(int(s))
                ids, lps = teacher_topk(SEQ, tok.vocab_size, K)
                w.write(int(s), ids, lps, tokens=dataset[int(s)]["tokens"])
                expected[int(s)] = ids.sort(-1).values
    return expected


@pytest.mark.parametrize("dp_size, mbs", [(1, 1), (2, 2)])
def test_dataset_join_returns_each_samples_rows(tmp_path, seed, dp_size, mbs):
    dataset = make_dataset(tmp_path, num_samples=10)
    expected = _write_cache(tmp_path / "cache", dataset, dp_size, mbs, n=10)
    kd = KDDataset(dataset, str(tmp_path / "cache"), tokenizer=ByteTokenizer(), required_samples=10)
    for i in torch.randperm(10).tolist():
        item = kd[i]
        assert int(item["sample_idx"]) == i
        assert torch.equal(item["tokens"], dataset[i]["tokens"])
        assert torch.equal(item["teacher_ids"].long().sort(-1).values, expected[i])
        assert item["teacher_logprobs"].shape == (SEQ, K)


@pytest.mark.parametrize("override, match", [
    ({"vocab_size": 300}, "vocabulary size differs: the cache's is 300, this run's is 258"),
    ({"seq_length": SEQ * 2}, f"sequence length differs: the cache's is {SEQ * 2}, this run's is {SEQ}"),
    ({"meta": {"tokenizer_fingerprint": "another-tokenizer"}},
     "tokenizer differs: the cache's is 'another-tokenizer', this run's is '"),
    # the teacher read other tokens for sample 3 (position 20 changed): its rows are not this run's
    ({"other_tokens": 3}, r"this run needs 10 samples; the cache holds 9 of them\. The first it lacks is sample 3: "
                          r"the cache's sample 3 was read by the teacher with other tokens \(the first differing "
                          r"block: positions 16\.\.23\)"),
    ({"num_samples": 4}, "this run needs 10 samples; the cache holds 4 of them"),
])
def test_mismatched_cache_stops_startup(tmp_path, seed, override, match):
    dataset = make_dataset(tmp_path, num_samples=10)
    n = override.pop("num_samples", 10)
    other = override.pop("other_tokens", None)
    # the writer validates ids against its own vocab/seq: write data of the overridden shape
    tok = ByteTokenizer()
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tok), "dataset_fingerprint": dataset_fingerprint(dataset)}
    meta.update(override.pop("meta", {}))
    params = {"vocab_size": tok.vocab_size, "topk": K, "seq_length": SEQ, "num_samples": n, **override}
    with CacheWriter(tmp_path / "cache", metadata=meta, **params) as w:
        for s in range(n):
            ids, lps = teacher_topk(params["seq_length"], params["vocab_size"], K)
            tokens = dataset[s]["tokens"].repeat(params["seq_length"] // SEQ)  # (the window of a longer run)
            if s == other:
                tokens[20] = (tokens[20] + 1) % tok.vocab_size
            w.write(s, ids, lps, tokens=tokens)
    with pytest.raises(CacheError, match=match):
        KDDataset(dataset, str(tmp_path / "cache"), tokenizer=tok, required_samples=10)


def _demo_config(workdir, **overrides):
    from megatron_kd.demo import DemoConfig

    # small enough for CI, long enough for the teacher to be worth distilling from
    settings = dict(teacher_steps=150, student_steps=40, eval_samples=32, corpus_bytes=600_000, log_interval=4)
    return DemoConfig(workdir=str(workdir), **{**settings, **overrides})


def test_demo_distills_better_than_cross_entropy(tmp_path):
    from megatron_kd.demo import run_demo

    lines = []
    result = run_demo(_demo_config(tmp_path / "demo"), log=lines.append)
    heldout = result["heldout"]
    assert set(heldout) == {"teacher", "student KD", "student CE"}
    # the point of the product: at equal steps the distilled student beats the CE-only one on unseen data
    assert heldout["teacher"] < heldout["student KD"] < heldout["student CE"], heldout
    assert (tmp_path / "demo" / "loss_curves.png").stat().st_size > 10_000
    assert list((tmp_path / "demo" / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "demo" / "results.json").read_text())["teacher_pass"]["samples"] == 40 * 16
    assert any("student KD" in ln for ln in lines)


def test_killed_demo_resumes_with_the_same_trajectory(tmp_path, monkeypatch):
    """Kill the KD student mid-run (after its step-4 checkpoint), run again: the same teacher rows
    for the same samples give the same losses, bitwise, as a run that was never interrupted."""
    import megatron_kd.demo as demo

    small = dict(teacher_steps=8, student_steps=10, eval_samples=16, log_interval=4)
    reference = demo.run_demo(_demo_config(tmp_path / "uninterrupted", **small), log=lambda _: None)

    read = demo.batch_at
    seen = []

    def killed_at_step_7(dataset, step, batch_size):
        if isinstance(dataset, KDDataset):
            if step == 7:
                raise KeyboardInterrupt("killed")
            seen.append((step, [int(i) for i in read(dataset, step, batch_size)["sample_idx"]]))
        return read(dataset, step, batch_size)

    monkeypatch.setattr(demo, "batch_at", killed_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(_demo_config(tmp_path / "killed", **small), log=lambda _: None)
    monkeypatch.setattr(demo, "batch_at", read)
    lines = []
    resumed = demo.run_demo(_demo_config(tmp_path / "killed", **small), log=lines.append)
    assert any("student_kd resumed after step 4" in ln for ln in lines), lines
    assert any("teacher    resumed after step 8" in ln for ln in lines), lines
    assert resumed["curves"] == reference["curves"]  # every step's loss, bitwise
    assert resumed["heldout"] == reference["heldout"]
    assert [step for step, _ in seen] == list(range(1, 7))
    assert all(ids == list(range((step - 1) * 16, step * 16)) for step, ids in seen)


def test_reverse_and_jsd_with_the_renorm_tail_are_warned_at_startup():
    """The combination the GPU fidelity preset measured to fail gets one line; the rest none."""
    def warning(divergence, tail, weight):
        return KDConfig(divergence=divergence, tail=tail, weight=weight, ce_weight=1.0).divergence_warning

    for divergence in ("reverse", "jsd"):
        line = warning(divergence, "renorm", 1.0)
        assert line.startswith(f"warning: --kd-divergence {divergence} with --kd-tail renorm") and "\n" not in line
    assert warning("forward", "renorm", 1.0) is None  # scores the full softmax
    assert warning("reverse", "ghost", 1.0) is None
    assert warning("reverse", "renorm", 0.0) is None  # no KD term
