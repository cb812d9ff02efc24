"""The loss's options, its public signature and the checks of its inputs: what ``fused_topk_kl``
and ``topk_kl_reference`` share.

``TopKKLOptions`` holds everything about the loss that is not a tensor, with its defaults: the
keyword options of both public functions are its fields, and written nowhere else.
``loss_entry_point`` makes each public function from a function of (the six tensors, the options):
``fn(hidden, weight, topk_ids, topk_logprobs, *, loss_mask=None, labels=None, <every option>)``,
its signature (``inspect.signature``, ``help()``) listing every keyword with its default.
``check_inputs`` validates the options with the tensors' shapes, dtypes and devices (one
``ValueError`` naming the argument) and returns the checks that need tensor values, pending
(``value_checks.PendingValueChecks``); ``unpack_stats`` names the stats.
Imports run one way through the package: loss -> function -> this module.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.distributed as dist

from megatron_kd.ops.comm import group_size
from megatron_kd.ops.kl.value_checks import PendingValueChecks

TAILS = ("none", "renorm", "ghost")
DIVERGENCES = ("forward", "reverse", "jsd")
REDUCTIONS = ("sum", "mean")
# Inside logarithms of the teacher, the ghost tail's rest mass 1 - M is floored at this, so that
# KL(Q‖P) stays finite where the cached entries hold all of the teacher's mass (M = 1).
GHOST_REST_FLOOR = 1e-8


@dataclass(frozen=True)
class TopKKLOptions:
    """Everything about the loss that is not a tensor: the keyword options of ``fused_topk_kl`` and
    ``topk_kl_reference``, in their order, with their defaults. Validated by ``check_inputs``."""

    kd_weight: float = 1.0
    """Weight of the distillation term (multiplied by temperature²)."""

    ce_weight: float = 0.0
    """Weight of the hard-label cross-entropy term (always at temperature 1); needs labels."""

    temperature: float = 1.0
    """Softmax temperature τ of the student; the cached teacher is tempered inside its top-K."""

    tail: Literal["none", "renorm", "ghost"] = "none"
    """How the teacher mass outside the top-K is treated (docs/DESIGN.md §1 table)."""

    divergence: Literal["forward", "reverse", "jsd"] = "forward"
    """KL(P‖Q) ("forward"), KL(Q‖P) ("reverse") or β·KL(P‖Mx) + (1−β)·KL(Q‖Mx), Mx = βP + (1−β)Q ("jsd"),
    over the outcomes the tail defines (docs/DESIGN.md §1); reverse and jsd need tail renorm or ghost."""

    jsd_beta: float = 0.5
    """β of divergence="jsd": the teacher's weight in the mixture, in (0, 1)."""

    tp_group: dist.ProcessGroup | None = None
    """Tensor-parallel group over which the vocabulary (weight rows) is split."""

    sequence_parallel: bool = False
    """hidden is this rank's sequence shard [s/tp, b, h]; teacher tensors cover the full sequence."""

    chunk_size: int | None = None
    """Tokens per chunk; None picks it from V_local and free memory."""

    reduction: Literal["sum", "mean"] = "sum"
    """"sum" over masked tokens, or "mean" = sum / Σ loss_mask (0 when everything is masked)."""

    impl: Literal["auto", "torch", "triton"] = "auto"
    """Implementation of the passes over each logits block: "torch", "triton", or "auto" (Triton for
    bf16/fp16/fp32 CUDA inputs, torch otherwise); ``fused_topk_kl`` resolves it with
    ``common.resolve_impl`` before the chunk loop sees it."""

    gradient_accumulation_fusion: bool = False
    """Add the weight gradient straight into ``weight.main_grad`` (Megatron's fp32 grad buffer)."""


LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]


def loss_entry_point(body: Callable[..., LossResult]) -> Callable[..., LossResult]:
    """The public form of ``body(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts)``:
    the four tensors, then ``loss_mask`` and ``labels`` and the fields of ``TopKKLOptions`` as
    keywords with their defaults, and ``body``'s name and docstring. An unknown keyword is a
    ``TypeError`` naming it, as for any Python function."""
    option_names = frozenset(f.name for f in fields(TopKKLOptions))

    @functools.wraps(body, assigned=("__module__", "__name__", "__qualname__", "__doc__"))  # own annotations
    def entry(hidden: torch.Tensor, weight: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, *,
              loss_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None, **options) -> LossResult:
        if unknown := options.keys() - option_names:
            raise TypeError(f"{body.__name__}() got an unexpected keyword argument {min(unknown)!r}")
        return body(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, TopKKLOptions(**options))

    # The signature shown: entry's own parameters, then one keyword per option in place of **options.
    hints = typing.get_type_hints(TopKKLOptions)
    tensors = list(inspect.signature(entry, follow_wrapped=False, eval_str=True).parameters.values())[:-1]
    keyword = inspect.Parameter.KEYWORD_ONLY
    opts = [inspect.Parameter(f.name, keyword, default=f.default, annotation=hints[f.name])
            for f in fields(TopKKLOptions)]
    entry.__signature__ = inspect.Signature(tensors + opts, return_annotation=LossResult)
    return entry


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    opts: TopKKLOptions,
) -> PendingValueChecks:
    """Raise ``ValueError`` naming the bad argument, for everything visible without reading values;
    return the value checks pending (``raise_if_bad``) with the global vocabulary size (``vocab``)."""
    if opts.tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {opts.tail!r}")
    if opts.divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {opts.divergence!r}")
    if not (isinstance(opts.jsd_beta, (int, float)) and 0.0 < opts.jsd_beta < 1.0):
        raise ValueError(f"jsd_beta must be a number in (0, 1), got {opts.jsd_beta!r}")
    if opts.divergence != "forward" and opts.tail == "none":
        raise ValueError(
            f"divergence={opts.divergence!r} needs tail 'renorm' or 'ghost' (a distribution over the cached "
            "support); tail='none' is for divergence='forward' only"
        )
    if opts.reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {opts.reduction!r}")
    if not (opts.temperature > 0 and opts.temperature != float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {opts.temperature!r}")
    if opts.chunk_size is not None and (not isinstance(opts.chunk_size, int) or opts.chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {opts.chunk_size!r}")
    if opts.ce_weight > 0 and labels is None:
        raise ValueError(f"labels are required when ce_weight > 0 (ce_weight={opts.ce_weight})")

    if weight.dim() != 2:
        raise ValueError(f"weight must be [V_local, h], got shape {tuple(weight.shape)}")
    if hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., h] with h = weight.shape[1] = {weight.shape[1]}, "
            f"got shape {tuple(hidden.shape)}"
        )
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_logprobs.is_floating_point():
        raise ValueError(f"topk_logprobs must be floating point, got {topk_logprobs.dtype}")
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_logprobs {tuple(topk_logprobs.shape)} "
            f"must have the same shape (K = {topk_ids.shape[-1] if topk_ids.dim() else None} "
            f"vs {topk_logprobs.shape[-1] if topk_logprobs.dim() else None})"
        )

    tp = group_size(opts.tp_group)
    tokens = tuple(hidden.shape[:-1])
    if opts.sequence_parallel:
        tokens = (tokens[0] * tp, *tokens[1:])
    where = " (hidden is a sequence-parallel shard: dim 0 times tp)" if opts.sequence_parallel else ""
    if tuple(topk_ids.shape[:-1]) != tokens:
        raise ValueError(
            f"topk_ids must be [{', '.join(map(str, tokens))}, K] to match hidden{where}, "
            f"got shape {tuple(topk_ids.shape)}"
        )
    for name, t in (("loss_mask", loss_mask), ("labels", labels)):
        if t is not None and tuple(t.shape) != tokens:
            raise ValueError(f"{name} must have shape {tokens} to match hidden{where}, got {tuple(t.shape)}")
    for name, t in (("weight", weight), ("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs),
                    ("loss_mask", loss_mask), ("labels", labels)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")

    vocab = weight.shape[0] * tp
    if labels is not None and labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be int32 or int64, got {labels.dtype}")
    if opts.gradient_accumulation_fusion and not hasattr(weight, "main_grad"):
        raise ValueError("gradient_accumulation_fusion=True needs weight.main_grad (a Megatron DDP parameter)")
    return PendingValueChecks(topk_ids, topk_logprobs, labels, vocab=vocab, tp=tp)


STAT_NAMES = ("kd", "ce", "teacher_mass", "tokens")


def unpack_stats(stats: torch.Tensor, *, has_labels: bool) -> dict[str, torch.Tensor]:
    out = dict(zip(STAT_NAMES, stats.detach().unbind(0)))
    if not has_labels:
        del out["ce"]
    return out
