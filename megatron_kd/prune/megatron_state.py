"""A pruned student as a megatron-core GPTModel state dict: the teacher's tensors, cut.

The counterpart of ``hf_checkpoint.py`` for a teacher that is a megatron-core model in memory (a
state dict of tensor-parallel size 1, megatron-core's local-spec names): the same ``KeptParts``, the
same row and column selections, so every kept weight is the teacher's. The student is the model
built with the student's sizes (``--num-layers``, ``--ffn-hidden-size``, ``--num-experts``,
``--moe-ffn-hidden-size``, ``--hidden-size`` with ``--kv-channels``...), which
then loads the returned dict with ``strict=True``.

- layers: ``decoder.layers.{i}.*`` renumbered;
- experts: ``mlp.router.weight`` / ``mlp.router.expert_bias`` rows, ``mlp.experts.local_experts.{e}.*``
  renumbered;
- FFN channels (dense MLP layers): rows of ``mlp.linear_fc1`` (in a gated unit both halves, gate
  and linear, as megatron-core's GLU splits fc1's output) and its bias, columns of ``mlp.linear_fc2``;
- attention heads: in ``self_attention.linear_qkv`` (megatron-core's fused layout, per query group
  its heads' queries, then its key and its value) the kept heads' query rows and every group's key
  and value rows; the kept heads' columns of ``linear_proj``; their ``core_attention.softmax_offset``
  entries (sinks);
- experts' FFN channels: per local expert (student index) its rows of ``linear_fc1`` (both halves
  in a gated unit) and its bias, its columns of ``linear_fc2``;
- hidden channels (the same everywhere): columns of the word (and position) embeddings, the output
  layer, ``linear_qkv``, ``linear_fc1``, the router and the experts' ``linear_fc1``; rows (and bias)
  of ``linear_proj``, ``linear_fc2`` and the experts' ``linear_fc2``; every norm's weight and bias.
  The heads keep their width: the student is built with the teacher's ``kv_channels``.
"""

from __future__ import annotations

import re

import torch

from megatron_kd.prune.cuts import KeptParts, LayerCut, PruneError
from megatron_kd.prune.hf_checkpoint import head_rows, keep_along

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _ffn_rows(channels: list[int], width: int, gated: bool) -> torch.Tensor:
    """fc1's output rows of ``channels``: in a gated unit the gate's and the linear half's."""
    rows = torch.tensor(channels)
    return torch.cat([rows, rows + width]) if gated else rows


def qkv_rows(heads: list[int], num_heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Rows of megatron-core's fused linear_qkv that a student keeping ``heads`` (of ``num_heads`` in
    ``groups`` query groups; each group keeps heads) keeps: per group, its kept heads' queries, its
    key, its value."""
    per_group = num_heads // groups
    rows = []
    for g in range(groups):
        base = g * (per_group + 2) * head_dim
        mine = [h % per_group for h in heads if h // per_group == g]
        rows += [base + r for r in head_rows(mine, head_dim).tolist()]
        rows += range(base + per_group * head_dim, base + (per_group + 2) * head_dim)
    return torch.tensor(rows)


# where a layer's entry holds the hidden channels (name after ``decoder.layers.{i}.``, experts' local
# index dropped: dim)
_HIDDEN_DIM = {"input_layernorm.weight": 0, "input_layernorm.bias": 0, "pre_mlp_layernorm.weight": 0,
               "pre_mlp_layernorm.bias": 0, "self_attention.linear_qkv.weight": 1,
               "self_attention.linear_proj.weight": 0, "self_attention.linear_proj.bias": 0,
               "mlp.linear_fc1.weight": 1, "mlp.linear_fc2.weight": 0, "mlp.linear_fc2.bias": 0,
               "mlp.router.weight": 1, "mlp.experts.linear_fc1.weight": 1, "mlp.experts.linear_fc2.weight": 0,
               "mlp.experts.linear_fc2.bias": 0}
_OUTER_HIDDEN_DIM = {"embedding.word_embeddings.weight": 1, "embedding.position_embeddings.weight": 1,
                     "output_layer.weight": 1, "decoder.final_layernorm.weight": 0, "decoder.final_layernorm.bias": 0}


def _fc1_cut(t: torch.Tensor, channels: list[int], gated: bool) -> torch.Tensor:
    """linear_fc1's rows (weight or bias) of ``channels``."""
    return keep_along(t, 0, _ffn_rows(channels, t.shape[0] // 2 if gated else t.shape[0], gated))


def _cut(name: str, t, cut: LayerCut, gated: bool, attention: tuple[int, int, int] | None = None,
         expert: int | None = None):
    """The part of one layer's entry the student keeps: ``name`` after ``decoder.layers.{i}.``, for a
    local expert's entry ``mlp.experts.linear_fc*`` with its student index ``expert``; ``attention``:
    the teacher's (heads, query groups, head dim) where ``heads`` are cut."""
    if not isinstance(t, torch.Tensor):
        return t  # _extra_state entries
    if cut.heads is not None:
        num_heads, groups, head_dim = attention
        if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            t = keep_along(t, 0, qkv_rows(cut.heads, num_heads, groups, head_dim))
        elif name == "self_attention.linear_proj.weight":
            t = keep_along(t, 1, head_rows(cut.heads, head_dim))
        elif name == "self_attention.core_attention.softmax_offset":
            t = keep_along(t, 0, cut.heads)
    if cut.experts is not None and name in ("mlp.router.weight", "mlp.router.expert_bias"):
        t = keep_along(t, 0, cut.experts)
    if cut.ffn is not None:
        if name.startswith("mlp.experts."):
            raise PruneError("an FFN width of the experts is --prune-moe-ffn-hidden-size (expert_ffn), not ffn")
        if name in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            t = _fc1_cut(t, cut.ffn, gated)
        elif name == "mlp.linear_fc2.weight":
            t = keep_along(t, 1, cut.ffn)
    if cut.expert_ffn is not None and expert is not None:
        if name in ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc1.bias"):
            t = _fc1_cut(t, cut.expert_ffn[expert], gated)
        elif name == "mlp.experts.linear_fc2.weight":
            t = keep_along(t, 1, cut.expert_ffn[expert])
    if cut.hidden is not None and name in _HIDDEN_DIM:
        t = keep_along(t, _HIDDEN_DIM[name], cut.hidden)
    return t


def pruned_megatron_state(state: dict, kept: KeptParts, *, gated: bool,
                          attention: tuple[int, int, int] | None = None) -> dict:
    """The student's state dict from the teacher's (megatron-core GPTModel, TP = 1); ``gated``: the
    MLP is a gated linear unit (``config.gated_linear_unit``); ``attention``: the teacher's (heads,
    query groups, head dim), needed when heads are cut."""
    if kept.heads is not None and attention is None:
        raise ValueError("cutting attention heads needs the teacher's (heads, query groups, head dim)")
    out = {}
    for i, rest, t, cut in kept.entries(state, _LAYER):
        if i is None:
            out[rest] = keep_along(t, _OUTER_HIDDEN_DIM[rest], cut.hidden) if (
                cut.hidden is not None and rest in _OUTER_HIDDEN_DIM and isinstance(t, torch.Tensor)) else t
            continue
        e = _LOCAL_EXPERT.match(rest)
        if e is None:
            out[f"decoder.layers.{i}.{rest}"] = _cut(rest, t, cut, gated, attention)
            continue
        expert = int(e.group(1))
        if cut.experts is not None:
            if expert not in cut.experts:
                continue
            expert = cut.experts.index(expert)
        out[f"decoder.layers.{i}.mlp.experts.local_experts.{expert}.{e.group(2)}"] = _cut(
            f"mlp.experts.{e.group(2)}", t, cut, gated, attention, expert)
    return out
