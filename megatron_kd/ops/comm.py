"""Plain (non-autograd) collectives over an explicit tensor-parallel group.

The fused loss forms its gradients by hand inside the forward pass, so it needs raw collectives,
not Megatron's autograd mappings. Every helper takes the group explicitly and is a no-op for
``None`` or a group of size 1, so single-GPU / CPU callers pay nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_stack(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[*s] on every rank -> [world, *s], row r from rank r."""
    world = group_size(group)
    if world == 1:
        return x.unsqueeze(0)
    # Gathered along dim 0 ([world·s0, ...], the layout every backend accepts), then split.
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(world, *x.shape)


def gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence-parallel all-gather: [s/tp, ...] -> [s, ...] (rank order along dim 0)."""
    if group_size(group) == 1:
        return x
    return all_gather_stack(x, group).flatten(0, 1)


def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice of dim 0: [s, ...] -> [s/tp, ...]."""
    world = group_size(group)
    if world == 1:
        return x
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_reduce_sum_(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x
