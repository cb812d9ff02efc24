"""Chat data's loss mask through the whole pipeline, on CPU: ``data chat`` -> the teacher pass (entries
only where the loss is taken) -> KDDataset -> a student trained a few steps. Also: each sample's mask is
megatron-core's own sample of the mask dataset (one prefix and a blend with plain data), the masked loss
equals ``topk_kl_reference`` (float64) on full teacher rows under the same mask, a cache of another mask
is refused at start-up, the cache shrinks with the answer fraction, and resume keeps its bytes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_kd.cli import main as cli_main
from tests.fixtures.chat_inputs import HARMONY_SPECIALS, megatron_tokenizer, save_tokenizer, write_jsonl
from tests.fixtures.dist_utils import init_tensor_parallel, megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err

SEQ, K, SAMPLES, MBS, VOCAB_ROWS = 128, 16, 16, 4, 128


def _conversations(rng, n: int) -> list:
    letters = np.array(list("abcdefgh"))
    out = []
    for _ in range(n):
        question = "".join(rng.choice(letters, rng.integers(10, 40)))
        out.append({"messages": [{"role": "system", "content": "Copy."},
                                 {"role": "user", "content": question},
                                 {"role": "assistant", "reasoning": "copy", "content": question[:12]}]})
    return out


@pytest.fixture
def chat_data(tmp_path, seed):
    """A harmony tokenizer directory and ``data chat`` output at tmp/data/chat (and a plain prefix)."""
    tok_dir = save_tokenizer(tmp_path / "tok", HARMONY_SPECIALS, eos="<|return|>")
    rng = np.random.default_rng(seed)
    jsonl = write_jsonl(tmp_path / "conv.jsonl", _conversations(rng, 40))
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir)]
    assert cli_main(["data", "chat", "--input", str(jsonl), "--output", str(tmp_path / "data" / "chat"),
                     "--seq-length", str(SEQ), *flags]) == 0
    from megatron_kd.megatron.data import write_indexed_dataset

    tokenizer = megatron_tokenizer(tok_dir)
    write_indexed_dataset(tmp_path / "data" / "plain", [list(rng.integers(8, 100, 50)) + [tokenizer.eod]
                                                        for _ in range(30)], tokenizer.vocab_size)
    return tmp_path, tokenizer


def _datasets(tmp: Path, tokenizer, prefixes=("chat",), num_samples=SAMPLES):
    """The training split over tmp/data/PREFIX for each prefix, as ``train`` builds it."""
    from megatron_kd.megatron.data import build_gpt_datasets

    train, _, _ = build_gpt_datasets([str(tmp / "data" / p) for p in prefixes], split="100,0,0", seq_length=SEQ,
                                     seed=1, tokenizer=tokenizer, num_samples=(num_samples, 0, 0),
                                     cache_dir=str(tmp / "data" / "cache"))
    return train


def _reference_masks(tmp: Path, tokenizer, num_samples: int | None) -> torch.Tensor:
    """Each sample's mask as megatron-core samples it: a copy of the chat token dataset whose tokens are
    the mask bytes (same documents, seed and split, hence the same windows), its labels."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_kd.megatron.data import write_indexed_dataset

    masks = IndexedDataset(str(tmp / "data" / "chat_loss_mask"))
    if not (tmp / "data" / "mask_as_tokens.idx").exists():
        write_indexed_dataset(tmp / "data" / "mask_as_tokens", [masks[i] for i in range(len(masks))],
                              tokenizer.vocab_size)
    ref = _datasets(tmp, tokenizer, prefixes=("mask_as_tokens",), num_samples=num_samples)
    return torch.stack([ref[i]["labels"] for i in range(len(ref))]).float()


def test_sample_mask_is_megatron_cores_sample_of_the_mask(chat_data):
    from megatron_kd.megatron.loss_mask import LossMaskedDataset, loss_mask_field

    tmp, tokenizer = chat_data
    train = _datasets(tmp, tokenizer)
    assert isinstance(train, LossMaskedDataset)
    expect = _reference_masks(tmp, tokenizer, SAMPLES)
    got = torch.stack([train[i]["loss_mask"] for i in range(len(train))])
    assert torch.equal(got, expect) and 0.1 < float(got.mean()) < 0.6  # samples span several conversations
    assert not train[None]["loss_mask"].any()  # megatron-core's batch-padding sample
    field = loss_mask_field(train)
    sidecar = json.loads((tmp / "data" / "chat_chat.json").read_text())
    assert field["mask"] == sidecar["mask"] and len(field["fingerprint"]) == 32

    # a blend with plain data: the chat prefix's samples masked, the plain prefix's every token
    blend = _datasets(tmp, tokenizer, prefixes=("chat", "plain"), num_samples=40)
    base = blend.base
    inner = base.datasets[0]
    expect = _reference_masks(tmp, tokenizer, inner.num_samples)  # None: one epoch, as the blend's builder asks
    kinds = set()
    for i in range(len(blend)):
        which, j = int(base.dataset_index[i]), int(base.dataset_sample_index[i])
        plain = base[i]["loss_mask"]
        kinds.add(which)
        assert torch.equal(blend[i]["loss_mask"], plain if which == 1 else plain * expect[j])
    assert kinds == {0, 1} and loss_mask_field(blend)["mask"] == f"{sidecar['mask']}; none"


def _student(vocab_rows: int, seed: int, layers: int = 1, hidden: int = 32):
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.3)
    return build_gpt_model(cfg, vocab_size=vocab_rows, max_sequence_length=SEQ,
                           position_embedding_type="learned_absolute", use_te=False)


def _teacher_pass(path, dataset, teacher, tokenizer, *, stop_after=None, mode="topk"):
    """What ``cache build`` does on one rank: the dataset's loss mask recorded, entries where it keeps
    the loss. ``stop_after``: a pass killed once the first samples are written."""
    from megatron_kd.cache import CacheWriter
    from megatron_kd.megatron.data import dataset_fingerprint, tokenizer_fingerprint
    from megatron_kd.megatron.loss_mask import loss_mask_field
    from megatron_kd.teacher import CaptureConfig, capture_teacher

    loss_mask = loss_mask_field(dataset)
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "dataset_fingerprint": dataset_fingerprint(dataset), "loss_mask": loss_mask, "mode": mode}
    writer = CacheWriter(path, vocab_size=tokenizer.vocab_size, topk=K, seq_length=SEQ, num_samples=SAMPLES,
                         micro_batch_size=MBS, rows_per_shard=MBS, metadata=meta)
    if stop_after is not None:
        pending = writer.pending_samples()
        writer.pending_samples = lambda: pending[pending < stop_after]
    capture_teacher(teacher, dataset, writer, CaptureConfig(topk=K, draws=K, micro_batch_size=MBS,
                                                            masked=bool(loss_mask), mode=mode), progress=False)
    writer.close()


def _array_bytes(path: Path) -> int:
    """Bytes of the ids and logprobs shard files (what grows with the entries; metadata is fixed)."""
    return sum(f.stat().st_size for name in ("ids", "logprobs") for f in (path / "dp_00000" / name).rglob("*")
               if f.is_file() and f.name != "zarr.json")


def _pipeline_worker(rank, world, tmp):
    from megatron_kd.cache import CacheError
    from megatron_kd.cache.inspect import inspect, verify
    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.kd_data import KDDataset
    from megatron_kd.megatron.loss import KDForwardStep
    from megatron_kd.ops import fused_topk_kl, topk_kl_reference
    from megatron_kd.teacher import MegatronTeacher

    tmp = Path(tmp)
    with megatron_cpu_patches():
        init_tensor_parallel(1)
        tokenizer = megatron_tokenizer(tmp / "tok")
        train = _datasets(tmp, tokenizer)
        teacher = MegatronTeacher(_student(VOCAB_ROWS, seed=0).eval(), vocab_size=tokenizer.vocab_size)
        _teacher_pass(tmp / "masked", train, teacher, tokenizer)
        _teacher_pass(tmp / "full", train.base, teacher, tokenizer)  # the same data, every token

        # resume: a pass stopped after two micro-batches, run again, ends with the same bytes
        _teacher_pass(tmp / "resumed", train, teacher, tokenizer, stop_after=2 * MBS)
        _teacher_pass(tmp / "resumed", train, teacher, tokenizer)
        for f in (tmp / "masked").rglob("*"):
            if f.is_file() and not f.name.startswith("."):
                assert f.read_bytes() == (tmp / "resumed" / f.relative_to(tmp / "masked")).read_bytes(), f

        # entries exactly where the loss is taken; the same entries as the unmasked cache there
        masked = KDDataset(train, str(tmp / "masked"), tokenizer=tokenizer, required_samples=SAMPLES)
        full = KDDataset(train.base, str(tmp / "full"), tokenizer=tokenizer, required_samples=SAMPLES)
        answer = 0.0
        for i in range(SAMPLES):
            a, b = masked[i], full[i]
            keep = a["loss_mask"] > 0
            assert torch.equal(a["teacher_ids"][:, 0] >= 0, keep)
            assert torch.equal(a["teacher_ids"][keep], b["teacher_ids"][keep])
            assert torch.equal(a["teacher_logprobs"][keep], b["teacher_logprobs"][keep])
            answer += float(keep.float().mean()) / SAMPLES

        # sampled mode: a position's draws are keyed by (seed, sample, position), so the masked pass draws
        # at each kept position what the unmasked pass draws there
        _teacher_pass(tmp / "sampled-masked", train, teacher, tokenizer, mode="sampled")
        _teacher_pass(tmp / "sampled-full", train.base, teacher, tokenizer, mode="sampled")
        sampled = KDDataset(train, str(tmp / "sampled-masked"), tokenizer=tokenizer, required_samples=SAMPLES)
        sampled_full = KDDataset(train.base, str(tmp / "sampled-full"), tokenizer=tokenizer, required_samples=SAMPLES)
        for i in range(SAMPLES):
            a, b = sampled[i], sampled_full[i]
            keep = a["loss_mask"] > 0
            assert torch.equal(a["teacher_ids"][:, 0] >= 0, keep)
            assert torch.equal(a["teacher_ids"][keep], b["teacher_ids"][keep])

        # cache bytes scale with the answer tokens
        ratio = _array_bytes(tmp / "masked") / _array_bytes(tmp / "full")
        assert 0.8 * answer < ratio < 1.25 * answer, (ratio, answer)
        summary = inspect(tmp / "masked", progress=False)
        assert summary["loss_mask"] == masked.loss_mask["mask"]
        assert summary["tokens_with_entries"] == round(answer * SAMPLES * SEQ)
        assert verify(tmp / "masked", progress=False)["tokens_with_entries"] == summary["tokens_with_entries"]

        # a cache of another mask (or of none) is refused at start-up, naming both
        with pytest.raises(CacheError, match="loss mask differs: the cache's teacher rows were taken under 'harmony "
                                             "roles=assistant.*this run's data has none"):
            KDDataset(train.base, str(tmp / "masked"), tokenizer=tokenizer, required_samples=SAMPLES)
        with pytest.raises(CacheError, match="loss mask differs: the cache's teacher rows were taken under none "
                                             "\\(every token\\), this run's data has 'harmony"):
            KDDataset(train, str(tmp / "full"), tokenizer=tokenizer, required_samples=SAMPLES)

        # the masked loss: padding rows outside the mask give the loss of full rows under the same mask
        batch = torch.utils.data.default_collate([masked[i] for i in range(MBS)])
        rows = torch.utils.data.default_collate([full[i] for i in range(MBS)])
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(SEQ, MBS, 16, generator=g, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(tokenizer.vocab_size, 16, generator=g, dtype=torch.float64, requires_grad=True)
        kw = dict(loss_mask=batch["loss_mask"].t().double(), labels=batch["labels"].t(), ce_weight=0.5,
                  temperature=2.0, tail="ghost", chunk_size=50)
        ours, stats = fused_topk_kl(hidden, weight, batch["teacher_ids"].transpose(0, 1),
                                    batch["teacher_logprobs"].transpose(0, 1).double(), **kw)
        grads = torch.autograd.grad(ours, (hidden, weight))
        ref, ref_stats = topk_kl_reference(hidden, weight, rows["teacher_ids"].transpose(0, 1),
                                           rows["teacher_logprobs"].transpose(0, 1).double(), **kw)
        ref_grads = torch.autograd.grad(ref, (hidden, weight))
        assert rel_err(ours, ref) < 1e-10 and float(stats["tokens"]) == float(batch["loss_mask"].sum())
        assert all(rel_err(a, b) < 1e-10 for a, b in zip(grads, ref_grads))

        # a student trained a few steps on the masked cache: its KD loss falls
        student = _student(VOCAB_ROWS, seed=1)
        step = KDForwardStep(KDConfig(ce_weight=0.5, op_impl="torch"), device=torch.device("cpu"))
        opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
        curve = []
        for it in range(12):
            samples = [(it * MBS + j) % SAMPLES for j in range(MBS)]
            output, loss_fn = step(iter([torch.utils.data.default_collate([masked[i] for i in samples])]), student)
            loss, tokens, report = loss_fn(output)
            (loss / tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(float(report["kd loss"][0] / report["kd loss"][1]))
        assert np.mean(curve[-4:]) < 0.8 * np.mean(curve[:4]), curve


def test_chat_data_teacher_pass_and_training(chat_data):
    tmp, _ = chat_data
    spawn(_pipeline_worker, str(tmp), world_size=1)


def test_cache_records_the_mask_and_refuses_another_on_resume(chat_data):
    from megatron_kd.cache import CacheError, CacheWriter
    from megatron_kd.cache.store import read_root_meta

    tmp, tokenizer = chat_data
    field = {"mask": "harmony roles=assistant", "fingerprint": "a" * 32}
    params = dict(vocab_size=tokenizer.vocab_size, topk=K, seq_length=SEQ, num_samples=4)
    CacheWriter(tmp / "c", metadata={"loss_mask": field}, **params).close()
    root = json.loads((tmp / "c" / "zarr.json").read_text())
    assert root["attributes"]["megatron_kd"]["loss_mask"] == field
    with pytest.raises(CacheError, match="existing cache has loss_mask="):
        CacheWriter(tmp / "c", metadata={"loss_mask": {**field, "fingerprint": "b" * 32}}, **params)
    # the field is in the store_id digest: an edited mask is caught on open
    root["attributes"]["megatron_kd"]["loss_mask"]["fingerprint"] = "b" * 32
    (tmp / "c" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(CacheError, match="store_id is"):
        read_root_meta(tmp / "c")
    # a store without a mask has no field: stores of before keep their bytes and store_id
    CacheWriter(tmp / "plain", **params).close()
    assert "loss_mask" not in json.loads((tmp / "plain" / "zarr.json").read_text())["attributes"]["megatron_kd"]


def test_a_mask_that_does_not_belong_to_its_data_is_one_error(chat_data):
    from megatron_kd.megatron.data import write_indexed_dataset
    from megatron_kd.megatron.loss_mask import LossMaskError

    tmp, tokenizer = chat_data
    sidecar = tmp / "data" / "chat_chat.json"
    good = sidecar.read_text()
    sidecar.write_text(good[:40])
    with pytest.raises(LossMaskError, match="chat_chat.json: not readable JSON"):
        _datasets(tmp, tokenizer)
    sidecar.write_text(good)
    write_indexed_dataset(tmp / "data" / "chat_loss_mask", [[1, 0, 1]] * 3, 256)  # another data set's mask
    with pytest.raises(LossMaskError, match="chat_loss_mask.idx: its documents are not those of"):
        _datasets(tmp, tokenizer)
