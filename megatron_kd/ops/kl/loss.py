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

The keyword options and their defaults are the fields of ``TopKKLOptions`` (options.py), written
there once: ``loss_entry_point`` turns the function below, which takes them as one ``opts``, into
the public ``fused_topk_kl(hidden, weight, topk_ids, topk_logprobs, *, loss_mask=None, labels=None,
kd_weight=1.0, ...)`` whose signature lists them all.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_kd.ops.common import resolve_impl
from megatron_kd.ops.kl.function import FusedTopKKLFunction
from megatron_kd.ops.kl.options import LossResult, TopKKLOptions, check_inputs, loss_entry_point, unpack_stats


@loss_entry_point
def fused_topk_kl(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts: TopKKLOptions) -> LossResult:
    """Chunked, vocab-parallel top-K KL (+ optional CE) from hidden states and the output weight.

    The keyword options are documented on the fields of ``TopKKLOptions``.

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
    opts = dataclasses.replace(opts, impl=resolve_impl(opts.impl, hidden))
    value_checks = check_inputs(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts)
    loss, stats = FusedTopKKLFunction.apply(
        hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts, value_checks
    )
    return loss, unpack_stats(stats, has_labels=labels is not None)
