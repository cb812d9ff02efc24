"""Packed documents (megatron_kd/megatron/packing.py, models/documents.py and the document paths of models/attention.py).

1. boundaries: ``Documents`` computes from the tokens what megatron-core's
   ``_get_ltor_masks_and_position_ids`` computes with --reset-attention-mask --reset-position-ids
   (positions, and its [s, s] mask as document starts), EOD at the first / last position and in
   runs included; a GPTDataset built with the flags agrees with it, and --eod-mask-loss zeroes
   exactly the predictions made at EOD tokens
2. the flex block mask built from the documents is exact: every visible pair lies in a listed
   block, every block marked full is visible throughout, mask_mod is the exact mask
3. the math path (CPU): a packed sample equals each document run alone, output and gradients
   (window and full layers, sinks, GQA), through ``core_attention`` and ``CoreAttention``
4. the definition, at model level: a tiny GPT-OSS student (window 8, sinks, YaRN) built by the
   training entry's model provider; the logits of packed samples equal those of each document run
   alone (documents shorter and longer than the window) at TP 2 and EP 2 on gloo, and the
   rotary rows each token gets are those of its position in its document; controls: without
   packing, and with positions restarted but attention crossing, the logits differ
5. modes, the THD params Transformer Engine's path takes, and the one-line refusals
"""

import os
from pathlib import Path

import pytest
import torch

from megatron_kd.errors import FlagError
from megatron_kd.megatron.packing import DocumentPacking, check_packing_flags
from megatron_kd.models.attention import _block_mask, _causal_block_mask, core_attention
from megatron_kd.models.documents import Documents, PackedDocuments, document_starts
from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err
from tests.fixtures.packed_documents import EOD, packed_tokens, spans
from tests.fixtures.tiny_gpt_oss import SEQ, VOCAB_ROWS, make_tiny_gpt_oss


# ------------------------------------------------------------------------------------ 1. boundaries
def test_boundaries_are_megatrons(seed):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(seed)
    s = 64
    tokens = torch.randint(2, 50, (5, s), generator=g)
    tokens[tokens < 8] = EOD  # runs of EODs, documents of one token
    tokens[1, 0] = tokens[1, -1] = EOD  # EOD first and last
    tokens[2] = 7  # no EOD: one document
    docs = Documents.from_tokens(tokens, EOD)
    assert docs.starts.dtype == torch.int32 and docs.shape == (5, s)
    i = torch.arange(s)
    lengths = []
    for row in range(tokens.shape[0]):
        mask, _, positions = _get_ltor_masks_and_position_ids(tokens[row], EOD, True, True, False, True)
        assert torch.equal(docs.positions[row], positions), row
        keep = (i.view(1, s) <= i.view(s, 1)) & (i.view(1, s) >= docs.starts[row].view(s, 1))
        assert torch.equal(~mask[0], keep), row  # megatron's mask: True = masked
        begins = [int(t) for t in torch.nonzero(positions == 0).flatten()] + [s]
        lengths += [b - a for a, b in zip(begins, begins[1:])]
    cu_seqlens, longest = docs.varlen()
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == torch.tensor([0] + lengths).cumsum(0).tolist() and longest == max(lengths)


def test_gpt_dataset_agrees_and_eod_mask_loss(tmp_path, seed):
    """What the dataset hands the forward step, built with Megatron-LM's flags as ``megatron-kd
    train`` builds it (create_attention_mask=False)."""
    import numpy as np
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_kd.megatron.data import ByteTokenizer, write_indexed_dataset

    tok = ByteTokenizer()
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, 256, rng.integers(1, 30))) + [tok.eod] for _ in range(40)]
    prefix = write_indexed_dataset(tmp_path / "docs", docs, tok.vocab_size)
    config = GPTDatasetConfig(random_seed=seed, sequence_length=48, blend=([str(prefix)], None), split="100,0,0",
                              tokenizer=tok, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                              create_attention_mask=False, path_to_cache=str(tmp_path / "cache"),
                              mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, 0, 0], lambda: True, config).build()
    for idx in range(8):
        item = train[idx]
        tokens = item["tokens"].unsqueeze(0)
        assert torch.equal(Documents.from_tokens(tokens, tok.eod).positions[0], item["position_ids"])
        # the prediction made at an EOD token (of the next document's first token) carries no loss
        assert torch.equal(item["loss_mask"] == 0, item["tokens"] == tok.eod)


# ---------------------------------------------------------------------------- 2. flex block mask
@pytest.mark.parametrize("packed", [True, False], ids=["documents", "one-sequence"])
@pytest.mark.parametrize("window", [None, (6, 0), (40, 0)], ids=["full", "window7", "window41"])
def test_causal_block_mask_is_exact(seed, window, packed):
    """Within documents, and over the whole sequence (what unpacked self-attention uses at any length)."""
    g = torch.Generator().manual_seed(seed)
    block, s = 16, 100  # s not a multiple of the block
    lengths = [[-100], [1, 1, 15, 17, 3, -63], [40, 2, 16, 16, -26], [5] * 20]
    starts = document_starts(packed_tokens(lengths, generator=g), EOD)
    if packed:
        mask = _causal_block_mask(s, window, starts=starts, block=block)
    else:
        starts = torch.zeros(1, s, dtype=torch.int32)
        mask = _causal_block_mask(s, window, device="cpu", block=block)
    b, n = starts.shape[0], -(-s // block)
    i = torch.arange(s)
    exact = (i.view(1, 1, s) <= i.view(1, s, 1)) & (i.view(1, 1, s) >= starts.unsqueeze(-1))  # [b, q, kv]
    if window is not None:
        exact &= i.view(1, 1, s) >= i.view(1, s, 1) - window[0]
    bi, qi, ki = (t.reshape(-1) for t in torch.meshgrid(torch.arange(b), i, i, indexing="ij"))
    assert torch.equal(mask.mask_mod(bi, torch.zeros_like(bi), qi, ki).view(b, s, s), exact)

    def listed(num, indices):  # bool [b, nq, nkv]
        dense = torch.zeros(b, n, n, dtype=torch.bool)
        for row in range(b):
            for q_block in range(n):
                dense[row, q_block, indices[row, 0, q_block, :num[row, 0, q_block]].long()] = True
        return dense

    partial, full = listed(mask.kv_num_blocks, mask.kv_indices), listed(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any()
    padded = torch.zeros(b, n * block, n * block, dtype=torch.bool)
    padded[:, :s, :s] = exact
    per_block = padded.view(b, n, block, n, block)
    assert torch.equal(per_block.any(4).any(2) & ~full, partial)  # a block with a visible pair is listed
    assert not (full & ~per_block.all(4).all(2)).any()  # a full block is visible throughout
    assert full.any() == (window is None or window[0] >= 2 * block)  # where they can be, blocks are full
    assert mask.q_num_blocks is not None and mask.full_q_num_blocks is not None  # backward's transposed blocks


@pytest.mark.parametrize("window", [None, (127, 0), (300, 0)], ids=["full", "window128", "window301"])
def test_self_attention_block_mask_is_create_block_masks(window):
    """Unpacked causal self-attention's block mask, from block bounds, lists what torch's
    create_block_mask lists (which evaluates every pair: out of memory at 128K tokens)."""
    from torch.nn.attention.flex_attention import create_block_mask

    s = 1000  # not a multiple of flex's 128-token block
    left = window[0] if window else s

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (kv >= q - left)

    ours, torchs = _block_mask(s, s, True, window, "cpu"), create_block_mask(mask_mod, None, None, s, s, device="cpu")
    for num, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        assert torch.equal(getattr(ours, num), getattr(torchs, num)), num
        count = getattr(ours, num)[0, 0]
        for q_block, k in enumerate(count.tolist()):  # only the listed entries are defined
            assert torch.equal(getattr(ours, indices)[0, 0, q_block, :k].sort().values,
                               getattr(torchs, indices)[0, 0, q_block, :k].sort().values)


# ----------------------------------------------------------------------------------- 3. math path
CASES = [((5, 0), True), ((5, 0), False), (None, True), (None, False)]


@pytest.mark.parametrize("window, sinks", CASES, ids=["window-sinks", "window", "full-sinks", "full"])
def test_math_path_packed_equals_each_document_alone(seed, window, sinks):
    g = torch.Generator().manual_seed(seed)
    heads, groups, d = 4, 2, 8
    lengths = [[3, 12, 1, -8], [-24]]  # shorter and longer than the window of 6 keys
    tokens = packed_tokens(lengths, generator=g)
    b, s = tokens.shape
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(heads, generator=g, dtype=torch.float64, requires_grad=True) if sinks else None
    d_out = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    kw = dict(scale=0.3, window=window, sink=sink)
    leaves = [q, k, v] + ([sink] if sinks else [])
    packed = core_attention(q, k, v, documents=Documents.from_tokens(tokens, EOD), impl="auto", **kw)
    grads_packed = torch.autograd.grad(packed, leaves, d_out)
    alone, grads_alone = torch.zeros_like(packed), [torch.zeros_like(t) for t in leaves]
    for row, layout in enumerate(lengths):
        for a, z in spans(layout):
            part = [t[row:row + 1, :, a:z] for t in (q, k, v)]
            out = core_attention(*part, impl="math", **kw)
            alone[row:row + 1, :, a:z] = out.detach()
            for total, grad in zip(grads_alone, torch.autograd.grad(out, leaves, d_out[row:row + 1, :, a:z])):
                total += grad
    assert rel_err(packed, alone) < 1e-12
    for name, ours, want in zip("qkvs", grads_packed, grads_alone):
        assert rel_err(ours, want) < 1e-12, name
    unpacked = core_attention(q, k, v, impl="math", **kw)
    assert rel_err(unpacked, alone) > 1e-2  # control: attention across documents


class _OneRank:
    """A tensor-parallel group of one rank: all CoreAttention asks of its group."""

    def size(self):
        return 1

    def rank(self):
        return 0


def test_core_attention_module_takes_packed_documents(seed):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_kd.models.attention import CoreAttention

    g = torch.Generator().manual_seed(seed)
    heads, groups, d = 4, 2, 8
    config = TransformerConfig(num_layers=2, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=d, use_cpu_initialization=True, params_dtype=torch.float64,
                               attention_dropout=0.0, window_size=(5, 0), window_attn_skip_freq=2,
                               softmax_type="learnable", masked_softmax_fusion=False)
    with megatron_cpu_patches():
        module = CoreAttention(config, 1, AttnMaskType.causal, "self",
                               pg_collection=ProcessGroupCollection(tp=_OneRank()))
    with torch.no_grad():
        module.softmax_offset.normal_(generator=g)
    lengths = [[9, -15], [2, 2, -20]]
    tokens = packed_tokens(lengths, generator=g)
    b, s = tokens.shape
    q = torch.randn(s, b, heads, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(s, b, groups, d, generator=g, dtype=torch.float64) for _ in range(2))
    _, params = DocumentPacking(documents=True, positions=True, eod=EOD).apply({"tokens": tokens})
    out = module(q, k, v, None, packed_seq_params=params)  # [s, b, heads·d]
    for row, layout in enumerate(lengths):
        for a, z in spans(layout):
            alone = module(q[a:z, row:row + 1], k[a:z, row:row + 1], v[a:z, row:row + 1], None)
            assert rel_err(out[a:z, row:row + 1], alone) < 1e-12
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, s], dtype=torch.int32))
    with pytest.raises(ValueError, match="THD format needs Transformer Engine"):
        module(q, k, v, None, packed_seq_params=thd)


# ---------------------------------------------------------------------------- 4. the definition
def _logits(model, tokens, packed, tp_group):
    """Full-vocabulary logits [b, s, V] of the megatron GPTModel (TP shards gathered)."""
    with torch.no_grad():
        out = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None, packed_seq_params=packed)
    if tp_group.size() > 1:
        parts = [torch.empty_like(out) for _ in range(tp_group.size())]
        torch.distributed.all_gather(parts, out.contiguous(), group=tp_group)
        out = torch.cat(parts, -1)
    return out[..., :VOCAB_ROWS]


def _rotary_rows(model):
    """Record the rotary table layer 1's attention gets ([s, b, 1, d] with packing, [s, 1, 1, d] without)."""
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs["rotary_pos_emb"])

    handle = model.decoder.layers[0].self_attention.register_forward_pre_hook(hook, with_kwargs=True)
    return seen, handle


def _definition_worker(rank, world, tmp, seed):
    from megatron.core import parallel_state
    from megatron.training import get_tokenizer

    from tests.fixtures.hf_equality import forget_megatron
    from tests.fixtures.hf_equality import build_gpt_oss_student

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    hf_dir = Path(tmp) / "hf"
    # TP 2, then EP 2, in one process (each spawn costs ~20 s of imports)
    for parallel_flags in (("--tensor-model-parallel-size", "2"), ("--expert-model-parallel-size", "2")):
        with megatron_cpu_patches():
            if rank == 0 and not hf_dir.exists():
                make_tiny_gpt_oss(hf_dir, seed=seed)
            torch.distributed.barrier()
            args, model = build_gpt_oss_student(hf_dir, "--reset-attention-mask", "--reset-position-ids",
                                                *parallel_flags)
            model.eval()
            tp_group = parallel_state.get_tensor_model_parallel_group()
            eod = get_tokenizer().eod
            assert eod == EOD  # the tiny tokenizer's <eos>
            packing = DocumentPacking.from_args(args, eod=eod)
            assert packing.mode == "documents+positions" and not packing.thd
            # window of 8 keys: documents of 1, 5 and 3 tokens (shorter), 13, 20 and 9 (longer); a last
            # document cut by the sample's end, and one ending with its EOD on the sample's last token
            lengths = [[5, 13, 1, -13], [20, 3, 9]]
            tokens = packed_tokens(lengths, generator=torch.Generator().manual_seed(seed))
            assert tokens.shape == (2, SEQ)
            _, packed = packing.apply({"tokens": tokens})
            seen, handle = _rotary_rows(model)
            logits = _logits(model, tokens, packed, tp_group)
            packed_rows = seen.pop()
            alone = torch.empty_like(logits)
            later = torch.zeros(tokens.shape, dtype=torch.bool)  # documents after a sample's first
            for row, layout in enumerate(lengths):
                for a, z in spans(layout):
                    alone[row, a:z] = _logits(model, tokens[row:row + 1, a:z], None, tp_group)[0]
                    assert torch.equal(packed_rows[a:z, row], seen.pop()[:, 0])  # rows of positions 0 .. z-a-1
                    later[row, a:z] = a > 0
            handle.remove()
            assert rel_err(logits, alone) < 1e-4
            crossing = _logits(model, tokens, None, tp_group)
            assert rel_err(crossing[later], alone[later]) > 1e-2, "without packing the later documents must differ"
            _, positions_only = DocumentPacking(positions=True, eod=eod).apply({"tokens": tokens})
            assert positions_only.documents is None
            assert rel_err(_logits(model, tokens, positions_only, tp_group)[later], alone[later]) > 1e-2
        forget_megatron()


def test_packed_logits_equal_each_document_alone_tp2_and_ep2(tmp_path, seed):
    spawn(_definition_worker, str(tmp_path), seed, world_size=2)


# ---------------------------------------------------------------------------- 5. modes and refusals
def test_modes_and_params():
    tokens = torch.tensor([[4, 5, EOD, 6, 7, 8, EOD, 9], [EOD, 4, 4, 4, 4, EOD, EOD, 5]])
    teacher_ids = torch.arange(2 * 8 * 3).view(2, 8, 3)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 8), "teacher_ids": teacher_ids,
             "position_ids": torch.arange(8).expand(2, 8)}
    assert DocumentPacking().apply(batch) == (batch, None) and DocumentPacking().mode == "none"
    for documents, positions, mode in [(True, False, "documents"), (False, True, "positions"),
                                       (True, True, "documents+positions")]:
        packing = DocumentPacking(documents=documents, positions=positions, eod=EOD)
        assert packing.mode == mode
        same, params = packing.apply(batch)
        assert isinstance(params, PackedDocuments) and params.qkv_format == "sbhd"
        assert same.keys() == batch.keys() and all(torch.equal(same[key], batch[key]) for key in batch
                                                   if key != "position_ids")
        assert torch.equal(same["position_ids"], params.position_ids if positions else batch["position_ids"])
        assert params.max_seqlen_q == params.max_seqlen_kv == 8  # megatron-core's rotary table length
        assert (params.documents is not None) == documents and (params.position_ids is not None) == positions
    flat, thd = DocumentPacking(documents=True, positions=True, eod=EOD, thd=True).apply(batch)
    assert thd.qkv_format == "thd" and type(thd).__name__ == "PackedSeqParams"
    assert thd.cu_seqlens_q.dtype == torch.int32 and thd.cu_seqlens_q is thd.cu_seqlens_kv
    assert thd.cu_seqlens_q.tolist() == [0, 3, 7, 8, 9, 14, 15, 16]
    assert thd.max_seqlen_q == thd.max_seqlen_kv == 5
    assert torch.equal(flat["tokens"], tokens.view(1, 16)) and torch.equal(flat["teacher_ids"], teacher_ids.view(1, 16, 3))
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 1, 2, 3, 4, 0, 0]]
    with pytest.raises(FlagError, match="--reset-position-ids with Transformer Engine.*pass both"):
        DocumentPacking(positions=True, eod=EOD, thd=True)
    with pytest.raises(ValueError, match="EOD id"):
        DocumentPacking(documents=True)


def test_flag_refusals(monkeypatch):
    from types import SimpleNamespace

    def flags(**kw):
        base = dict(reset_attention_mask=True, reset_position_ids=True, transformer_impl="local",
                    context_parallel_size=1, pipeline_model_parallel_size=1, apply_rope_fusion=False,
                    micro_batch_size=2)
        return SimpleNamespace(**{**base, **kw})

    check_packing_flags(flags())
    check_packing_flags(flags(reset_attention_mask=False, reset_position_ids=False, context_parallel_size=2))
    with pytest.raises(FlagError, match="--reset-attention-mask --reset-position-ids with --context-parallel-size 2"):
        check_packing_flags(flags(context_parallel_size=2))
    with pytest.raises(FlagError, match="--reset-position-ids with --pipeline-model-parallel-size 3"):
        check_packing_flags(flags(reset_attention_mask=False, pipeline_model_parallel_size=3))
    with pytest.raises(FlagError, match="--reset-position-ids with rope fusion"):
        check_packing_flags(flags(apply_rope_fusion=True))
    check_packing_flags(flags(pipeline_model_parallel_size=2))
    with monkeypatch.context() as m:  # a machine with Transformer Engine
        m.setattr("megatron_kd.megatron.packing.have_transformer_engine", lambda: True)
        te = dict(transformer_impl="transformer_engine", pipeline_model_parallel_size=2)
        check_packing_flags(flags(**te, micro_batch_size=1, apply_rope_fusion=True))
        with pytest.raises(FlagError, match="Transformer Engine, --pipeline-model-parallel-size 2 and "
                                            "--micro-batch-size 2"):
            check_packing_flags(flags(**te))
        with pytest.raises(FlagError, match="--reset-attention-mask with Transformer Engine.*pass both"):
            check_packing_flags(flags(**te, reset_position_ids=False))


def test_core_attention_refusals():
    q = torch.randn(1, 2, 6, 4)
    docs = Documents.from_tokens(torch.tensor([[3, EOD, 3, 3, 3, 3]]), EOD)
    for impl in ("sdpa", "cudnn"):
        with pytest.raises(ValueError, match="no document masking"):
            core_attention(q, q, q, scale=0.5, documents=docs, impl=impl)
    with pytest.raises(ValueError, match="for causal attention"):
        core_attention(q, q, q, scale=0.5, causal=False, documents=docs)
    with pytest.raises(ValueError, match="for packed documents"):
        core_attention(q, q, q, scale=0.5, impl="varlen")
    with pytest.raises(ValueError, match="documents of shape"):
        core_attention(q[:, :, :4], q[:, :, :4], q[:, :, :4], scale=0.5, documents=docs)
