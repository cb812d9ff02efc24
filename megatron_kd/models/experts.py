"""Expert layers for megatron-core's local (no Transformer Engine) MoE spec.

``GroupedGemmExperts``: megatron-core's ``SequentialMLP`` runs the local experts one after
another (two GEMMs and the activation per expert, with Python in between); this subclass keeps
its parameters, checkpoint layout and ModelOpt import/export names (``local_experts.N.linear_fc1``
...) and computes all experts with two ``torch.nn.functional.grouped_mm`` calls over the
dispatcher's expert-sorted tokens:

    h   = grouped_mm(x, W1ᵀ)[rows of expert e] + b1[e]          x: [T, hidden], W1: [E, 2I, hidden]
    a   = activation(h) · prob                                   gated / clamped as the MLP's own
    out = grouped_mm(a, W2ᵀ) + b2[e] · prob                      W2: [E, hidden, I]

which is exactly what ``SequentialMLP`` → ``MLP.forward`` (unfused bias path) computes. The weights
are stacked per call (autograd splits the gradient back to each expert's parameters). The bias of
each row's expert is gathered in forward; its gradient is a sum over each expert's contiguous rows
(``segment_reduce``), not the scatter-add that autograd would make of the gather (25% of the
layer's time on an H200). On CUDA the activation is one compiled elementwise kernel per direction.
Used where ``grouped_mm`` has a backward (CUDA; CPU in bf16) with expert-tensor-parallel size 1;
elsewhere the sequential loop runs. Token dispatch (EP all-to-all / all-gather) is megatron-core's.

``ExpertRowParallelLinear``: megatron-core 0.19's MLP adds an expert's fc2 bias in place, scaled
by the routing probability (``output += bias * probs``, mlp.py). With expert-parallel and
expert-tensor-parallel size 1 the row-parallel fc2 routes its output through the identity
"reduce" of a size-1 group, an autograd Function that returns its input as a view, and autograd
forbids the in-place add in backward. Over a group of one rank the reduction does nothing, so we
skip it, as megatron-core already does under expert parallelism: the MLP then owns a fresh tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.utils import get_pg_size


class ExpertRowParallelLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True  # no collective: a one-rank group has nothing to reduce


def mlp_activation(h: torch.Tensor, config) -> torch.Tensor:
    """The activation of megatron-core's MLP (its unfused path): gated with the clamp after the bias."""
    if not config.gated_linear_unit:
        return config.activation_func(h)
    gate, linear = torch.chunk(h, 2, dim=-1)
    if (limit := config.activation_func_clamp_value) is not None:
        gate = gate.clamp(max=limit)
        linear = linear.clamp(min=-limit, max=limit)
    return config.activation_func(gate) * (linear + config.glu_linear_offset)


@functools.lru_cache(maxsize=None)
def _compiled_activation(config_key: tuple):
    """``mlp_activation(h) · probs`` as one compiled kernel (one per direction); dynamic in the
    number of routed tokens, which changes every step under expert parallelism."""
    gated, clamp, offset, activation_func = config_key

    def activation(h, probs):
        if gated:
            gate, linear = torch.chunk(h, 2, dim=-1)
            if clamp is not None:
                gate = gate.clamp(max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            out = activation_func(gate) * (linear + offset)
        else:
            out = activation_func(h)
        return (out * probs.unsqueeze(-1)).to(h.dtype)

    return torch.compile(activation, dynamic=True)


def scaled_activation(h: torch.Tensor, probs: torch.Tensor, config) -> torch.Tensor:
    """The MLP's activation times each row's routing probability, in h's dtype."""
    if h.is_cuda:
        key = (config.gated_linear_unit, config.activation_func_clamp_value, config.glu_linear_offset,
               config.activation_func)
        return _compiled_activation(key)(h, probs)
    return (mlp_activation(h, config) * probs.unsqueeze(-1)).to(h.dtype)


class _ExpertBias(torch.autograd.Function):
    """out = h + bias[e(row)] · scale(row) for rows sorted by expert (``counts`` rows each; scale
    optional). The bias gradient is each expert's sum over its rows, in fp32, with no scatter."""

    @staticmethod
    def forward(ctx, h, bias, expert_of_row, counts, scale):
        ctx.save_for_backward(bias, expert_of_row, counts, scale)
        rows = bias.index_select(0, expert_of_row)
        if scale is None:
            return h + rows
        return (h + rows * scale.unsqueeze(-1)).to(h.dtype)  # as megatron-core's MLP: bias · prob in fp32

    @staticmethod
    def backward(ctx, grad):
        bias, expert_of_row, counts, scale = ctx.saved_tensors
        g = grad.float()
        grad_scale = None
        if scale is not None:
            grad_scale = (g * bias.index_select(0, expert_of_row).float()).sum(-1).to(scale.dtype)
            g = g * scale.unsqueeze(-1).float()
        grad_bias = torch.segment_reduce(g, "sum", lengths=counts, axis=0, unsafe=True).to(bias.dtype)
        return grad, grad_bias, None, None, grad_scale


def grouped_gemm_supported(x: torch.Tensor) -> bool:
    """Where ``grouped_mm`` has forward and backward (torch 2.11: CUDA; CPU only in bf16)."""
    return x.is_cuda or x.dtype == torch.bfloat16


class GroupedGemmExperts(SequentialMLP):
    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        if (not grouped_gemm_supported(x) or get_pg_size(self.tp_group) != 1 or self.config.fp8 or self.config.fp4
                or self.config.moe_apply_probs_on_input):
            return super().forward(x, tokens_per_expert, permuted_probs)
        fc1 = [e.linear_fc1 for e in self.local_experts]
        fc2 = [e.linear_fc2 for e in self.local_experts]
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device, dtype=torch.int64)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        expert_of_row = torch.repeat_interleave(torch.arange(len(fc1), device=x.device), counts,
                                                output_size=x.shape[0])
        h = F.grouped_mm(x, torch.stack([m.weight for m in fc1]).transpose(1, 2), offs=offsets)
        if fc1[0].bias is not None:
            h = _ExpertBias.apply(h, torch.stack([m.bias for m in fc1]), expert_of_row, counts, None)
        h = scaled_activation(h, permuted_probs, self.config)
        out = F.grouped_mm(h, torch.stack([m.weight for m in fc2]).transpose(1, 2), offs=offsets)
        if fc2[0].bias is not None:  # the MLP scales the fc2 bias by the routing probability too
            out = _ExpertBias.apply(out, torch.stack([m.bias for m in fc2]), expert_of_row, counts, permuted_probs)
        return out, None
