"""Core attention for megatron-core's local (no Transformer Engine) layer spec, at long context.

megatron-core's local ``DotProductAttention`` materializes the [b·heads, s, s] score tensor in a
CUDA buffer (137 GB per layer at 32K with 64 heads), repeats K/V for GQA and builds its causal /
sliding-window masks on CUDA. ``CoreAttention`` keeps its constructor, parameters and checkpoint
layout (it subclasses it: the learnable sink is still ``core_attention.softmax_offset``, sharded
by head under TP, so ModelOpt's HF importer/exporter and Megatron checkpoints see the same names)
and replaces ``forward`` with ``core_attention`` below, which picks per layer by name:

  "sdpa"  plain causal layers: torch's SDPA (cuDNN / flash on CUDA), GQA without repeating K/V
  "cudnn" full-causal layers with sinks (CUDA): cuDNN's fused attention, then the sink folded in
          (see ``_CudnnSinkAttention``); K/V repeated to the query heads, as cuDNN needs
  "flex"  sliding-window layers, with or without sinks (CUDA): compiled ``flex_attention`` with a
          block mask (memory and time linear in s), sinks folded in through its log-sum-exp
  "math"  the exact reference on any device (fp32 softmax, materializes the scores): CPU runs
  "auto"  sdpa, else cudnn / flex on CUDA and math elsewhere

A sink is one extra key per head whose logit is the sink and whose value is zero: it takes
probability mass and adds nothing. With lse the log-sum-exp of the real scores of a row and
σ the sink, lse' = logaddexp(lse, σ) and the output is o·exp(lse − lse') = o·sigmoid(lse − σ).

Shapes: query [b, heads, s, d], key/value [b, groups, s, d] (``core_attention``); the module takes
megatron's [s, b, heads, d] and returns [s, b, heads·d]. Megatron's window (left, right) lets
query i see keys i − left … i + right, so GPT-OSS's 128-key window is (127, 0).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

ATTENTION_IMPLS = ("auto", "sdpa", "cudnn", "flex", "math")


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


def attention_math(q, k, v, *, scale: float, causal: bool = True, window=None, sink=None,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Exact attention with an optional window and per-head sink logits; materializes the scores.

    Query head h reads key group h // (heads/groups), as megatron-core's repeat_interleave does.
    Softmax in fp32 (fp64 for fp64 inputs); returns [b, heads, s, d] in q's dtype.
    """
    b, n, s, d = q.shape
    g, skv = k.shape[1], k.shape[2]
    r = n // g
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).reshape(b, g, r, s, d)
    scores = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale  # [b, g, r, s, skv]
    keep = visible_keys(s, skv, causal=causal, window=window, device=q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sink is not None:
        sink_logits = sink.to(acc).view(1, g, r, 1, 1).expand(b, g, r, s, 1)
        probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :skv]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, v.to(acc).unsqueeze(2))  # [b, g, r, s, d]
    return out.reshape(b, n, s, d).to(q.dtype)


def _fold_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """o · sigmoid(lse − σ): attention over the real keys rescaled to leave the sink its share."""
    weight = torch.sigmoid(lse.float() - sink.float().view(1, -1, 1))
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)


# --------------------------------------------------------------------------------------------- flex
@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled kernel per shape (dynamic=False): the shapes of a training run do not change
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _block_mask(sq: int, skv: int, causal: bool, window: tuple[int, int] | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = skv - sq
    left, right = window if window is not None else (None, None)

    def mask_mod(b, h, q_idx, kv_idx):
        i = q_idx + offset
        keep = (kv_idx <= i) if causal else (kv_idx >= 0)
        if left is not None:
            keep = keep & (kv_idx >= i - left) & (kv_idx <= i + right)
        return keep

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=sq, KV_LEN=skv, device=device)


def attention_flex(q, k, v, *, scale: float, causal: bool = True, window=None, sink=None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    mask = _block_mask(q.shape[2], k.shape[2], causal, window, str(q.device))
    out, aux = _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                return_aux=AuxRequest(lse=True))
    return out if sink is None else _fold_sink(out, aux.lse, sink)


# -------------------------------------------------------------------------------------------- cuDNN
class _CudnnSinkAttention(torch.autograd.Function):
    """Causal attention with a sink per head on cuDNN's fused kernels.

    Forward: cuDNN gives o and lse over the real keys; the sink-inclusive row is
    lse' = logaddexp(lse, σ), o' = o·exp(lse − lse'). Backward: the sink is a key with value 0, so
    the attention *with* the sink has output o' and log-sum-exp lse'; cuDNN's backward fed (o', lse')
    recomputes P' = exp(s − lse') and D' = rowsum(dO∘o') of that attention and returns its dq, dk, dv.
    The sink's own gradient is dσ = Σ_rows p_sink·(dO·0 − D') = −Σ_rows exp(σ − lse')·D'.
    """

    @staticmethod
    def forward(ctx, q, k, v, sink, scale):
        b, n, s, d = q.shape
        r = n // k.shape[1]
        if r > 1:  # cuDNN's SDPA takes equal head counts
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)
        sink_ = sink.float().view(1, n, *([1] * (lse.dim() - 2)))
        lse_sink = torch.logaddexp(lse, sink_)
        out_sink = (out.float() * torch.exp(lse - lse_sink).view(b, n, s, 1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, out_sink, lse_sink, sink, seed, offset, cum_q, cum_k)
        ctx.scale, ctx.max_q, ctx.max_k, ctx.r = scale, max_q, max_k, r
        return out_sink

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out_sink, lse_sink, sink, seed, offset, cum_q, cum_k = ctx.saved_tensors
        if d_out.stride() != out_sink.stride():  # cuDNN wants dO laid out as O
            d_out = torch.empty_like(out_sink).copy_(d_out)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_out, q, k, v, out_sink, lse_sink, seed, offset, None, cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, True,
            scale=ctx.scale)
        b, n, s, d = q.shape
        if ctx.r > 1:  # sum the repeated heads' gradients back into their group
            dk = dk.view(b, n // ctx.r, ctx.r, s, d).sum(2)
            dv = dv.view(b, n // ctx.r, ctx.r, s, d).sum(2)
        rowsum = (d_out.float() * out_sink.float()).sum(-1)  # D' [b, n, s]
        p_sink = torch.exp(sink.float().view(1, n, 1) - lse_sink.view(b, n, s))
        d_sink = -(p_sink * rowsum).sum((0, 2)).to(sink.dtype)
        return dq, dk, dv, d_sink, None


def attention_cudnn(q, k, v, *, scale: float, sink=None) -> torch.Tensor:
    """Full causal attention on cuDNN, with sinks (``_CudnnSinkAttention``) or without (SDPA)."""
    if sink is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
    return _CudnnSinkAttention.apply(q, k, v, sink, scale)


# ------------------------------------------------------------------------------------------ dispatch
def pick_impl(*, device: torch.device, causal: bool, window, sink, dropout_p: float) -> str:
    """The implementation ``core_attention(impl="auto")`` runs for a layer."""
    if window is None and sink is None:
        return "sdpa"
    if device.type != "cuda" or dropout_p > 0:
        return "math"
    if window is None and causal:
        return "cudnn"
    return "flex"


def core_attention(q, k, v, *, scale: float, causal: bool = True, window: tuple[int, int] | None = None,
                   sink: torch.Tensor | None = None, dropout_p: float = 0.0, impl: str = "auto") -> torch.Tensor:
    """Attention of q [b, heads, s, d] over k, v [b, groups, skv, d] (GQA), causal and/or within a
    ``window``, with an optional sink logit per head ``sink`` [heads]; returns [b, heads, s, d].
    ``impl`` names the implementation (``ATTENTION_IMPLS``; see the module docstring)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = pick_impl(device=q.device, causal=causal, window=window, sink=sink, dropout_p=dropout_p)
    if impl == "math":
        return attention_math(q, k, v, scale=scale, causal=causal, window=window, sink=sink, dropout_p=dropout_p)
    if impl == "sdpa":
        if window is not None or sink is not None:
            raise ValueError("impl='sdpa' has neither windows nor sinks; use 'flex', 'cudnn' or 'math'")
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if dropout_p > 0:
        raise ValueError(f"impl={impl!r} does not do attention dropout; use 'math' or 'sdpa'")
    if impl == "cudnn":
        if window is not None or not causal:
            raise ValueError("impl='cudnn' is for full causal layers; use 'flex' for windows")
        return attention_cudnn(q, k, v, scale=scale, sink=sink)
    return attention_flex(q, k, v, scale=scale, causal=causal, window=window, sink=sink)


class CoreAttention(DotProductAttention):
    """Drop-in ``core_attention`` for the local spec (see the module docstring)."""

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
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = core_attention(q, k, v, scale=self.softmax_scale, causal=causal, window=self.window,
                                 sink=self.softmax_offset, dropout_p=self.dropout_p if self.training else 0.0)
        # [b, n, s, d] -> [s, b, n·d]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)
