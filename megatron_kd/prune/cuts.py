"""Which parts of the teacher a pruned student keeps, from importance scores and target sizes.

``choose_kept`` keeps the most important layer groups (in their original order), in each kept
layer the experts with the most routing mass, the FFN channels with the largest norms, in each kept
expert its FFN channels with the largest norms, and the attention heads with the largest context
norms, the same number in every query group so that the student's grouped-query layout stays; and
the same hidden channels everywhere, those with the largest norm outputs (each set in ascending
index order, so the student's weights are the teacher's rows in their order).
Ties go to the lower index, so the same scores always give the same student.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_kd.errors import UserError
from megatron_kd.options import Range, option
from megatron_kd.prune.importance import ImportanceScores


class PruneError(UserError):
    """A pruning target the teacher cannot meet; one line."""


_SIZE = dict(metavar="N", rule=Range(1, integer=True), unset="all")


@dataclass(frozen=True)
class PruneTargets:
    """pruning targets (megatron-kd prune): the student's sizes; None keeps the teacher's"""

    num_layers: int | None = option(**_SIZE)
    """Layers the student keeps: the teacher's most influential ones (GPT-OSS: whole window /
    full-attention pairs)."""
    num_experts: int | None = option(**_SIZE)
    """Experts each MoE layer keeps: those with the most routing mass."""
    ffn_hidden_size: int | None = option(**_SIZE)
    """FFN channels each dense MLP layer keeps (Llama, Qwen3): those with the largest activation
    norms."""
    num_attention_heads: int | None = option(**_SIZE)
    """Attention heads each layer keeps: in every query group the same number, those with the
    largest context norms (N a multiple of the query groups)."""
    moe_ffn_hidden_size: int | None = option(**_SIZE)
    """FFN channels each expert keeps (GPT-OSS; Megatron's --moe-ffn-hidden-size): those with the
    largest activation norms over the tokens routed to it. MXFP4 experts are then written
    dequantized (bf16)."""
    hidden_size: int | None = option(**_SIZE)
    """Hidden channels the model keeps, the same in every layer, the embedding and the output
    layer: those with the largest norm outputs (N a multiple of the tensor-parallel size; heads
    keep their width: the student adds --kv-channels; MXFP4 experts are written dequantized)."""


@dataclass(frozen=True)
class LayerCut:
    """What one student layer keeps of its teacher layer (None: all of it): ``experts``, dense
    ``ffn`` channels, attention ``heads``, per student expert its ``expert_ffn`` channels, and the
    ``hidden`` channels (the same in every layer; outside the layers the only part)."""

    experts: list[int] | None = None
    ffn: list[int] | None = None
    heads: list[int] | None = None
    expert_ffn: list[list[int]] | None = None
    hidden: list[int] | None = None


CHANNEL_FIELDS = ("ffn", "expert_ffn", "hidden")  # per-channel cuts: their indices go to arrays, not JSON


@dataclass
class KeptParts:
    """Teacher indices the student keeps: ``layers`` [L'] ascending; per kept layer (student order)
    its ``experts``, ``ffn`` channels, attention ``heads`` and, per kept expert (student order), its
    ``expert_ffn`` channels; the ``hidden`` channels of every layer and of the embedding, the final
    norm and the output layer (None: all of them)."""

    layers: list[int]
    experts: list[list[int]] | None = None
    ffn: list[list[int]] | None = None
    heads: list[list[int]] | None = None
    scores: ImportanceScores | None = None
    expert_ffn: list[list[list[int]]] | None = None
    hidden: list[int] | None = None

    def record(self) -> dict:
        """What ``prune.json`` says: the kept layers, experts and heads (None: all), the channel
        cuts made (their indices are in ``arrays``) and the calibration's size."""
        out = {"layers": self.layers, "experts": self.experts, "heads": self.heads,
               "channels_cut": [name for name in CHANNEL_FIELDS if getattr(self, name) is not None]}
        if self.scores is not None:
            out.update(group_size=self.scores.group_size, calibration_tokens=self.scores.tokens)
        return out

    def arrays(self) -> dict[str, torch.Tensor]:
        """The kept channels (``kept_ffn`` [L', F'], ``kept_expert_ffn`` [L', E', F'], ``kept_hidden``
        [H']) and every score (``score_<field>``): ``prune_scores.npz``."""
        out = {f"kept_{name}": torch.tensor(getattr(self, name)) for name in CHANNEL_FIELDS
               if getattr(self, name) is not None}
        if self.scores is not None:
            out.update({f"score_{name}": t for name, t in self.scores.tensors().items()})
        return out

    def entries(self, state: dict, layer: re.Pattern):
        """The teacher's ``state`` entries the student keeps, as (student layer, the name's rest, value,
        the ``LayerCut`` there): ``layer`` matches a layer's entry names as (index, rest); entries
        outside the layers come with layer None, their whole name and a cut of the hidden channels only."""
        new_index = {old: new for new, old in enumerate(self.layers)}
        for name, value in state.items():
            m = layer.match(name)
            if m is None:
                yield None, name, value, LayerCut(hidden=self.hidden)
            elif int(m.group(1)) in new_index:
                i = new_index[int(m.group(1))]
                yield i, m.group(2), value, LayerCut(*(None if part is None else part[i] for part in (
                    self.experts, self.ffn, self.heads, self.expert_ffn)), hidden=self.hidden)


def top_indices(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` largest scores, ties to the lower index, in ascending index order."""
    order = torch.sort(-torch.as_tensor(scores, dtype=torch.float64), stable=True).indices  # ties: index order
    return sorted(order[:k].tolist())


def _check_width(flag: str, target: int | None, teacher: int | None, missing: str) -> None:
    """An FFN width cut: the teacher has that part (else ``missing``), and the target is within it."""
    if target is None:
        return
    if teacher is None:
        raise PruneError(f"{flag}: {missing}")
    if not 0 < target <= teacher:
        raise PruneError(f"{flag} {target}: between 1 and the teacher's {teacher}")


def check_targets(targets: PruneTargets, *, num_layers: int, group_size: int = 1, num_experts: int | None = None,
                  experts_per_token: int | None = None, ffn_hidden_size: int | None = None,
                  num_attention_heads: int | None = None, num_query_groups: int | None = None,
                  moe_ffn_hidden_size: int | None = None, hidden_size: int | None = None,
                  tensor_parallel_size: int = 1, head_dim_derived: bool = False) -> None:
    """One ``PruneError`` line for the first target a teacher of these sizes cannot meet (``prune``
    calls it before any work; ``choose_kept`` again). ``num_experts`` None: no MoE layers;
    ``ffn_hidden_size`` None: no dense MLP layers; ``num_query_groups`` None: one per head;
    ``moe_ffn_hidden_size``: the experts' FFN width; ``hidden_size``: the model width, cut in
    multiples of ``tensor_parallel_size``; ``head_dim_derived``: the student's head dim would be
    hidden / heads (a student config without an explicit one; ``prune`` always writes it)."""
    g = group_size
    if targets.num_layers is not None and not (0 < targets.num_layers <= num_layers and targets.num_layers % g == 0):
        raise PruneError(f"--prune-num-layers {targets.num_layers}: the teacher has {num_layers} layers, dropped "
                         f"in groups of {g}" + (" (window / full-attention pairs)" if g > 1 else ""))
    if targets.num_experts is not None:
        if num_experts is None:
            raise PruneError("--prune-num-experts: the teacher has no experts")
        if not (experts_per_token or 1) <= targets.num_experts <= num_experts:
            raise PruneError(f"--prune-num-experts {targets.num_experts}: between the router's top-k "
                             f"{experts_per_token} and the teacher's {num_experts} experts")
    _check_width("--prune-ffn-hidden-size", targets.ffn_hidden_size, ffn_hidden_size,
                 "the teacher has no dense MLP layers (an FFN width of an MoE teacher's experts is "
                 "--prune-moe-ffn-hidden-size)")
    if targets.num_attention_heads is not None:
        heads, target = num_attention_heads, targets.num_attention_heads
        groups = num_query_groups or num_attention_heads
        if heads is None:
            raise PruneError("--prune-num-attention-heads: the teacher has no attention heads")
        if groups == heads:  # each head its own key / value: cutting it would cut them too
            raise PruneError(f"--prune-num-attention-heads: the teacher's {heads} heads have a key / value each "
                             f"(no grouped-query attention); only grouped-query heads are cut yet")
        if not 0 < target <= heads or target % groups:
            raise PruneError(f"--prune-num-attention-heads {target}: a multiple of the teacher's {groups} query "
                             f"groups up to its {heads} heads (each group keeps the same number of its "
                             f"{heads // groups} heads)")
    _check_width("--prune-moe-ffn-hidden-size", targets.moe_ffn_hidden_size,
                 moe_ffn_hidden_size if num_experts is not None else None,
                 "the teacher has no experts (a dense MLP's width is --prune-ffn-hidden-size)")
    if targets.hidden_size is not None:
        n, tp = targets.hidden_size, tensor_parallel_size
        if hidden_size is None or not 0 < n <= hidden_size or n % tp:
            raise PruneError(f"--prune-hidden-size {n}: a multiple of the tensor-parallel size {tp} up to the "
                             f"teacher's {hidden_size}")
        if head_dim_derived and num_attention_heads and n % (targets.num_attention_heads or num_attention_heads):
            heads = targets.num_attention_heads or num_attention_heads
            raise PruneError(f"--prune-hidden-size {n}: the student's head dim is hidden size / heads, so a "
                             f"multiple of its {heads} attention heads")


def choose_kept(scores: ImportanceScores, targets: PruneTargets, *, num_layers: int, num_experts: int | None,
                ffn_hidden_size: int | None, experts_per_token: int | None = None,
                num_attention_heads: int | None = None, num_query_groups: int | None = None,
                moe_ffn_hidden_size: int | None = None, hidden_size: int | None = None,
                tensor_parallel_size: int = 1, head_dim_derived: bool = False) -> KeptParts:
    """The parts of a teacher of ``num_layers`` layers (``num_experts`` experts of FFN width
    ``moe_ffn_hidden_size``, dense FFN width ``ffn_hidden_size``, ``num_attention_heads`` heads in
    ``num_query_groups`` groups, None: one per head; width ``hidden_size``) that the student of
    ``targets`` keeps (``check_targets`` first; then what the calibration pass saw: no router, no
    dense MLP, no attention, no experts' activation or no norm seen where a target needs it is one
    line too)."""
    g = scores.group_size
    check_targets(targets, num_layers=num_layers, group_size=g, num_experts=num_experts,
                  experts_per_token=experts_per_token, ffn_hidden_size=ffn_hidden_size,
                  num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                  moe_ffn_hidden_size=moe_ffn_hidden_size, hidden_size=hidden_size,
                  tensor_parallel_size=tensor_parallel_size, head_dim_derived=head_dim_derived)
    layers = list(range(num_layers))
    if targets.num_layers is not None and targets.num_layers != num_layers:
        groups = top_indices(scores.layer_groups, targets.num_layers // g)
        layers = [grp * g + j for grp in groups for j in range(g)]
    kept = KeptParts(layers=layers, scores=scores)
    for target, teacher, seen, name in ((targets.num_experts, num_experts, scores.experts, "--prune-num-experts"),
                                        (targets.ffn_hidden_size, ffn_hidden_size, scores.ffn,
                                         "--prune-ffn-hidden-size"),
                                        (targets.num_attention_heads, num_attention_heads, scores.heads,
                                         "--prune-num-attention-heads"),
                                        (targets.moe_ffn_hidden_size, moe_ffn_hidden_size, scores.expert_ffn,
                                         "--prune-moe-ffn-hidden-size"),
                                        (targets.hidden_size, hidden_size, scores.hidden, "--prune-hidden-size")):
        if target is not None and target != teacher and seen is None:
            local = name in ("--prune-moe-ffn-hidden-size", "--prune-hidden-size")  # read on the local spec only
            raise PruneError(f"{name}: the calibration pass saw no such part of the teacher"
                             + (" (its experts' activation and norms are read with --transformer-impl local)"
                                if local else ""))
    if targets.num_experts is not None and targets.num_experts != num_experts:
        kept.experts = [top_indices(scores.experts[i], targets.num_experts) for i in layers]
    if targets.ffn_hidden_size is not None and targets.ffn_hidden_size != ffn_hidden_size:
        kept.ffn = [top_indices(scores.ffn[i], targets.ffn_hidden_size) for i in layers]
    if targets.num_attention_heads is not None and targets.num_attention_heads != num_attention_heads:
        groups = num_query_groups or num_attention_heads
        per_group, size = targets.num_attention_heads // groups, num_attention_heads // groups
        kept.heads = [[grp * size + h for grp in range(groups)
                       for h in top_indices(scores.heads[i, grp * size:(grp + 1) * size], per_group)] for i in layers]
    if targets.moe_ffn_hidden_size is not None and targets.moe_ffn_hidden_size != moe_ffn_hidden_size:
        experts = kept.experts or [list(range(num_experts))] * len(layers)
        kept.expert_ffn = [[top_indices(scores.expert_ffn[i, e], targets.moe_ffn_hidden_size) for e in experts[j]]
                           for j, i in enumerate(layers)]
    if targets.hidden_size is not None and targets.hidden_size != hidden_size:
        kept.hidden = top_indices(scores.hidden, targets.hidden_size)
    return kept
