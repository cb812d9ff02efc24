"""Core attention for megatron-core's local (no Transformer Engine) layer spec, at long context.

megatron-core's local ``DotProductAttention`` materializes the [b·heads, s, s] score tensor in a
CUDA buffer (137 GB per layer at 32K with 64 heads), repeats K/V for GQA and builds its causal /
sliding-window masks on CUDA. ``CoreAttention`` keeps its constructor, parameters and checkpoint
layout (it subclasses it: the learnable sink is still ``core_attention.softmax_offset``, sharded
by head under TP, so ModelOpt's HF importer/exporter and Megatron checkpoints see the same names)
and replaces ``forward`` with ``core_attention`` below, which picks per layer by name:

  "sdpa"  plain causal layers: torch's SDPA (cuDNN / flash on CUDA), GQA without repeating K/V
  "flash4" causal or sliding-window layers, with or without sinks (SM90 / SM100 GPUs, when the
          ``flash-attn-4`` package is installed): FlashAttention-4's CuTe kernels, GQA and the sink
          native in forward and backward (``learnable_sink``), on megatron's [s, b, heads, d] memory
          without a copy when b = 1
  "cudnn" full-causal layers with sinks (CUDA): cuDNN's fused attention, then the sink folded in
          (see ``_CudnnSinkAttention``); K/V repeated to the query heads, as cuDNN needs
  "flex"  sliding-window layers, with or without sinks (CUDA): compiled ``flex_attention`` with a
          block mask (memory and time linear in s), sinks folded in through its log-sum-exp
  "varlen" packed documents only (CUDA): flash attention's variable-length kernels (below)
  "math"  the exact reference on any device (fp32 softmax, materializes the scores): CPU runs
  "auto"  flash4 for causal layers where it is installed and the GPU has its kernels (one H200 at
          32K, fwd + bwd: full causal with sinks 59.1 ms against cuDNN's 77.1, the window layer 2.9
          against flex's 6.2, Llama's plain causal 38.0 against SDPA's 42.4); else sdpa without
          windows or sinks, cudnn (full causal) / flex (windows) with them on CUDA, math elsewhere;
          with documents flex on CUDA, math elsewhere

A sink is one extra key per head whose logit is the sink and whose value is zero: it takes
probability mass and adds nothing. With lse the log-sum-exp of the real scores of a row and
σ the sink, lse' = logaddexp(lse, σ) and the output is o·exp(lse − lse') = o·sigmoid(lse − σ).

Packed documents (``documents=``, a ``megatron_kd.models.documents.Documents``; CoreAttention
takes it from ``PackedDocuments``): query i also sees only keys j >= start(i), the first token of
its document, on every path, so a packed sample computes what each document computes alone:

  "math"   the term in the materialized mask (CPU runs, the definition tests)
  "flex"   a block mask built from the documents (``_causal_block_mask``): per 128-query block,
           the key blocks that hold a visible pair, marked full where every pair is visible (no
           mask_mod there); mask_mod composes the document, causal and window terms; sinks fold in
           through the LSE as without documents. "auto" picks it for every packed layer on CUDA
           (window, full with sinks, plain causal): no host sync, measured against "varlen" in
           benchmarks/bench_packing.py
  "varlen" flash attention's variable-length kernels (aten ``_flash_attention_forward`` /
           ``_backward`` with cu_seqlens over the flattened b·s tokens; GQA and windows native),
           sinks folded in like cuDNN's (``_VarlenAttention``); needs the longest document on the
           host (``Documents.varlen``, one copy queued when the batch's documents are made)
  SDPA and cuDNN take no document layout without an [s, s] mask: "sdpa" / "cudnn" refuse documents.

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

from megatron_kd.models.documents import PackedDocuments

ATTENTION_IMPLS = ("auto", "sdpa", "flash4", "cudnn", "flex", "varlen", "math")


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
                   dropout_p: float = 0.0, documents=None) -> torch.Tensor:
    """Exact attention with an optional window, per-head sink logits and packed documents;
    materializes the scores.

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
    if documents is not None:  # key j at or after the first token of query i's document
        same = torch.arange(skv, device=q.device).view(1, 1, skv) >= documents.starts.unsqueeze(-1)  # [b, s, skv]
        keep = (same & keep).view(b, 1, 1, s, skv)
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


_FLEX_BLOCK = 128  # flex's default sparse block (queries and keys)


@functools.lru_cache(maxsize=32)
def _block_mask(sq: int, skv: int, causal: bool, window: tuple[int, int] | None, device: str):
    if causal and sq == skv:
        # self-attention from the blocks' bounds: create_block_mask evaluates every (query, key) pair
        # and sums them in int64, 128 GiB at 128K tokens
        return _causal_block_mask(sq, window, device=device)
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


def _blocks_in_order(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [b, nq, nkv] -> (count int32 [b, 1, nq], key-block indices int32 [b, 1, nq, nkv], the
    marked ones first in increasing order): flex's kv_num_blocks / kv_indices."""
    count = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count.unsqueeze(1).contiguous(), order.unsqueeze(1).contiguous()


def _causal_block_mask(s: int, window: tuple[int, int] | None, *, starts: torch.Tensor | None = None,
                       device=None, block: int = _FLEX_BLOCK):
    """Flex's block mask for causal self-attention over ``s`` tokens with an optional window, within
    documents (``starts`` int32 [b, s], each token's document start) or over the whole sequence
    (``starts`` None: one mask for any batch), built without evaluating [s, s] pairs.

    Query q sees keys [lower(q), upper(q)] with lower(q) = max(start(q), q − left) and
    upper(q) = q + min(right, 0); both ends grow with q, so query block [f_i, l_i] holds a visible
    pair with key block [f_j, l_j] iff f_j <= upper(l_i) and l_j >= lower(f_i), and every pair of
    the two blocks is visible iff l_j <= upper(f_i) and f_j >= lower(l_i) (a full block: flex skips
    mask_mod there). O(s + (s/block)²) work on the device.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = starts.device if starts is not None else device
    n = -(-s // block)
    left, right = window if window is not None else (None, 0)
    reach = min(right, 0)  # causal: no key after the query
    first = torch.arange(n, device=device) * block  # first and last token of each block
    last = (first + block).clamp(max=s) - 1

    def lower(i):  # [b, n]: the earliest key each query of positions i sees
        lo = starts[:, i].long() if starts is not None else torch.zeros(1, len(i), dtype=torch.long, device=device)
        return lo if left is None else torch.maximum(lo, i - left)

    f_q, l_q = first.view(1, n, 1), last.view(1, n, 1)
    f_kv, l_kv = first.view(1, 1, n), last.view(1, 1, n)
    visible = (f_kv <= l_q + reach) & (l_kv >= lower(first).unsqueeze(-1))  # [b, nq, nkv]
    whole = last - first + 1 == block  # a short last block stays partial, as create_block_mask leaves it
    full = (l_kv <= f_q + reach) & (f_kv >= lower(last).unsqueeze(-1)) & whole.view(1, n, 1) & whole.view(1, 1, n)
    kv_num, kv_indices = _blocks_in_order(visible & ~full)
    full_num, full_indices = _blocks_in_order(full)

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        keep = kv_idx <= q_idx + reach
        if starts is not None:
            keep = keep & (kv_idx >= starts[b_idx, q_idx])
        if left is not None:
            keep = keep & (kv_idx >= q_idx - left)
        return keep

    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(s, s))


def attention_flex(q, k, v, *, scale: float, causal: bool = True, window=None, sink=None,
                   documents=None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    if documents is None:
        mask = _block_mask(q.shape[2], k.shape[2], causal, window, str(q.device))
    else:  # one block mask per micro-batch and kind of layer, shared by the layers of that kind
        mask = documents.memo(("flex", window),
                              lambda: _causal_block_mask(documents.starts.shape[1], window, starts=documents.starts))
    out, aux = _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                return_aux=AuxRequest(lse=True))
    return out if sink is None else _fold_sink(out, aux.lse, sink)


# ------------------------------------------------------------------------------------------- flash4
FLASH4_ARCHS = (9, 10)  # compute capability majors whose FlashAttention-4 kernels take a sink's backward


@functools.lru_cache(maxsize=None)
def _flash4_installed() -> bool:
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except ImportError:
        return False
    return True


def flash4_available(device: torch.device) -> bool:
    """FlashAttention-4 (``pip install flash-attn-4``) is importable and ``device`` is an SM90 / SM100 GPU."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in FLASH4_ARCHS
            and _flash4_installed())


def attention_flash4(q, k, v, *, scale: float, causal: bool = True, window=None, sink=None) -> torch.Tensor:
    """FlashAttention-4 on q [b, heads, s, d], k / v [b, groups, s, d] (GQA native), causal and/or
    within ``window`` (its (left, right) is megatron's), with the sink per head as its
    ``learnable_sink``: forward, backward and the sink's gradient in its kernels. It reads
    [b, s, heads, d]; CoreAttention's views of megatron's [s, b, heads, d] are that memory when b = 1."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=scale, causal=causal,
                          window_size=window if window is not None else (None, None), learnable_sink=sink)
    out = out[0] if isinstance(out, tuple) else out  # (out, lse) in flash-attn-4 4.0
    return out.transpose(1, 2)


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


# ------------------------------------------------------------------------------------------- varlen
class _VarlenAttention(torch.autograd.Function):
    """Causal attention within documents on flash attention's variable-length kernels.

    q [T, heads, d], k / v [T, groups, d]: the micro-batch's b·s tokens, sample after sample;
    cu_seqlens int32 [n + 1] bound its n documents, ``longest`` (a host int) sizes the grid. GQA
    and a window (``left`` keys back) are native. The flash kernels return lse [heads, T]; a sink
    folds in as in ``_CudnnSinkAttention``: forward o' = o·exp(lse − lse'), backward fed (o', lse').
    """

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens, longest, scale, left):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, True, False, scale=scale,
            window_size_left=left, window_size_right=0)
        if sink is not None:
            lse_sink = torch.logaddexp(lse, sink.float().view(-1, 1))
            out = (out.float() * torch.exp(lse - lse_sink).t().unsqueeze(-1)).to(out.dtype)
            lse = lse_sink
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused, sink)
        ctx.longest, ctx.scale, ctx.left = longest, scale, left
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, cu_seqlens, rng_state, unused, sink = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            d_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.longest, ctx.longest, 0.0, True, rng_state, unused,
            scale=ctx.scale, window_size_left=ctx.left, window_size_right=0)
        d_sink = None
        if sink is not None:
            rowsum = (d_out.float() * out.float()).sum(-1).t()  # D' [heads, T]
            d_sink = -(torch.exp(sink.float().view(-1, 1) - lse) * rowsum).sum(1).to(sink.dtype)
        return dq, dk, dv, d_sink, None, None, None, None


def attention_varlen(q, k, v, *, scale: float, window=None, sink=None, documents) -> torch.Tensor:
    """Causal attention within ``documents`` (optionally windowed, with sinks) through
    ``_VarlenAttention``; q [b, heads, s, d], k / v [b, groups, s, d] -> [b, heads, s, d]."""
    if window is not None and window[1] != 0:
        raise ValueError(f"impl='varlen' takes windows (left, 0), got {window}")
    b, n, s, d = q.shape
    cu_seqlens, longest = documents.varlen()
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [b·s, heads, d]
    out = _VarlenAttention.apply(*flat, sink, cu_seqlens, longest, scale, None if window is None else window[0])
    return out.view(b, s, n, d).transpose(1, 2)


# ------------------------------------------------------------------------------------------ dispatch
def pick_impl(*, device: torch.device, causal: bool, window, sink, dropout_p: float,
              documents: bool = False) -> str:
    """The implementation ``core_attention(impl="auto")`` runs for a layer."""
    if documents:
        return "flex" if device.type == "cuda" and dropout_p == 0 else "math"
    if dropout_p == 0 and causal and flash4_available(device):
        return "flash4"
    if window is None and sink is None:
        return "sdpa"
    if device.type != "cuda" or dropout_p > 0:
        return "math"
    if window is None and causal:
        return "cudnn"
    return "flex"


def core_attention(q, k, v, *, scale: float, causal: bool = True, window: tuple[int, int] | None = None,
                   sink: torch.Tensor | None = None, dropout_p: float = 0.0, impl: str = "auto",
                   documents=None) -> torch.Tensor:
    """Attention of q [b, heads, s, d] over k, v [b, groups, skv, d] (GQA), causal and/or within a
    ``window``, with an optional sink logit per head ``sink`` [heads], and within the packed
    ``documents`` of each sample (``documents.Documents`` of shape [b, s]); returns [b, heads, s, d].
    ``impl`` names the implementation (``ATTENTION_IMPLS``; see the module docstring)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if documents is not None:
        if not causal:
            raise ValueError("packed documents are for causal attention")
        if documents.shape != (q.shape[0], q.shape[2]) or k.shape[2] != q.shape[2]:
            raise ValueError(f"documents of shape {documents.shape} for queries [b, heads, s, d] = {tuple(q.shape)} "
                             f"and {k.shape[2]} keys: self-attention over the packed samples is [b, s]")
        if impl in ("sdpa", "cudnn", "flash4"):
            raise ValueError(f"impl={impl!r} has no document masking; use 'flex', 'varlen' or 'math'")
    elif impl == "varlen":
        raise ValueError("impl='varlen' is for packed documents (documents=); use 'flex', 'cudnn' or 'sdpa'")
    if impl == "auto":
        impl = pick_impl(device=q.device, causal=causal, window=window, sink=sink, dropout_p=dropout_p,
                         documents=documents is not None)
    if impl == "math":
        return attention_math(q, k, v, scale=scale, causal=causal, window=window, sink=sink, dropout_p=dropout_p,
                              documents=documents)
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
    if impl == "flash4":
        if not flash4_available(q.device):
            raise ValueError(f"impl='flash4' needs the flash-attn-4 package and an SM90 / SM100 GPU; "
                             f"on {q.device} use 'auto'")
        return attention_flash4(q, k, v, scale=scale, causal=causal, window=window, sink=sink)
    if impl == "varlen":
        return attention_varlen(q, k, v, scale=scale, window=window, sink=sink, documents=documents)
    return attention_flex(q, k, v, scale=scale, causal=causal, window=window, sink=sink, documents=documents)


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
        self.impl = "auto"  # an ATTENTION_IMPLS name; benchmarks set it to compare the paths on one layer

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("CoreAttention does not take an attention bias")
        if packed_seq_params is not None and not isinstance(packed_seq_params, PackedDocuments):
            raise ValueError(f"CoreAttention takes packed documents as megatron_kd.models.documents.PackedDocuments; "
                             f"got {type(packed_seq_params).__name__} (qkv_format {packed_seq_params.qkv_format!r}: "
                             f"the THD format needs Transformer Engine's attention)")
        documents = None if packed_seq_params is None else packed_seq_params.documents
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = core_attention(q, k, v, scale=self.softmax_scale, causal=causal, window=self.window,
                                 sink=self.softmax_offset, dropout_p=self.dropout_p if self.training else 0.0,
                                 impl=self.impl, documents=documents)
        # [b, n, s, d] -> [s, b, n·d]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)
