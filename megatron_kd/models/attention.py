"""Core attention for megatron-core's local (no Transformer Engine) layer spec.

megatron-core's local ``DotProductAttention`` materializes the [b·heads, s, s] score tensor in a
CUDA buffer, repeats K/V for GQA and builds its causal / sliding-window masks on CUDA. This module
keeps its constructor, parameters and checkpoint layout (it subclasses it: the learnable sink is
still ``core_attention.softmax_offset``, TP-sharded by head, so ModelOpt's HF importer/exporter
and Megatron checkpoints see the same names) and replaces ``forward``:

- causal without window or sink: ``torch.nn.functional.scaled_dot_product_attention`` (flash /
  cuDNN / memory-efficient on CUDA, a blocked kernel on CPU), GQA without repeating K/V;
- sliding window (``config.window_size`` on the layers ``config.window_attn_skip_freq`` selects)
  and/or a sink per head (``config.softmax_type`` "learnable" or "off-by-one"): the exact math
  path ``attention_with_sinks`` below, fp32 softmax, on any device. A sink is one extra key per
  head whose logit is the sink and whose value is zero: it takes probability mass, adds nothing.

Shapes: query [s, b, heads, d], key/value [s, b, groups, d] in; [s, b, heads·d] out.
Megatron's window (left, right) lets query i see keys i − left … i + right, so GPT-OSS's
128-key window (current token included) is (127, 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention


def visible_keys(sq: int, skv: int, *, causal: bool, window: tuple[int, int] | None,
                 device: torch.device) -> torch.Tensor | None:
    """Bool [sq, skv], True where query i may attend key j (queries are the last sq keys)."""
    if not causal and window is None:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1) + (skv - sq)
    j = torch.arange(skv, device=device).unsqueeze(0)
    keep = j <= i if causal else torch.ones(sq, skv, dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        keep = keep & (j >= i - left) & (j <= i + right)
    return keep


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                         causal: bool = True, window: tuple[int, int] | None = None,
                         sink: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Exact attention with an optional window and per-head sink logits; materializes the scores.

    q [b, n, s, d]; k, v [b, g, skv, d] with g dividing n (query head h reads key group h // (n/g),
    as megatron-core's repeat_interleave does); sink [n] or None. Softmax in fp32; returns
    [b, n, s, d] in q's dtype.
    """
    b, n, s, d = q.shape
    g, skv = k.shape[1], k.shape[2]
    r = n // g
    qg = q.float().view(b, g, r, s, d)
    scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [b, g, r, s, skv]
    keep = visible_keys(s, skv, causal=causal, window=window, device=q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sink is not None:
        sink_logits = sink.float().view(1, g, r, 1, 1).expand(b, g, r, s, 1)
        probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :skv]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, v.float().unsqueeze(2))  # [b, g, r, s, d]
    return out.view(b, n, s, d).to(q.dtype)


class CoreAttention(DotProductAttention):
    """Drop-in ``core_attention`` for the local spec: SDPA, or exact window / sink attention."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"CoreAttention supports causal or no mask, got {attn_mask_type}")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.window = (tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("CoreAttention supports neither packed sequences nor attention bias")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        dropout_p = self.dropout_p if self.training else 0.0
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.window is None and self.softmax_offset is None:
            context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal,
                                                     scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        else:
            context = attention_with_sinks(q, k, v, scale=self.softmax_scale, causal=causal, window=self.window,
                                           sink=self.softmax_offset, dropout_p=dropout_p)
        # [b, n, s, d] -> [s, b, n·d]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)
