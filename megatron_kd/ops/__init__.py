"""Loss ops: the fused chunked top-K KL and its materializing reference."""

from megatron_kd.ops.topk_kl import fused_topk_kl
from megatron_kd.ops.topk_kl_options import DIVERGENCES, IMPLS, REDUCTIONS, TAILS, TopKKLOptions
from megatron_kd.ops.topk_kl_reference import topk_kl_reference

__all__ = ["DIVERGENCES", "IMPLS", "REDUCTIONS", "TAILS", "TopKKLOptions", "fused_topk_kl", "topk_kl_reference"]
