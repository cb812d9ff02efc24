"""Packed documents through the training step, the teacher pass and the cache (CPU).

1. ``KDForwardStep`` with --reset-attention-mask --reset-position-ids: the fused KD + CE loss of a
   packed micro-batch of a tiny GPT-OSS student equals the sum of the losses of its documents run
   alone; without packing it differs
2. the teacher pass: ``MegatronTeacher`` (the same tiny GPT-OSS) and ``HFTeacher`` (a tiny random
   transformers Llama, documents kept apart by transformers' own packed-sequence masks) give each
   token of a packed sample the hidden state it has in its document alone; a Hugging Face model
   whose masks ignore the positions (transformers' GptOssForCausalLM) is refused on its first
   packed micro-batch, and one flag without the other is refused
3. the cache records the packing mode; a student whose packing differs is refused with one line
   naming both; stores without packing keep their store_id
4. flags packing cannot run with are refused before start-up, one line each
"""

import os
from pathlib import Path

import pytest
import torch

from megatron_kd.cache import CacheError
from megatron_kd.megatron.packing import DocumentPacking
from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err, teacher_topk
from tests.fixtures.packed_documents import EOD, packed_tokens, spans
from tests.fixtures.tiny_gpt_oss import make_tiny_gpt_oss

LENGTHS = [[5, 13, 1, -13], [20, 3, 9]]  # documents shorter and longer than the window of 8


def _kd_batch(tokens, generator, k=8):
    b, s = tokens.shape
    ids, lps = teacher_topk(b * s, 990, k)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": torch.arange(s).expand(b, s),
            "loss_mask": torch.rand(b, s, generator=generator).gt(0.2).float(),
            "teacher_ids": ids.view(b, s, k).int(), "teacher_logprobs": lps.view(b, s, k)}


def _loss(model, batch, packing):
    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.loss import KDForwardStep

    step = KDForwardStep(KDConfig(impl="fused", ce_weight=0.1, tail="renorm"), device=torch.device("cpu"),
                         packing=packing)
    with torch.no_grad():
        output, loss_fn = step(iter([batch]), model)
    return loss_fn(output)[0]


def _worker(rank, world, tmp, seed):
    from megatron.training import get_tokenizer

    from megatron_kd.teacher.sources import HFTeacher, MegatronTeacher
    from tests.fixtures.hf_equality import build_gpt_oss_student

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        hf_dir = make_tiny_gpt_oss(Path(tmp) / "hf", seed=seed)
        args, model = build_gpt_oss_student(hf_dir, "--reset-attention-mask", "--reset-position-ids")
        model.eval()
        packing = DocumentPacking.from_args(args, eod=get_tokenizer().eod)
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        tokens = packed_tokens(LENGTHS, generator=g)
        batch = _kd_batch(tokens, g)
        for row, layout in enumerate(LENGTHS):  # the loss of the documents that packing changes
            batch["loss_mask"][row, :abs(layout[0])] = 0
        # 1. the training step
        alone = sum(_loss(model, {key: value[row:row + 1, a:z] for key, value in batch.items()}, None)
                    for row, layout in enumerate(LENGTHS) for a, z in spans(layout))
        assert rel_err(_loss(model, batch, packing), alone) < 1e-6
        assert rel_err(_loss(model, batch, None), alone) > 1e-4  # the tolerance's hundredfold
        # 2. the teacher pass: each token's hidden state is the one it has in its document alone
        import transformers

        torch.manual_seed(seed)
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)).float()
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        for teacher in (MegatronTeacher(model, packing=packing), HFTeacher(llama, packing=packing)):
            hidden, _ = teacher(tokens, positions)  # [s, b, h]
            for row, layout in enumerate(LENGTHS):
                for a, z in spans(layout):
                    want, _ = teacher(tokens[row:row + 1, a:z], positions[row:row + 1, :z - a])
                    assert rel_err(hidden[a:z, row], want[:, 0]) < 1e-4, (type(teacher).__name__, a, z)
        gpt_oss = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with pytest.raises(CacheError, match="GptOssForCausalLM lets documents attend to each other"):
            HFTeacher(gpt_oss, packing=packing)(tokens, positions)
        with pytest.raises(CacheError, match="--kd-teacher-hf with --reset-attention-mask: .* pass both"):
            HFTeacher(llama, packing=DocumentPacking(documents=True, eod=EOD))


def test_training_step_and_teacher_pass_pack_alike(tmp_path, seed):
    spawn(_worker, str(tmp_path), seed, world_size=1)


def test_cache_records_packing(tmp_path):
    from megatron_kd.cache import CacheReader, CacheWriter
    from megatron_kd.megatron.data import ByteTokenizer, dataset_fingerprint, tokenizer_fingerprint
    from megatron_kd.megatron.kd_data import KDDataset
    from tests.fixtures.tiny_teacher import K, SEQ, make_dataset

    train = make_dataset(tmp_path, num_samples=2)
    tok = ByteTokenizer()
    paths = {}
    for mode in ("none", "documents+positions"):
        paths[mode] = tmp_path / mode
        writer = CacheWriter(paths[mode], vocab_size=tok.vocab_size, topk=K, seq_length=SEQ, num_samples=2,
                             metadata={"packing": mode, "dataset_fingerprint": dataset_fingerprint(train),
                                       "tokenizer_fingerprint": tokenizer_fingerprint(tok)})
        ids = torch.stack([torch.randperm(tok.vocab_size)[:K] for _ in range(2 * SEQ)]).view(2, SEQ, K).int()
        tokens = torch.stack([train[s]["tokens"] for s in (0, 1)])
        writer.write([0, 1], ids, torch.log_softmax(torch.randn(2, SEQ, K), -1), tokens=tokens)
        writer.close()
        meta = CacheReader(paths[mode]).meta
        assert meta.packing == mode and ("packing" in meta.identity()) == (mode != "none")
    KDDataset(train, paths["documents+positions"], tokenizer=tok, required_samples=2, packing="documents+positions")
    with pytest.raises(CacheError, match="packing differs: the cache's is 'none', this run's is "
                                         "'documents\\+positions'"):
        KDDataset(train, paths["none"], tokenizer=tok, required_samples=2, packing="documents+positions")
    with pytest.raises(CacheError, match="packing differs: the cache's is 'documents\\+positions', this run's "
                                         "is 'none'"):
        KDDataset(train, paths["documents+positions"], tokenizer=tok, required_samples=2)


def test_flags_refused_before_start_up():
    from megatron_kd.errors import FlagError
    from megatron_kd.megatron.flags import check_megatron_flags
    from tests.fixtures.tiny_gpt_oss import CPU_FLAGS, TINY_ARCH

    with pytest.raises(FlagError, match="--reset-attention-mask with --context-parallel-size 2"):
        check_megatron_flags([*TINY_ARCH, *CPU_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "990",
                              "--reset-attention-mask", "--context-parallel-size", "2"])
