"""Which parts of the teacher a pruned student keeps, from importance scores and target sizes.

``choose_kept`` keeps the most important layer groups (in their original order), in each kept
layer the experts with the most routing mass and the FFN channels with the largest norms (each
set in ascending index order, so the student's weights are the teacher's rows in their order).
Ties go to the lower index, so the same scores always give the same student.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_kd.errors import UserError
from megatron_kd.prune.importance import ImportanceScores


class PruneError(UserError):
    """A pruning target the teacher cannot meet; one line."""


@dataclass(frozen=True)
class PruneTargets:
    """The student's sizes; None keeps the teacher's."""

    num_layers: int | None = None
    num_experts: int | None = None
    ffn_hidden_size: int | None = None


@dataclass
class KeptParts:
    """Teacher indices the student keeps: ``layers`` [L'] ascending; per kept layer (student order)
    its ``experts`` and ``ffn`` channels (None: all of them)."""

    layers: list[int]
    experts: list[list[int]] | None = None
    ffn: list[list[int]] | None = None
    scores: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"layers": self.layers, "experts": self.experts, "ffn": self.ffn, "scores": self.scores}


def top_indices(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` largest scores, ties to the lower index, in ascending index order."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return sorted(order[:k])


def choose_kept(scores: ImportanceScores, targets: PruneTargets, *, num_layers: int, num_experts: int | None,
                ffn_hidden_size: int | None, experts_per_token: int | None = None) -> KeptParts:
    """The parts of a teacher of ``num_layers`` layers (``num_experts`` experts, FFN width
    ``ffn_hidden_size``) that the student of ``targets`` keeps."""
    g = scores.group_size
    layers = list(range(num_layers))
    if targets.num_layers is not None and targets.num_layers != num_layers:
        if not 0 < targets.num_layers <= num_layers or targets.num_layers % g:
            raise PruneError(f"--prune-num-layers {targets.num_layers}: the teacher has {num_layers} layers, dropped "
                             f"in groups of {g}" + (" (window / full-attention pairs)" if g > 1 else ""))
        groups = top_indices(scores.layer_groups, targets.num_layers // g)
        layers = [grp * g + j for grp in groups for j in range(g)]
    kept = KeptParts(layers=layers, scores=scores.to_dict())
    if targets.num_experts is not None and targets.num_experts != num_experts:
        if scores.experts is None:
            raise PruneError("--prune-num-experts: the teacher has no experts (no router was seen)")
        if not (experts_per_token or 1) <= targets.num_experts <= num_experts:
            raise PruneError(f"--prune-num-experts {targets.num_experts}: between the router's top-k "
                             f"{experts_per_token} and the teacher's {num_experts} experts")
        kept.experts = [top_indices(scores.experts[i], targets.num_experts) for i in layers]
    if targets.ffn_hidden_size is not None and targets.ffn_hidden_size != ffn_hidden_size:
        if scores.ffn is None:
            raise PruneError("--prune-ffn-hidden-size: the teacher has no dense MLP layers (expert widths are "
                             "not pruned yet)")
        if not 0 < targets.ffn_hidden_size <= ffn_hidden_size:
            raise PruneError(f"--prune-ffn-hidden-size {targets.ffn_hidden_size}: between 1 and the teacher's "
                             f"{ffn_hidden_size}")
        kept.ffn = [top_indices(scores.ffn[i], targets.ffn_hidden_size) for i in layers]
    return kept
