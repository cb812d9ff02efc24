"""Expert layers for megatron-core's local (no Transformer Engine) MoE spec.

``ExpertRowParallelLinear``: megatron-core 0.19's MLP adds an expert's fc2 bias in place, scaled
by the routing probability (``output += bias * probs``, mlp.py). With expert-parallel and
expert-tensor-parallel size 1 the row-parallel fc2 routes its output through the identity
"reduce" of a size-1 group, an autograd Function that returns its input as a view, and autograd
forbids the in-place add in backward. Over a group of one rank the reduction does nothing, so we
skip it, as megatron-core already does under expert parallelism: the MLP then owns a fresh tensor.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.utils import get_pg_size


class ExpertRowParallelLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True  # no collective: a one-rank group has nothing to reduce
