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

import torch
import torch.distributed as dist

from megatron_kd.ops.topk_kl_function import FusedTopKKLFunction
from megatron_kd.ops.topk_kl_options import (  # noqa: F401 (public names, importable from here too)
    DIVERGENCES,
    IMPLS,
    REDUCTIONS,
    STAT_NAMES,
    TAILS,
    TopKKLOptions,
    check_inputs,
    resolve_impl,
    unpack_stats,
)
from megatron_kd.ops.value_checks import HostCopy, PendingValueChecks  # noqa: F401


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
    divergence: str = "forward",
    jsd_beta: float = 0.5,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    chunk_size: int | None = None,
    reduction: str = "sum",
    impl: str = "auto",
    gradient_accumulation_fusion: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Chunked, vocab-parallel top-K KL (+ optional CE) from hidden states and the output weight.

    ``divergence`` picks the KD term over the outcomes ``tail`` defines (docs/DESIGN.md §1):
    "forward" KL(P‖Q), "reverse" KL(Q‖P) or "jsd" β·KL(P‖Mx) + (1−β)·KL(Q‖Mx), Mx = βP + (1−β)Q with
    β = ``jsd_beta``; reverse and jsd need tail "renorm" or "ghost".

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
        divergence=divergence, jsd_beta=jsd_beta, reduction=reduction, tp_group=tp_group, sequence_parallel=sequence_parallel,
        chunk_size=chunk_size, gradient_accumulation_fusion=gradient_accumulation_fusion,
        impl=resolve_impl(impl, hidden),
    )
    value_checks = check_inputs(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts)
    loss, stats = FusedTopKKLFunction.apply(
        hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts, value_checks
    )
    return loss, unpack_stats(stats, has_labels=labels is not None)
