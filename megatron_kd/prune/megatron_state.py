"""A pruned student as a megatron-core GPTModel state dict: the teacher's tensors, cut.

The counterpart of ``hf_checkpoint.py`` for a teacher that is a megatron-core model in memory (a
state dict of tensor-parallel size 1, megatron-core's local-spec names): the same ``KeptParts``, the
same row and column selections, so every kept weight is the teacher's. The student is the model
built with the student's sizes (``--num-layers``, ``--ffn-hidden-size``, ``--num-experts``), which
then loads the returned dict with ``strict=True``.

- layers: ``decoder.layers.{i}.*`` renumbered;
- experts: ``mlp.router.weight`` / ``mlp.router.expert_bias`` rows, ``mlp.experts.local_experts.{e}.*``
  renumbered;
- FFN channels (dense MLP layers): rows of ``mlp.linear_fc1`` (in a gated unit both halves, gate
  and linear, as megatron-core's GLU splits fc1's output) and its bias, columns of ``mlp.linear_fc2``;
- attention heads: in ``self_attention.linear_qkv`` (megatron-core's fused layout, per query group
  its heads' queries, then its key and its value) the kept heads' query rows and every group's key
  and value rows; the kept heads' columns of ``linear_proj``; their ``core_attention.softmax_offset``
  entries (sinks).
"""

from __future__ import annotations

import re

import torch

from megatron_kd.prune.cuts import KeptParts, PruneError
from megatron_kd.prune.hf_checkpoint import head_rows

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


def _cut(name: str, t, experts: list[int] | None, ffn: list[int] | None, gated: bool,
         heads: list[int] | None = None, attention: tuple[int, int, int] | None = None):
    """The part of one layer's entry (``name`` after ``decoder.layers.{i}.``) the student keeps;
    ``attention``: the teacher's (heads, query groups, head dim) where ``heads`` are cut."""
    if not isinstance(t, torch.Tensor):
        return t  # _extra_state entries
    if heads is not None:
        num_heads, groups, head_dim = attention
        if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return t.index_select(0, qkv_rows(heads, num_heads, groups, head_dim)).contiguous()
        if name == "self_attention.linear_proj.weight":
            return t.index_select(1, head_rows(heads, head_dim)).contiguous()
        if name == "self_attention.core_attention.softmax_offset":
            return t.index_select(0, torch.tensor(heads)).contiguous()
    if experts is not None and name in ("mlp.router.weight", "mlp.router.expert_bias"):
        return t.index_select(0, torch.tensor(experts)).contiguous()
    if ffn is None:
        return t
    if name.startswith("mlp.experts."):
        raise PruneError("expert FFN widths are not pruned yet: prune experts and layers of MoE teachers")
    if name in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        width = t.shape[0] // 2 if gated else t.shape[0]
        return t.index_select(0, _ffn_rows(ffn, width, gated)).contiguous()
    if name == "mlp.linear_fc2.weight":
        return t.index_select(1, torch.tensor(ffn)).contiguous()
    return t


def pruned_megatron_state(state: dict, kept: KeptParts, *, gated: bool,
                          attention: tuple[int, int, int] | None = None) -> dict:
    """The student's state dict from the teacher's (megatron-core GPTModel, TP = 1); ``gated``: the
    MLP is a gated linear unit (``config.gated_linear_unit``); ``attention``: the teacher's (heads,
    query groups, head dim), needed when heads are cut."""
    if kept.heads is not None and attention is None:
        raise ValueError("cutting attention heads needs the teacher's (heads, query groups, head dim)")
    out = {}
    for i, rest, t, (experts, ffn, heads) in kept.entries(state, _LAYER):
        if i is None:
            out[rest] = t
            continue
        e = _LOCAL_EXPERT.match(rest)
        if e is not None and experts is not None:
            if int(e.group(1)) not in experts:
                continue
            rest = f"mlp.experts.local_experts.{experts.index(int(e.group(1)))}.{e.group(2)}"
        out[f"decoder.layers.{i}.{rest}"] = _cut(rest, t, experts, ffn, gated, heads, attention)
    return out
