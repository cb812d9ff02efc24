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
are stacked per call (autograd splits the gradient back to each expert's parameters). Used where
``grouped_mm`` has a backward (CUDA; CPU in bf16) with expert-tensor-parallel size 1; elsewhere the
sequential loop runs. Token dispatch (EP all-to-all / all-gather) is megatron-core's own.

``ExpertRowParallelLinear``: megatron-core 0.19's MLP adds an expert's fc2 bias in place, scaled
by the routing probability (``output += bias * probs``, mlp.py). With expert-parallel and
expert-tensor-parallel size 1 the row-parallel fc2 routes its output through the identity
"reduce" of a size-1 group, an autograd Function that returns its input as a view, and autograd
forbids the in-place add in backward. Over a group of one rank the reduction does nothing, so we
skip it, as megatron-core already does under expert parallelism: the MLP then owns a fresh tensor.
"""

from __future__ import annotations

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
        h = F.grouped_mm(x, torch.stack([m.weight for m in fc1]).transpose(1, 2), offs=offsets)
        expert_of_row = None
        if fc1[0].bias is not None:
            expert_of_row = torch.repeat_interleave(torch.arange(len(fc1), device=x.device), counts,
                                                    output_size=x.shape[0])
            h = h + torch.stack([m.bias for m in fc1])[expert_of_row]
        probs = permuted_probs.unsqueeze(-1)
        h = (mlp_activation(h, self.config) * probs).to(x.dtype)
        out = F.grouped_mm(h, torch.stack([m.weight for m in fc2]).transpose(1, 2), offs=offsets)
        if fc2[0].bias is not None:
            if expert_of_row is None:
                expert_of_row = torch.repeat_interleave(torch.arange(len(fc2), device=x.device), counts,
                                                        output_size=x.shape[0])
            out = out + (torch.stack([m.bias for m in fc2])[expert_of_row] * probs).to(out.dtype)
        return out, None
