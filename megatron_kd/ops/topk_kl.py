"""Public entry point of the top-K distillation loss: ``fused_topk_kl``.

Design (docs/DESIGN.md §1-2): the student's logits z = hidden · weightᵀ are never materialized for all
tokens. The op walks the tokens in chunks; per chunk it projects to this rank's vocabulary shard,
combines the row statistics (max, sum-exp, the K sparse teacher terms) across tensor-parallel
ranks with one small all-gather, forms the gradient of the chunk's logits in place and projects it
straight back (grad_hidden = G·W, grad_weight += Gᵀ·h). The loss is a scalar, so both gradients are
finished in the forward pass and backward only scales them by the incoming gradient.

Shapes:
    hidden         [..., h]       ([s/tp, b, h] under sequence parallelism, gathered to [s, b, h])
    weight         [V_local, h]   rows [r·V_local, (r+1)·V_local) of the vocabulary on TP rank r
    topk_ids       [..., K]       global vocabulary ids; -1 marks padding
    topk_logprobs  [..., K]       teacher log-probabilities; -inf marks padding
    loss_mask      [...]          float weights or bool (default: all ones)
    labels         [...]          hard next-token ids for the cross-entropy term

``impl`` picks the implementation by name: "torch" (plain torch, every device), "triton" (CUDA:
Triton kernels for the passes over each logits block) or "auto" (Triton for bf16/fp16/fp32 inputs
on CUDA, torch otherwise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_kd.ops.comm import group_size

TAILS = ("none", "renorm", "ghost")
DIVERGENCES = ("forward", "reverse", "jsd")
REDUCTIONS = ("sum", "mean")
IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class TopKKLOptions:
    """Everything about the loss that is not a tensor. Validated by ``check_inputs``."""

    kd_weight: float = 1.0
    """Weight of the distillation term (multiplied by temperature²)."""

    ce_weight: float = 0.0
    """Weight of the hard-label cross-entropy term (always at temperature 1); needs labels."""

    temperature: float = 1.0
    """Softmax temperature τ of the student; the cached teacher is tempered inside its top-K."""

    tail: Literal["none", "renorm", "ghost"] = "none"
    """How the teacher mass outside the top-K is treated (docs/DESIGN.md §1 table)."""

    reduction: Literal["sum", "mean"] = "sum"
    """"sum" over masked tokens, or "mean" = sum / Σ loss_mask (0 when everything is masked)."""

    tp_group: dist.ProcessGroup | None = None
    """Tensor-parallel group over which the vocabulary (weight rows) is split."""

    sequence_parallel: bool = False
    """hidden is this rank's sequence shard [s/tp, b, h]; teacher tensors cover the full sequence."""

    chunk_size: int | None = None
    """Tokens per chunk; None picks it from V_local and free memory."""

    gradient_accumulation_fusion: bool = False
    """Add the weight gradient straight into ``weight.main_grad`` (Megatron's fp32 grad buffer)."""

    impl: Literal["torch", "triton"] = "torch"
    """Implementation of the passes over each logits block ("auto" is resolved by ``resolve_impl``)."""


def resolve_impl(impl: str, hidden: torch.Tensor) -> str:
    """"auto" -> "triton" for bf16/fp16/fp32 CUDA tensors when Triton imports, else "torch"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    triton_ok = hidden.dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    )
    if impl == "triton" and not triton_ok:
        raise ValueError(
            f"impl='triton' needs bf16/fp16/fp32 CUDA tensors (or TRITON_INTERPRET=1 on CPU), got "
            f"{hidden.dtype} on {hidden.device}; use impl='torch' or 'auto'"
        )
    if impl == "auto":
        if not (triton_ok and hidden.is_cuda):
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return impl


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    opts: TopKKLOptions,
) -> "PendingValueChecks":
    """Raise ``ValueError`` naming the bad argument, for everything visible without reading values;
    return the value checks pending (``raise_if_bad``) with the global vocabulary size (``vocab``)."""
    if opts.tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {opts.tail!r}")
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


class HostCopy:
    """``tensor`` copied to the host without waiting; ``get()`` waits for that copy alone, not for
    the work queued after it."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.detach().clone()

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


class PendingValueChecks:
    """The checks that read tensor values (ids and labels in range, no NaN / +inf log-probabilities):
    ``launch`` queues them on the device with a copy to the host that does not wait; ``raise_if_bad``
    waits for that copy.

    ``fused_topk_kl`` launches them behind its first logits GEMM and reads the verdict once the
    first chunk's passes are queued, before its first write that cannot be undone (the weight
    gradient into ``main_grad``), so neither the checks nor the read leave the GPU idle. The work queued before the read is harmless with bad
    values: ids and labels outside this rank's shard are masked out of every kernel, and NaN only
    reaches buffers of the op's own.
    """

    def __init__(self, topk_ids, topk_logprobs, labels, *, vocab: int, tp: int):
        self.vocab = vocab
        self._note = f"vocabulary size {vocab} (weight rows {vocab // tp} x tp {tp})"
        self._inputs = (topk_ids, topk_logprobs, labels)
        self._names = None
        self._values = None  # HostCopy of the checks' results until read

    def launch(self) -> None:
        """Queue the checks and their copy to the host (once)."""
        if self._names is not None:
            return
        topk_ids, topk_logprobs, labels = self._inputs
        self._inputs = None
        checks = {}
        if topk_ids.numel():
            checks.update(id_lo=topk_ids.min(), id_hi=topk_ids.max(), nan=torch.isnan(topk_logprobs).any(),
                          posinf=(topk_logprobs == float("inf")).any())
        if labels is not None and labels.numel():
            checks.update(label_lo=labels.min(), label_hi=labels.max())
        self._names = list(checks)
        if checks:
            self._values = HostCopy(torch.stack([c.to(torch.int64) for c in checks.values()]))

    def raise_if_bad(self) -> None:
        """Wait for the verdict (the first time); raise ``ValueError`` naming the bad argument."""
        self.launch()
        if self._values is None:
            return
        got = dict(zip(self._names, self._values.get().tolist()))
        self._values = None  # read once
        vocab = self.vocab
        if "id_lo" in got:
            lo, hi = got["id_lo"], got["id_hi"]
            if lo < -1 or hi >= vocab:
                bad = lo if lo < -1 else hi
                raise ValueError(f"topk_ids holds id {bad}; ids must be -1 (padding) or in [0, {vocab}), {self._note}")
            if got["nan"]:
                raise ValueError("topk_logprobs holds NaN; padding entries must be -inf (or id -1)")
            if got["posinf"]:
                raise ValueError("topk_logprobs holds +inf; log-probabilities must be <= 0 or -inf for padding")
        if "label_lo" in got:
            lo, hi = got["label_lo"], got["label_hi"]
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"labels holds id {bad} outside [0, {vocab}), {self._note}; mask tokens with loss_mask"
                )


def fused_topk_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
    tail: str = "none",
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    chunk_size: int | None = None,
    reduction: str = "sum",
    impl: str = "auto",
    gradient_accumulation_fusion: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Chunked, vocab-parallel top-K KL (+ optional CE) from hidden states and the output weight.

    Returns ``(loss, stats)``: ``loss`` is a differentiable fp32 (fp64 for fp64 inputs) scalar,
    identical on every tensor-parallel rank; ``stats`` holds detached scalars with the same
    reduction as the loss: ``kd`` (the KD term before kd_weight·τ²), ``ce`` (only when labels are
    given), ``teacher_mass`` (top-K mass M) and ``tokens`` (Σ loss_mask).

    With ``gradient_accumulation_fusion`` the weight gradient is added to ``weight.main_grad``
    during this call (Megatron's fp32 buffer; no V×h temporary) and ``weight.grad_added_to_main_grad``
    is set; the loss must then be backpropagated with gradient 1 (bf16 training, per-token loss).
    """
    opts = TopKKLOptions(
        kd_weight=kd_weight, ce_weight=ce_weight, temperature=temperature, tail=tail,
        reduction=reduction, tp_group=tp_group, sequence_parallel=sequence_parallel,
        chunk_size=chunk_size, gradient_accumulation_fusion=gradient_accumulation_fusion,
        impl=resolve_impl(impl, hidden),
    )
    value_checks = check_inputs(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts)

    from megatron_kd.ops.topk_kl_function import FusedTopKKLFunction

    loss, stats = FusedTopKKLFunction.apply(
        hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts, value_checks
    )
    return loss, unpack_stats(stats, has_labels=labels is not None)


STAT_NAMES = ("kd", "ce", "teacher_mass", "tokens")


def unpack_stats(stats: torch.Tensor, *, has_labels: bool) -> dict[str, torch.Tensor]:
    out = dict(zip(STAT_NAMES, stats.detach().unbind(0)))
    if not has_labels:
        del out["ce"]
    return out
