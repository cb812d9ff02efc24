"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materializes the [b·heads, s, s] score tensor in a
CUDA buffer; without Transformer Engine that rules out long contexts (32K) and CPU runs. This
module is a drop-in ``core_attention`` for the local GPT layer spec: same constructor and
``forward`` contract ([s, b, heads, head_dim] in, [s, b, heads·head_dim] out), computed by torch's
fused kernels (flash / cuDNN / memory-efficient on CUDA, a blocked kernel on CPU), with GQA
handled natively instead of by repeating keys and values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPADotProductAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPADotProductAttention does not support context parallelism")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"SDPADotProductAttention supports causal or no mask, got {attn_mask_type}")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        tp = 1 if pg_collection is None else pg_collection.tp.size()
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPADotProductAttention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask_type == AttnMaskType.causal, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        # [b, n, s, d] -> [s, b, n·d]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)
