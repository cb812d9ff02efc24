"""Pruned students: importance scores by hand, cuts that keep the kept parts exact, and the whole
calibration -> cuts -> student path on a Megatron GPT-OSS teacher.

1. block influence, routing mass, channel, head, experts' channel and hidden-channel norms of
   hand-built two-layer stacks are the numbers worked out below (the experts' through the grouped
   path's tap and through each expert's linear_fc2); the kept indices follow the scores, ties to
   the lower index
2. cuts that keep everything give back the teacher's tensors and config, bit for bit
3. each cut computes what the teacher computes with the cut part switched off (transformers, fp32):
   experts pruned = the teacher with those experts' router logits at -1e4 (never in a top-k);
   layers pruned = the teacher with those layers taken out; FFN channels pruned = the teacher with
   those channels' down_proj columns zeroed; attention heads pruned (Llama, GPT-OSS with sinks) =
   the teacher with those heads' o_proj columns zeroed; experts' channels pruned = the teacher with
   those channels' down_proj rows zeroed (MXFP4 experts: written dense, the same numbers); hidden
   channels pruned: the teacher's kept rows / columns, a student that loads strictly and runs
4. a Megatron GPT-OSS teacher's calibration pass, the cuts it chooses and the student Megatron
   builds from the pruned directory with the student's flags, against transformers on that directory
   (an experts cut; a heads cut with --num-attention-heads / --kv-channels, a hidden and experts'
   width cut with --hidden-size / --moe-ffn-hidden-size / --kv-channels, as prune prints them)
5. the same cuts on a megatron-core model's state dict (plain and gated MLP, grouped-query
   attention): the student built with the student's sizes loads it strictly and computes the
   teacher with those layers taken out, those channels' linear_fc2 columns and those heads'
   linear_proj columns zeroed; on a GPT-OSS-style megatron-core MoE the experts' channel scores of
   the grouped (bf16) and sequential (fp32) paths agree, the experts' width cut computes the
   teacher with those channels' fc2 columns zeroed and the hidden cut loads strictly and runs; at
   expert-parallel size 2 each rank's experts land in its block of the gathered scores
"""

import math
import re
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_kd.prune import (ImportanceCollector, KeptParts, PruneError, PruneTargets, choose_kept,
                               pruned_megatron_state, write_pruned_hf)
from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.hf_equality import (assert_same_tensors, build_student, forget_megatron, megatron_logits,
                                        reference_logits)
from tests.fixtures.kd_inputs import rel_err
from tests.fixtures.tiny_gpt_oss import SEQ as GPT_OSS_SEQ
from tests.fixtures.tiny_gpt_oss import TOKENIZER_TOKENS, make_tiny_gpt_oss, tiny_flags
from tests.fixtures.tiny_llama import make_tiny

TOL = 1e-5  # fp32: the same tensors through the same transformers code, ordered differently


# ------------------------------------------------------------------------------------- 1. by hand
class _Router(nn.Module):
    def __init__(self, probs):
        super().__init__()
        self.probs = probs

    def forward(self, x):
        return self.probs, self.probs > 0


class _Layer(nn.Module):
    """out = hidden @ turn; a MoE layer (router with fixed probs) or a dense one (linear_fc2 fed
    with fixed activations); with ``context`` an attention whose linear_proj is fed it."""

    def __init__(self, turn, probs=None, act=None, context=None, head_dim=None):
        super().__init__()
        self.turn, self.act, self.context = turn, act, context
        self.mlp = nn.Module()
        if probs is not None:
            self.mlp.router = _Router(probs)
        else:
            self.mlp.linear_fc2 = nn.Linear(act.shape[-1], 2, bias=False)
        if context is not None:
            self.self_attention = nn.Module()
            self.self_attention.linear_proj = nn.Linear(context.shape[-1], 2, bias=False)
            self.self_attention.hidden_size_per_attention_head = head_dim

    def forward(self, hidden_states):
        if self.context is not None:
            self.self_attention.linear_proj(self.context)
        if hasattr(self.mlp, "router"):
            self.mlp.router(hidden_states)
        else:
            self.mlp.linear_fc2(self.act)
        return hidden_states @ self.turn, None


def _stack(layers):
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList(layers)
    return model


def _run(model, hidden):
    for layer in model.decoder.layers:
        hidden = layer(hidden_states=hidden)[0]


def test_scores_and_choices_by_hand():
    rot90 = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    shear = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    # tokens [1, 0] and [0, 1]; layer 0 turns them by 90° into [0, 1], [-1, 0]: cos 0 and 0 -> influence 1;
    # layer 1 shears those into [0, 1], [-1, -1]: cos 1 and 1/√2 -> 1 - (1 + 1/√2)/2
    hidden = torch.eye(2)
    probs = [torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.5, 0.5]]), torch.tensor([[0.0, 0.2, 0.8], [0.4, 0.6, 0.0]])]
    model = _stack([_Layer(rot90, probs=probs[0]), _Layer(shear, probs=probs[1])])
    with ImportanceCollector(model) as collector:
        _run(model, hidden)
        _run(model, hidden)  # two passes: sums of both, the same means
    scores = collector.scores()
    assert scores.tokens == 4
    torch.testing.assert_close(scores.layer_groups, torch.tensor([1.0, 1 - (1 + 1 / math.sqrt(2)) / 2],
                                                                 dtype=torch.float64))
    torch.testing.assert_close(scores.experts, 2 * torch.tensor([[0.7, 0.8, 0.5], [0.4, 0.8, 0.8]],
                                                                dtype=torch.float64))
    assert scores.ffn is None
    # pairs: cos(in of layer 0, out of layer 1): [1,0] -> [0,1] -> [0,1]: 0; [0,1] -> [-1,0] -> [-1,-1]: -1/√2
    with ImportanceCollector(model, group_size=2) as paired:
        _run(model, hidden)
    torch.testing.assert_close(paired.scores().layer_groups, torch.tensor([1 + 1 / (2 * math.sqrt(2))],
                                                                          dtype=torch.float64))

    kept = choose_kept(scores, PruneTargets(num_layers=1, num_experts=2), num_layers=2, num_experts=3,
                       ffn_hidden_size=None, experts_per_token=2)
    assert kept.layers == [0]  # the 90° turn matters more than the shear
    assert kept.experts == [[0, 1]]  # layer 0: masses 1.4, 1.6, 1.0
    kept = choose_kept(scores, PruneTargets(num_experts=2), num_layers=2, num_experts=3, ffn_hidden_size=None)
    assert kept.experts == [[0, 1], [1, 2]]  # layer 1: 0.8, 1.6, 1.6: the tie at 1.6 keeps both, 0 goes

    act = torch.tensor([[[1.0, 2.0, 0.0]], [[-2.0, 0.0, 3.0]]])  # [s, b, F]: channel norms √5, 2, 3
    # [s, b, heads · d], 4 heads of 2: head norms √(1 + 4 + 4), √1, √(9 + 16), √(4 + 1 + 1)
    context = torch.tensor([[[1.0, 2.0, 1.0, 0.0, 3.0, 0.0, 2.0, 1.0]], [[0.0, 2.0, 0.0, 0.0, 0.0, 4.0, 0.0, 1.0]]])
    dense = _stack([_Layer(torch.eye(2), act=act, context=context, head_dim=2)])
    with ImportanceCollector(dense) as collector:
        _run(dense, hidden)
    scores = collector.scores()
    torch.testing.assert_close(scores.ffn, torch.tensor([[math.sqrt(5), 2.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(scores.heads, torch.tensor([[3.0, 1.0, 5.0, math.sqrt(6)]], dtype=torch.float64))
    # two query groups of two heads: each keeps its larger one
    assert choose_kept(scores, PruneTargets(num_attention_heads=2), num_layers=1, num_experts=None, ffn_hidden_size=3,
                       num_attention_heads=4, num_query_groups=2).heads == [[0, 2]]
    with pytest.raises(PruneError, match="only grouped-query heads"):  # multi-head: one key / value per head
        choose_kept(scores, PruneTargets(num_attention_heads=2), num_layers=1, num_experts=None, ffn_hidden_size=3,
                    num_attention_heads=4)
    with pytest.raises(PruneError, match="a multiple of the teacher's 2 query groups"):
        choose_kept(scores, PruneTargets(num_attention_heads=3), num_layers=1, num_experts=None, ffn_hidden_size=3,
                    num_attention_heads=4, num_query_groups=2)
    assert choose_kept(scores, PruneTargets(ffn_hidden_size=2), num_layers=1, num_experts=None,
                       ffn_hidden_size=3).ffn == [[0, 2]]
    for targets, match in [(PruneTargets(num_experts=2), "no experts"), (PruneTargets(ffn_hidden_size=4), "between"),
                           (PruneTargets(num_layers=1), None)]:
        if match is None:
            assert choose_kept(scores, targets, num_layers=1, num_experts=None, ffn_hidden_size=3).layers == [0]
            continue
        with pytest.raises(PruneError, match=match):
            choose_kept(scores, targets, num_layers=1, num_experts=None, ffn_hidden_size=3)


class _Norm(nn.Module):
    """A norm whose output is fixed."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out


class _Experts(nn.Module):
    """Experts whose fc2 inputs are fixed (``rows``: one [tokens routed to it, I] per expert), fed
    as the grouped path feeds its tap (every expert's rows in expert order, then the bias column
    and padding, with the rows per expert) or as the sequential path feeds each ``linear_fc2``."""

    def __init__(self, rows, grouped):
        from megatron_kd.models.experts import ExpertActivationTap

        super().__init__()
        self.rows, self.grouped = rows, grouped
        self.local_experts = nn.ModuleList()
        for r in rows:
            self.local_experts.append(nn.Module())
            self.local_experts[-1].linear_fc2 = nn.Linear(r.shape[1], 2, bias=False)
        self.fc2_input = ExpertActivationTap()

    def forward(self):
        if self.grouped:
            x = torch.cat(self.rows)
            padded = torch.cat([x, torch.full((len(x), 1), 9.0), torch.zeros(len(x), 4)], 1)  # [a | p | 0]
            self.fc2_input(padded, torch.tensor([len(r) for r in self.rows]))
        else:
            for expert, r in zip(self.local_experts, self.rows):
                expert.linear_fc2(r)


class _MoELayer(nn.Module):
    """An MoE layer that leaves the hidden state as it is: router probabilities, experts' fc2
    inputs and the outputs of its input and pre-MLP norms all fixed."""

    def __init__(self, probs, rows, grouped, norms):
        super().__init__()
        self.input_layernorm, self.pre_mlp_layernorm = _Norm(norms[0]), _Norm(norms[1])
        self.mlp = nn.Module()
        self.mlp.router, self.mlp.experts = _Router(probs), _Experts(rows, grouped)

    def forward(self, hidden_states):
        self.input_layernorm(hidden_states)
        self.mlp.router(hidden_states)
        self.pre_mlp_layernorm(hidden_states)
        self.mlp.experts()
        return hidden_states, None


def test_expert_channel_and_hidden_scores_by_hand():
    # fc2 inputs of 3 experts of 3 channels: expert 0 gets two tokens, expert 1 one, expert 2 none
    rows = [torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 2.0]]), torch.tensor([[3.0, 0.0, 4.0]]), torch.zeros(0, 3)]
    per_expert = torch.tensor([[1.0, 2.0, 2.0], [3.0, 0.0, 4.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    probs = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.5, 0.5]])  # routing mass 0.7, 0.8, 0.5
    # two tokens, hidden 2: per-channel L2 norms of the outputs (1, 2), (3, 4); (0, 1), (2, 0); final (√2, √2)
    norms = [(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[3.0, 4.0], [0.0, 0.0]])),
             (torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 0.0]]))]
    model = _stack([_MoELayer(probs, rows, True, norms[0]), _MoELayer(probs, rows, False, norms[1])])
    model.decoder.final_layernorm = _Norm(torch.ones(2, 2))
    with ImportanceCollector(model) as collector:
        hidden = torch.eye(2)
        for layer in model.decoder.layers:
            hidden = layer(hidden_states=hidden)[0]
        model.decoder.final_layernorm(hidden)
    scores = collector.scores()
    # the grouped path (layer 0, its bias column and padding left out) and the sequential one (layer 1) agree
    torch.testing.assert_close(scores.expert_ffn, torch.stack([per_expert, per_expert]))
    torch.testing.assert_close(scores.hidden, torch.tensor([6 + math.sqrt(2), 7 + math.sqrt(2)], dtype=torch.float64))

    sizes = dict(num_layers=2, num_experts=3, ffn_hidden_size=None, experts_per_token=1, moe_ffn_hidden_size=3,
                 hidden_size=2)
    kept = choose_kept(scores, PruneTargets(moe_ffn_hidden_size=2, hidden_size=1), **sizes)
    assert kept.expert_ffn == [[[1, 2], [0, 2], [0, 1]]] * 2  # expert 2 saw no token: ties to the lower index
    assert kept.hidden == [1]
    kept = choose_kept(scores, PruneTargets(num_experts=2, moe_ffn_hidden_size=1), **sizes)
    assert kept.experts == [[0, 1]] * 2 and kept.expert_ffn == [[[1], [2]]] * 2  # per kept expert, in its order
    uncut = choose_kept(scores, PruneTargets(moe_ffn_hidden_size=3, hidden_size=2), **sizes)  # the teacher's sizes
    assert uncut.record() == {"layers": [0, 1], "experts": None, "heads": None, "channels_cut": [],
                              "group_size": 1, "calibration_tokens": scores.tokens}
    assert uncut.arrays().keys() == {f"score_{name}" for name in ("layer_groups", "experts", "expert_ffn", "hidden")}
    assert torch.equal(uncut.arrays()["score_expert_ffn"], scores.expert_ffn)


# ---------------------------------------------------------------------------------- 2., 3. cuts
def _transformers(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokens(seed, seq):
    return torch.randint(0, TOKENIZER_TOKENS, (2, seq), generator=torch.Generator().manual_seed(seed))


def test_cuts_that_keep_everything_give_back_the_teacher(tmp_path, seed):
    import json

    teacher = make_tiny_gpt_oss(tmp_path / "teacher", seed=seed)
    every_channel = [[list(range(96))] * 4] * 2
    for name, kept in [("experts", KeptParts(layers=[0, 1], experts=[[0, 1, 2, 3]] * 2)),
                       ("widths", KeptParts(layers=[0, 1], expert_ffn=every_channel, hidden=list(range(64))))]:
        student = write_pruned_hf(teacher, tmp_path / name, kept)
        assert_same_tensors(teacher, student)
        assert json.loads((student / "config.json").read_text()) == json.loads((teacher / "config.json").read_text())
        assert (student / "tokenizer.json").is_file() and (student / "prune.json").is_file()
        record = json.loads((student / "prune.json").read_text())
        arrays = np.load(student / record["arrays"])
        assert record["layers"] == [0, 1] and record["channels_cut"] == ([] if name == "experts" else
                                                                         ["expert_ffn", "hidden"])
        if name == "widths":  # the kept channels as arrays beside prune.json
            assert arrays["kept_expert_ffn"].tolist() == every_channel and arrays["kept_hidden"].tolist() == list(range(64))


def test_pruned_experts_are_the_teacher_with_them_routed_away(tmp_path, seed):
    teacher_dir = make_tiny_gpt_oss(tmp_path / "teacher", seed=seed)  # 4 experts, top-2
    kept = KeptParts(layers=[0, 1], experts=[[0, 2, 3], [1, 2, 3]])
    student = _transformers(write_pruned_hf(teacher_dir, tmp_path / "student", kept))
    assert student.config.num_local_experts == 3
    teacher = _transformers(teacher_dir)
    with torch.no_grad():
        for layer, keep in zip(teacher.model.layers, kept.experts):
            gone = [e for e in range(4) if e not in keep]
            layer.mlp.router.bias[gone] = -1e4  # never among a token's top 2; the softmax is over the chosen
        tokens = _tokens(seed, GPT_OSS_SEQ)
        assert rel_err(student(input_ids=tokens).logits, teacher(input_ids=tokens).logits) < TOL


def test_pruned_layers_and_channels_are_the_teacher_without_them(tmp_path, seed):
    teacher_dir = make_tiny("llama", tmp_path / "teacher", seed=seed, num_hidden_layers=4)
    kept = KeptParts(layers=[0, 2, 3], ffn=[list(range(0, 96, 2)), list(range(48)), list(range(48, 96))])
    student = _transformers(write_pruned_hf(teacher_dir, tmp_path / "student", kept))
    assert student.config.num_hidden_layers == 3 and student.config.intermediate_size == 48
    teacher = _transformers(teacher_dir)
    with torch.no_grad():
        teacher.model.layers = nn.ModuleList(teacher.model.layers[i] for i in kept.layers)
        teacher.config.num_hidden_layers = 3
        for layer, keep in zip(teacher.model.layers, kept.ffn):
            gone = [c for c in range(96) if c not in keep]
            layer.mlp.down_proj.weight[:, gone] = 0.0
        tokens = _tokens(seed, 64)
        assert rel_err(student(input_ids=tokens, use_cache=False).logits,
                       teacher(input_ids=tokens, use_cache=False).logits) < TOL
    with pytest.raises(PruneError, match="--prune-moe-ffn-hidden-size"):
        write_pruned_hf(make_tiny_gpt_oss(tmp_path / "moe", seed=seed), tmp_path / "x",
                        KeptParts(layers=[0, 1], ffn=[[0], [0]]))


def _kept_channels(seed, layers, experts, width, keep):
    """Each expert's ``keep`` of ``width`` channels, drawn at random and different for every expert."""
    g = torch.Generator().manual_seed(seed)
    return [[sorted(torch.randperm(width, generator=g)[:keep].tolist()) for _ in range(experts)] for _ in range(layers)]


# the hidden dimension of Hugging Face Llama / GPT-OSS tensors by name (the others have none)
_HF_HIDDEN_DIMS = [
    (("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
      "up_proj.weight", "router.weight"), 1),
    (("o_proj.weight", "o_proj.bias", "mlp.down_proj.weight", "layernorm.weight", "model.norm.weight"), 0),
    (("experts.gate_up_proj", "experts.down_proj_bias"), 1), (("experts.down_proj",), 2)]


def test_pruned_expert_channels_are_the_teacher_without_them(tmp_path, seed):
    """Experts 96 -> 48 wide (and 4 -> 3 experts): the teacher with the cut channels' down_proj rows
    zeroed; MXFP4 experts come out dense in bf16, the same numbers as the dense teacher's cut."""
    import json

    from tests.fixtures.hf_equality import safetensors_of

    teacher_dir = make_tiny_gpt_oss(tmp_path / "teacher", seed=seed)
    kept = KeptParts(layers=[0, 1], experts=[[0, 2, 3], [1, 2, 3]], expert_ffn=_kept_channels(seed, 2, 3, 96, 48))
    student_dir = write_pruned_hf(teacher_dir, tmp_path / "student", kept)
    student = _transformers(student_dir)
    assert student.config.intermediate_size == 48 and student.config.num_local_experts == 3
    teacher = _transformers(teacher_dir)
    with torch.no_grad():
        for layer, keep, channels in zip(teacher.model.layers, kept.experts, kept.expert_ffn):
            layer.mlp.router.bias[[e for e in range(4) if e not in keep]] = -1e4
            for e, ch in zip(keep, channels):
                layer.mlp.experts.down_proj[e, [c for c in range(96) if c not in ch]] = 0.0
        tokens = _tokens(seed, GPT_OSS_SEQ)
        assert rel_err(student(input_ids=tokens).logits, teacher(input_ids=tokens).logits) < TOL

    # MXFP4, its blocks in one file and their scales in another, under both width cuts
    from safetensors.torch import save_file

    mxfp4_teacher = make_tiny_gpt_oss(tmp_path / "mxfp4", seed=seed, layout="mxfp4")
    tensors = safetensors_of(mxfp4_teacher)
    (mxfp4_teacher / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {k: t for k, t in tensors.items() if k.endswith("_blocks")},
              "model-00002-of-00002.safetensors": {k: t for k, t in tensors.items() if not k.endswith("_blocks")}}
    for name, shard in shards.items():
        save_file(shard, str(mxfp4_teacher / name), metadata={"format": "pt"})
    (mxfp4_teacher / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, shard in shards.items() for k in shard}}))
    kept = KeptParts(layers=[0, 1], experts=kept.experts, expert_ffn=kept.expert_ffn, hidden=list(range(0, 64, 2)))
    dense = safetensors_of(write_pruned_hf(teacher_dir, tmp_path / "both", kept))
    mxfp4_dir = write_pruned_hf(mxfp4_teacher, tmp_path / "from_mxfp4", kept)
    dequantized = safetensors_of(mxfp4_dir)
    assert dense.keys() == dequantized.keys()
    for key, t in dequantized.items():
        assert t.dtype == (torch.bfloat16 if key.endswith(("gate_up_proj", "down_proj")) else torch.float32), key
        assert torch.equal(t.float(), dense[key]), key
    assert "quantization_config" not in json.loads((mxfp4_dir / "config.json").read_text())
    assert "bf16" in json.loads((mxfp4_dir / "prune.json").read_text())["mxfp4_dequantized"]
    index = json.loads((mxfp4_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.mlp.experts.down_proj"] == "model-00002-of-00002.safetensors"  # with its scales


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_a_narrower_student_holds_the_teachers_kept_channels(tmp_path, seed, arch):
    """Hidden 64 -> 40: every tensor the teacher's kept rows / columns, the student loads without a
    missing, unexpected or mismatched tensor and runs; the heads keep their width (head_dim)."""
    from tests.fixtures.hf_equality import safetensors_of

    teacher_dir = (make_tiny("llama", tmp_path / "teacher", seed=seed) if arch == "llama"
                   else make_tiny_gpt_oss(tmp_path / "teacher", seed=seed))
    hidden = sorted(torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:40].tolist())
    kept = KeptParts(layers=[0, 1], hidden=hidden)
    student_dir = write_pruned_hf(teacher_dir, tmp_path / "student", kept)
    import transformers

    student, info = transformers.AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    assert student.config.hidden_size == 40 and student.config.head_dim == (24 if arch == "llama" else 16)
    with torch.no_grad():
        logits = student(input_ids=_tokens(seed, GPT_OSS_SEQ), use_cache=False).logits
    assert logits.shape == (2, GPT_OSS_SEQ, 1000) and torch.isfinite(logits).all()
    teacher, cut = safetensors_of(teacher_dir), safetensors_of(student_dir)
    h = torch.tensor(hidden)
    assert teacher.keys() == cut.keys()
    for key, t in teacher.items():
        dim = next((d for suffixes, d in _HF_HIDDEN_DIMS if key.endswith(suffixes)), None)
        assert torch.equal(cut[key], t if dim is None else t.index_select(dim, h)), key
    assert cut["model.embed_tokens.weight"].shape == (1000, 40)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_pruned_heads_are_the_teacher_without_them(tmp_path, seed, arch):
    """4 query heads over 2 key/value groups, one head kept per group: the teacher with the other
    heads' o_proj columns zeroed (GPT-OSS: their sinks go with them)."""
    teacher_dir = (make_tiny("llama", tmp_path / "teacher", seed=seed) if arch == "llama"
                   else make_tiny_gpt_oss(tmp_path / "teacher", seed=seed))
    teacher = _transformers(teacher_dir)
    head_dim, layers = teacher.config.head_dim, teacher.config.num_hidden_layers
    kept = KeptParts(layers=list(range(layers)), heads=[[1, 2], [0, 3]] + [[1, 2]] * (layers - 2))
    student = _transformers(write_pruned_hf(teacher_dir, tmp_path / "student", kept))
    assert student.config.num_attention_heads == 2 and student.config.head_dim == head_dim
    with torch.no_grad():
        for layer, keep in zip(teacher.model.layers, kept.heads):
            for h in set(range(4)) - set(keep):
                layer.self_attn.o_proj.weight[:, h * head_dim:(h + 1) * head_dim] = 0.0
        tokens = _tokens(seed, GPT_OSS_SEQ)
        assert rel_err(student(input_ids=tokens, use_cache=False).logits,
                       teacher(input_ids=tokens, use_cache=False).logits) < TOL


# ------------------------------------------------------------------------ 4. the whole path on gloo
def _calibration_worker(rank, world, tmp, seed):
    from megatron_kd.prune import calibrate
    from megatron_kd.prune.run import layer_group_size
    from megatron_kd.teacher.sources import MegatronTeacher

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        teacher_dir = make_tiny_gpt_oss(Path(tmp) / "teacher", seed=seed)
        args, model = build_student(tiny_flags(teacher_dir))  # the teacher, built as cache build builds it
        assert layer_group_size(args) == 2  # GPT-OSS: window / full pairs
        g = torch.Generator().manual_seed(seed)
        data = [{"tokens": torch.randint(3, TOKENIZER_TOKENS, (GPT_OSS_SEQ,), generator=g),
                 "position_ids": torch.arange(GPT_OSS_SEQ)} for _ in range(6)]
        scores = calibrate(MegatronTeacher(model.eval()), data, num_samples=5, micro_batch_size=2, group_size=2,
                           progress=False)
        assert scores.tokens == 5 * GPT_OSS_SEQ and scores.experts.shape == (2, 4)
        assert scores.expert_ffn.shape == (2, 4, 96) and scores.hidden.shape == (64,)  # 2 layers · 2 norms + final
        # an expert's channels saw activation exactly where tokens were routed to it
        assert torch.equal(scores.expert_ffn.sum(-1) > 0, scores.experts > 0) and (scores.hidden > 0).all()
        # routing mass: each token puts weight 1 on its two experts, in each layer
        torch.testing.assert_close(scores.experts.sum(1), torch.full((2,), 5.0 * GPT_OSS_SEQ, dtype=torch.float64))
        kept = choose_kept(scores, PruneTargets(num_experts=2), num_layers=2, num_experts=4, ffn_hidden_size=None,
                           experts_per_token=2)
        for i, k in enumerate(kept.experts):  # the two with the most mass, in index order
            assert k == sorted(sorted(range(4), key=lambda e: (-float(scores.experts[i, e]), e))[:2])
        student_dir = write_pruned_hf(teacher_dir, Path(tmp) / "student", kept)
    forget_megatron()
    with megatron_cpu_patches():
        # the student run: the teacher's flags with the student's sizes and --kd-student-hf
        _, student = build_student(tiny_flags(student_dir, "--num-experts", "2"))
        tokens = torch.randint(0, TOKENIZER_TOKENS, (2, GPT_OSS_SEQ), generator=torch.Generator().manual_seed(seed))
        assert rel_err(megatron_logits(student.eval(), tokens), reference_logits(student_dir, tokens)) < 1e-4


def test_calibration_cuts_and_student_on_a_megatron_teacher(tmp_path, seed):
    spawn(_calibration_worker, str(tmp_path), seed, world_size=1)


def test_prune_command_mistakes_are_one_line(tmp_path, capsys):
    from megatron_kd.cli import main

    hf_dir = make_tiny_gpt_oss(tmp_path / "hf")
    flags = tiny_flags(hf_dir)
    i = flags.index("--kd-student-hf")
    no_teacher = [*flags[:i], *flags[i + 2:], "--tokenizer-model", str(hf_dir)]

    assert main(["prune", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--prune-num-experts", "--prune-num-layers", "--prune-ffn-hidden-size",
                                        "--prune-num-attention-heads", "--prune-moe-ffn-hidden-size",
                                        "--prune-hidden-size", "--prune-calib-samples", "--out"))
    for argv, message in [
        (["--prune-num-experts", "2"], "prune needs --out DIR"),
        (["--out", "x"], "prune needs a target"),
        (["--out", "x", "--prune-num-layers", "0"], "--prune-num-layers must be >= 1, got 0"),
        (["--out", "x", "--prune-num-attention-heads", "0"], "--prune-num-attention-heads must be >= 1, got 0"),
        (["--out", "x", "--prune-hidden-size", "0"], "--prune-hidden-size must be >= 1, got 0"),
        (["--out", "x", "--prune-moe-ffn-hidden-size", "-4"], "--prune-moe-ffn-hidden-size must be >= 1, got -4"),
        (["--out", "x", "--prune-num-experts", "two"], "--prune-num-experts: invalid int value"),
        (["--out", "x", "--prune-num-experts", "2", "--num-layers", "2"], "missing required flags: --hidden-size"),
        (["--out", "x", "--prune-num-experts", "2", *no_teacher], "prune cuts a Hugging Face teacher: --kd-teacher-hf"),
    ]:
        assert main(["prune", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("megatron-kd: error: ") and message in err and "\n" not in err, err


def test_student_copy_of_the_tokenizer_reads_the_teachers_cache(tmp_path):
    """The cache names its samples by dataset fingerprint; a pruned student's directory holds a copy
    of the teacher's tokenizer, so a run with --kd-student-hf STUDENT must describe the samples that
    cache build --kd-teacher-hf TEACHER described (megatron-core's own hash names the tokenizer by path)."""
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron_kd.megatron.data import build_gpt_datasets, dataset_fingerprint, write_indexed_dataset
    from tests.fixtures.tiny_gpt_oss import save_word_tokenizer

    prefix = write_indexed_dataset(tmp_path / "data" / "docs", [[3, 4, 5, 6, 1]] * 40, TOKENIZER_TOKENS)

    def fingerprint(tokenizer_dir: Path, seq_length: int = 8) -> str:
        save_word_tokenizer(tokenizer_dir)
        tok = MegatronTokenizer.from_pretrained(tokenizer_path=str(tokenizer_dir),
                                                metadata_path={"library": "huggingface"})
        train, _, _ = build_gpt_datasets([str(prefix)], split="100,0,0", seq_length=seq_length, seed=0, tokenizer=tok,
                                         num_samples=(8, 0, 0), cache_dir=str(tmp_path / "index-cache"))
        return dataset_fingerprint(train)

    teacher = fingerprint(tmp_path / "teacher")
    assert fingerprint(tmp_path / "student") == teacher
    assert fingerprint(tmp_path / "student", seq_length=16) != teacher


# ------------------------------------------------------------------- 5. a megatron-core state dict
def _megatron_gpt(layers: int, ffn: int, gated: bool, seed: int, heads: int = 4, hidden: int = 32):
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=2,
                            kv_channels=8, ffn_hidden_size=ffn,
                            gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu,
                            use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0,
                            hidden_dropout=0.0, init_method_std=0.3)
    return build_gpt_model(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="learned_absolute",
                           use_te=False).eval()


def _megatron_state_worker(rank, world, seed, gated):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        teacher = _megatron_gpt(4, 48, gated, seed)
        kept = KeptParts(layers=[0, 2, 3], ffn=[list(range(0, 48, 2)), list(range(24)), list(range(24, 48))],
                         heads=[[1, 2], [0, 3], [0, 2]])  # one of each group's two heads
        student = _megatron_gpt(3, 24, gated, seed + 1, heads=2)
        student.load_state_dict(pruned_megatron_state(teacher.state_dict(), kept, gated=gated, attention=(4, 2, 8)),
                                strict=True)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        positions = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            teacher.decoder.layers = nn.ModuleList(teacher.decoder.layers[i] for i in kept.layers)
            for layer, keep, heads in zip(teacher.decoder.layers, kept.ffn, kept.heads):
                gone = [c for c in range(48) if c not in keep]
                layer.mlp.linear_fc2.weight[:, gone] = 0.0
                for h in set(range(4)) - set(heads):
                    layer.self_attention.linear_proj.weight[:, h * 8:(h + 1) * 8] = 0.0
            ours, theirs = student(tokens, positions, None), teacher(tokens, positions, None)
        assert rel_err(ours, theirs) < TOL, rel_err(ours, theirs)
        with pytest.raises(PruneError, match="--prune-moe-ffn-hidden-size"):
            pruned_megatron_state({"decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.zeros(2, 2)},
                                  KeptParts(layers=[0], ffn=[[0]]), gated=gated)
        # 32 -> 24 hidden channels: the student of that width (heads of the teacher's 8) loads strictly and runs
        hidden = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:24].tolist()
        narrow = _megatron_gpt(4, 48, gated, seed + 2, hidden=24)
        teacher = _megatron_gpt(4, 48, gated, seed)
        state = pruned_megatron_state(teacher.state_dict(), KeptParts(layers=[0, 1, 2, 3], hidden=sorted(hidden)),
                                      gated=gated)
        narrow.load_state_dict(state, strict=True)
        h, ours = torch.tensor(sorted(hidden)), teacher.state_dict()
        for name, dim in [("embedding.word_embeddings.weight", 1), ("embedding.position_embeddings.weight", 1),
                          ("decoder.layers.1.self_attention.linear_qkv.weight", 1),
                          ("decoder.layers.1.self_attention.linear_proj.weight", 0),
                          ("decoder.layers.1.mlp.linear_fc1.weight", 1), ("decoder.layers.1.mlp.linear_fc2.weight", 0),
                          ("decoder.layers.2.input_layernorm.weight", 0),
                          ("decoder.layers.2.pre_mlp_layernorm.bias", 0),
                          ("decoder.final_layernorm.weight", 0), ("output_layer.weight", 1)]:
            assert torch.equal(state[name], ours[name].index_select(dim, h)), name
        with torch.no_grad():
            assert torch.isfinite(narrow(tokens, positions, None)).all()


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_pruned_megatron_state_is_the_teacher_without_the_cut_parts(seed, gated):
    spawn(_megatron_state_worker, seed, gated, world_size=1)


def _megatron_moe(seed: int, *, hidden: int = 32, moe_ffn: int = 48, dtype=torch.float32):
    """A two-layer GPT-OSS-style megatron-core MoE (4 experts, top-2, clamped quick-GeGLU, biases,
    RMSNorm) on the local spec: GroupedGemmExperts, whose grouped path runs in bf16 on the CPU and
    whose sequential fallback runs in fp32."""
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                            ffn_hidden_size=moe_ffn, moe_ffn_hidden_size=moe_ffn, num_moe_experts=4, moe_router_topk=2,
                            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                            gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                            activation_func_clamp_value=7.0, bias_activation_fusion=False, add_bias_linear=True,
                            normalization="RMSNorm", use_cpu_initialization=True, params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
                            init_method_std=0.3)
    return build_gpt_model(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="rope",
                           use_te=False).eval()


def _megatron_moe_worker(rank, world, seed):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        teacher = _megatron_moe(seed)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        positions = torch.arange(16).expand(2, 16)

        # the experts' fc2 input through both paths: grouped (bf16, the tap) and sequential (fp32, each
        # linear_fc2), routed alike: the fp32 model's routers return the bf16 model's choices (a near-tie
        # routes a token elsewhere in bf16 on some seeds, which moves two experts' norms by a whole token)
        grouped = _megatron_moe(seed, dtype=torch.bfloat16)
        grouped.load_state_dict({k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                                 for k, v in teacher.state_dict().items()})
        sequential, routes, scores = _megatron_moe(seed), [], {}
        hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: routes.append(out))
                 for layer in grouped.decoder.layers]
        hooks += [layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: (routes[i][0].float(), routes[i][1]))
                  for i, layer in enumerate(sequential.decoder.layers)]
        for name, model in (("grouped", grouped), ("sequential", sequential)):
            with ImportanceCollector(model) as collector, torch.no_grad():
                model(tokens, positions, None)
            scores[name] = collector.scores()
        for hook in hooks:
            hook.remove()
        assert scores["sequential"].expert_ffn.shape == (2, 4, 48) and scores["sequential"].hidden.shape == (32,)
        for part in ("expert_ffn", "hidden"):
            ours, theirs = getattr(scores["grouped"], part), getattr(scores["sequential"], part)
            assert rel_err(ours, theirs) < 2e-2, (part, rel_err(ours, theirs))  # bf16: ~0.009

        # experts 48 -> 24 wide: the teacher with the cut channels' fc2 columns zeroed
        kept = KeptParts(layers=[0, 1], expert_ffn=_kept_channels(seed, 2, 4, 48, 24))
        student = _megatron_moe(seed + 1, moe_ffn=24)
        student.load_state_dict(pruned_megatron_state(teacher.state_dict(), kept, gated=True), strict=True)
        with torch.no_grad():
            ours = student(tokens, positions, None)
            for layer, channels in zip(teacher.decoder.layers, kept.expert_ffn):
                for expert, ch in zip(layer.mlp.experts.local_experts, channels):
                    expert.linear_fc2.weight[:, [c for c in range(48) if c not in ch]] = 0.0
            theirs = teacher(tokens, positions, None)
        assert rel_err(ours, theirs) < TOL, rel_err(ours, theirs)
        teacher = _megatron_moe(seed)  # the one before the zeroing

        # with experts cut too: each kept expert's channels, renumbered with it; nothing cut: the teacher's
        mine = teacher.state_dict()
        channels = [list(range(0, 48, 2)), list(range(24)), list(range(24, 48))]
        state = pruned_megatron_state(mine, KeptParts(layers=[0, 1], experts=[[0, 1, 3]] * 2,
                                                      expert_ffn=[channels] * 2), gated=True)
        fc1 = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.{}"
        rows = torch.tensor(channels[2] + [48 + c for c in channels[2]])  # gate and linear halves
        assert torch.equal(state[fc1.format(2, "weight")], mine[fc1.format(3, "weight")][rows])
        assert torch.equal(state[fc1.format(2, "bias")], mine[fc1.format(3, "bias")][rows])
        assert fc1.format(3, "weight") not in state
        everything = pruned_megatron_state(mine, KeptParts(layers=[0, 1], expert_ffn=[[list(range(48))] * 4] * 2,
                                                           hidden=list(range(32))), gated=True)
        assert everything.keys() == mine.keys()
        assert all(torch.equal(everything[k], v) for k, v in mine.items() if isinstance(v, torch.Tensor))

        # 32 -> 24 hidden channels: the student of that width loads strictly and runs
        hidden = sorted(torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:24].tolist())
        state = pruned_megatron_state(mine, KeptParts(layers=[0, 1], hidden=hidden), gated=True)
        narrow = _megatron_moe(seed + 2, hidden=24)
        narrow.load_state_dict(state, strict=True)
        h = torch.tensor(hidden)
        for name, dim in [("decoder.layers.0.mlp.router.weight", 1),
                          ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 1),
                          ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 0),
                          ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias", 0),
                          ("decoder.layers.0.self_attention.linear_proj.bias", 0),
                          ("decoder.layers.1.pre_mlp_layernorm.weight", 0)]:
            assert torch.equal(state[name], mine[name].index_select(dim, h)), name
        with torch.no_grad():
            assert torch.isfinite(narrow(tokens, positions, None)).all()


def test_expert_channels_and_hidden_of_a_megatron_moe(seed):
    """The experts' activation scores through the grouped path's tap equal those of the sequential
    path; the expert-width cut of a megatron-core MoE computes the teacher with the cut channels
    switched off; the hidden cut loads strictly into the narrower model."""
    spawn(_megatron_moe_worker, seed, world_size=1)


def _expert_parallel_scores_worker(rank, world, seed):
    from megatron.core import parallel_state

    with megatron_cpu_patches():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)  # EP 2 over DP 2: EDP 1
        model = _megatron_moe(seed)
        assert len(model.decoder.layers[0].mlp.experts.local_experts) == 2
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed + rank))
        with ImportanceCollector(model, dp_group=parallel_state.get_data_parallel_group()) as collector:
            with torch.no_grad():
                model(tokens, torch.arange(16).expand(2, 16), None)
        local = [sq.clone() for sq in collector.expert_ffn_sq]  # this rank's 2 experts, both ranks' tokens
        scores = collector.scores()
        assert scores.tokens == world * 32 and scores.expert_ffn.shape == (2, 4, 48)
        for layer, sq in enumerate(local):  # this rank's experts in its block of the gathered 4, as they are
            torch.testing.assert_close(scores.expert_ffn[layer, 2 * rank:2 * rank + 2], sq.sqrt(), rtol=0, atol=0)
        # routing mass over both ranks' tokens: an expert saw activation exactly where tokens went to it
        assert torch.equal(scores.expert_ffn.sum(-1) > 0, scores.experts > 0)


def test_expert_channel_scores_under_expert_parallelism(seed):
    """EP 2: each rank's experts' channel norms land in its block of the gathered [E, I], over the
    tokens of every data-parallel rank."""
    spawn(_expert_parallel_scores_worker, seed, world_size=2)


def test_student_flags_keep_the_head_width():
    from types import SimpleNamespace

    from megatron_kd.commands.prune import student_flags

    args = SimpleNamespace(kv_channels=None, hidden_size=3072, num_attention_heads=24)  # Llama-3.2-3B: 128 wide
    opts = SimpleNamespace(prune_num_layers=None, prune_num_experts=None, prune_ffn_hidden_size=4096,
                           prune_num_attention_heads=16, prune_moe_ffn_hidden_size=None, prune_hidden_size=None,
                           out="/models/student")
    assert student_flags(args, opts) == ["--ffn-hidden-size", "4096", "--num-attention-heads", "16",
                                         "--kv-channels", "128", "--kd-student-hf", "/models/student"]
    # GPT-OSS-120B narrower, with narrower experts: 64 heads of 64 over 2,048 channels
    args = SimpleNamespace(kv_channels=64, hidden_size=2880, num_attention_heads=64)
    opts = SimpleNamespace(prune_num_layers=None, prune_num_experts=None, prune_ffn_hidden_size=None,
                           prune_num_attention_heads=None, prune_moe_ffn_hidden_size=1440, prune_hidden_size=2048,
                           out="/models/student")
    assert student_flags(args, opts) == ["--moe-ffn-hidden-size", "1440", "--hidden-size", "2048",
                                         "--kv-channels", "64", "--kd-student-hf", "/models/student"]


def _fewer_heads_worker(rank, world, tmp, seed):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        teacher_dir = make_tiny_gpt_oss(Path(tmp) / "teacher", seed=seed)  # 4 heads over 2 groups, of 16
        student_dir = write_pruned_hf(teacher_dir, Path(tmp) / "student", KeptParts(layers=[0, 1],
                                                                                     heads=[[0, 3], [1, 2]]))
        # the student run: the teacher's flags with what prune prints for a heads cut
        _, student = build_student(tiny_flags(student_dir, "--num-attention-heads", "2", "--kv-channels", "16"))
        tokens = torch.randint(0, TOKENIZER_TOKENS, (2, GPT_OSS_SEQ), generator=torch.Generator().manual_seed(seed))
        assert rel_err(megatron_logits(student.eval(), tokens), reference_logits(student_dir, tokens)) < 1e-4
    forget_megatron()
    with megatron_cpu_patches():
        # hidden 64 -> 48 and experts 96 -> 64 wide: the student run adds what prune prints for these cuts
        hidden = sorted(torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:48].tolist())
        kept = KeptParts(layers=[0, 1], expert_ffn=_kept_channels(seed, 2, 4, 96, 64), hidden=hidden)
        student_dir = write_pruned_hf(teacher_dir, Path(tmp) / "narrow", kept)
        _, student = build_student(tiny_flags(student_dir, "--moe-ffn-hidden-size", "64", "--hidden-size", "48",
                                              "--kv-channels", "16"))
        assert rel_err(megatron_logits(student.eval(), tokens), reference_logits(student_dir, tokens)) < 1e-4


def test_students_with_fewer_heads_or_channels_import_into_megatron(tmp_path, seed):
    spawn(_fewer_heads_worker, str(tmp_path), seed, world_size=1)


def test_bad_cuts_of_the_120b_teacher_are_one_line_before_any_work():
    """What ``prune`` checks before it builds the teacher (GPT-OSS-120B's sizes: 36 layers in window /
    full pairs, 128 experts 2,880 wide, top-4, 64 query heads over 8 groups, no dense MLP, hidden 2,880;
    run at tensor-parallel size 2)."""
    from megatron_kd.prune import check_targets

    teacher = dict(num_layers=36, group_size=2, num_experts=128, experts_per_token=4, ffn_hidden_size=None,
                   num_attention_heads=64, num_query_groups=8, moe_ffn_hidden_size=2880, hidden_size=2880,
                   tensor_parallel_size=2)
    check_targets(PruneTargets(num_layers=24, num_experts=64, num_attention_heads=32, moe_ffn_hidden_size=1440,
                               hidden_size=2002), **teacher)  # fine: the heads keep 64 channels each
    # a student whose head dim is hidden / heads: 2,016 is 32 heads of 63
    check_targets(PruneTargets(num_attention_heads=32, hidden_size=2016), **teacher, head_dim_derived=True)
    with pytest.raises(PruneError, match=re.escape("--prune-hidden-size 2016: the student's head dim is hidden "
                                                   "size / heads, so a multiple of its 64 attention heads")):
        check_targets(PruneTargets(hidden_size=2016), **teacher, head_dim_derived=True)
    with pytest.raises(PruneError, match=re.escape("--prune-moe-ffn-hidden-size: the teacher has no experts")):
        check_targets(PruneTargets(moe_ffn_hidden_size=1024), num_layers=16, ffn_hidden_size=8192)  # Llama-3.2-1B
    for targets, message in [
        (PruneTargets(num_experts=129), "--prune-num-experts 129: between the router's top-k 4 and the teacher's 128"),
        (PruneTargets(num_experts=2), "--prune-num-experts 2: between the router's top-k 4"),
        (PruneTargets(num_layers=38), "--prune-num-layers 38: the teacher has 36 layers, dropped in groups of 2"),
        (PruneTargets(num_layers=23), "--prune-num-layers 23: the teacher has 36 layers, dropped in groups of 2"),
        (PruneTargets(num_attention_heads=60), "--prune-num-attention-heads 60: a multiple of the teacher's 8 query"),
        (PruneTargets(ffn_hidden_size=1024), "--prune-ffn-hidden-size: the teacher has no dense MLP layers (an FFN "
                                             "width of an MoE teacher's experts is --prune-moe-ffn-hidden-size)"),
        (PruneTargets(moe_ffn_hidden_size=3000), "--prune-moe-ffn-hidden-size 3000: between 1 and the teacher's 2880"),
        (PruneTargets(hidden_size=3000), "--prune-hidden-size 3000: a multiple of the tensor-parallel size 2 up to "
                                         "the teacher's 2880"),
        (PruneTargets(hidden_size=1441), "--prune-hidden-size 1441: a multiple of the tensor-parallel size 2"),
        (PruneTargets(hidden_size=0), "--prune-hidden-size 0: a multiple of the tensor-parallel size 2"),
    ]:
        with pytest.raises(PruneError, match=re.escape(message)) as e:
            check_targets(targets, **teacher)
        assert "\n" not in str(e.value)
