"""megatron-core's multi-tensor gradient norm and scale on torch's foreach kernels, for installs with
neither Transformer Engine nor Apex.

Without them, megatron-core's ``clip_grads`` and ``optimizer`` fall back to ``megatron.core.utils``'
``local_multi_tensor_l2_norm`` (a ``torch.norm`` per tensor in the gradients' dtype, then
``torch.tensor`` of the list of device scalars: one device-to-host copy per tensor) and
``local_multi_tensor_scale`` (``src * scale`` into a temporary, then a copy, per tensor). A
GPT-OSS-120B rank holds ~3,000 gradient tensors: the norm and the clip took ~0.2 s of its 0.55 s
optimizer step (one H200, 2026-12-03, eb43e7b, Megatron's timers).

Here the norm is ``torch._foreach_norm`` with fp32 accumulation and fp32 results (what TE's and Apex's
``multi_tensor_l2norm`` return), reduced on the device, and the scale is an in-place
``_foreach_mul_`` on CUDA when source and destination are the same tensors (the gradient clip), or one
``torch.mul(..., out=)`` per pair otherwise: the product in the promoted dtype rounded once into
the destination, as Apex's kernel does. Neither syncs with the host. ``install`` points megatron-core
at them only where it chose its local fallbacks.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
            *args):
    """``multi_tensor_l2norm``'s contract: (the l2 norm of every tensor of every list, fp32, shape [1];
    the per-tensor norms, fp32, when ``per_tensor``, else None)."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        none = torch.zeros(0, dtype=torch.float32, device=noop_flag.device)
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), (none if per_tensor else None)
    norms = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], factor) -> None:
    """``multi_tensor_scale``'s contract: ``tensor_lists[1][i] = tensor_lists[0][i] * factor``."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if len(sources) != len(targets):
        raise ValueError(f"multi-tensor scale: {len(sources)} source tensors for {len(targets)} targets")
    in_place = [s for s, t in zip(sources, targets) if s is t]
    if in_place and all(t.is_cuda for t in in_place):
        torch._foreach_mul_(in_place, factor)  # fp32 math, rounded once; a launch per group of tensors
    else:  # CPU's foreach rounds the factor to the tensors' dtype first: one op per tensor instead
        for tensor in in_place:
            tensor.mul_(factor)
    for source, target in zip(sources, targets):
        if source is not target:
            torch.mul(source, factor, out=target)


def install() -> bool:
    """Point megatron-core's optimizer modules at ``l2_norm`` / ``scale`` where they hold the local
    fallbacks (no TE, no Apex); idempotent. Returns whether anything was replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    replaced = []
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
        replaced.append("clip_grads.l2_norm_impl")
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale
            replaced.append(f"{module.__name__.rsplit('.', 1)[-1]}.multi_tensor_scale_impl")
    if replaced:
        logger.info("megatron_kd: foreach multi-tensor norm / scale for %s (no TE or Apex)", ", ".join(replaced))
    return bool(replaced)
