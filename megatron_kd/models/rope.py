"""Rotary position embedding (RoPE / YaRN) of q and k as one Triton kernel per direction.

megatron-core applies RoPE without Transformer Engine in torch ops (``rope_utils._apply_rotary_pos_emb_bshd``):
cos and sin of the table times the YaRN scale, cast to the activations' dtype, ``t·cos``, the
rotated half by ``chunk``, ``neg`` and ``cat``, ``·sin``, the sum and a final ``cat`` with the
unrotated tail; about seven passes over q and k in each direction, and the ``cat``s were the largest
of the elementwise kernels of a GPT-OSS layer pair at 32K (9 ms of 190). Transformer Engine's fused
RoPE takes no YaRN scale, so megatron-core falls back to those ops for GPT-OSS with TE as well.

For t = [t1 | t2] (the two halves of each head) and the table's angles [f1 | f2], scale m:

    out1 = m·(t1·cos f1 − t2·sin f1)          out2 = m·(t2·cos f2 + t1·sin f2)
    dt1  = m·(g1·cos f1 + g2·sin f2)          dt2  = m·(g2·cos f2 − g1·sin f1)

in fp32, one read and one write of each element; a program per token computes its cos / sin once
from the fp32 table and rotates every head. t is
read through its strides ([s, b, heads, d], d contiguous: megatron-core's q / k are views of the fused
qkv projection), the table broadcasts over batch ([s, 1, 1, d]) or not ([s, b, 1, d]: per-document
positions, documents.py). megatron-core rounds cos and sin to bf16 and each product and the sum in
bf16; this rounds once (so it differs from those ops by bf16 rounding, and equals them in fp32).

``install_fused_rope`` points megatron-core's attention at ``apply_rotary_pos_emb`` below, which runs
the kernel for CUDA tensors in the case it covers (``fused_rope_applies``: bshd, no cu_seqlens, RoPE
over the whole head, not interleaved, no TE fusion asked for) and megatron-core's own function
otherwise. The plain-torch reference is megatron-core's ``_apply_rotary_pos_emb_bshd``;
tests/models/test_rope.py checks the kernels against it (Triton's interpreter on the CPU, and CUDA).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

@triton.jit
def _rope_kernel(t_ptr, f_ptr, out_ptr, batch, heads, t_stride_s, t_stride_b, t_stride_h,
                 f_stride_s, f_stride_b, mscale,
                 HALF: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token (position s of sample b) per program: its angles' cos / sin once, every head."""
    token = tl.program_id(0).to(tl.int64)
    s, b = token // batch, token % batch
    c = tl.arange(0, HALF)
    f = s * f_stride_s + b * f_stride_b + c
    f1 = tl.load(f_ptr + f)
    f2 = tl.load(f_ptr + f + HALF)
    cos1, sin1 = (tl.cos(f1) * mscale)[None, :], (tl.sin(f1) * mscale)[None, :]
    cos2, sin2 = (tl.cos(f2) * mscale)[None, :], (tl.sin(f2) * mscale)[None, :]
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None]
    src = s * t_stride_s + b * t_stride_b + h[:, None] * t_stride_h + c[None, :]
    t1 = tl.load(t_ptr + src, mask=mask, other=0.0).to(tl.float32)
    t2 = tl.load(t_ptr + src + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        out1 = t1 * cos1 + t2 * sin2
        out2 = t2 * cos2 - t1 * sin1
    else:
        out1 = t1 * cos1 - t2 * sin1
        out2 = t2 * cos2 + t1 * sin2
    dst = (token * heads + h[:, None]) * (2 * HALF) + c[None, :]
    tl.store(out_ptr + dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + dst + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(t: torch.Tensor, freqs: torch.Tensor, mscale: float, backward: bool) -> torch.Tensor:
    """t [s, b, heads, d] (d contiguous) rotated by freqs [s, 1 or b, 1, d] (fp32): a new contiguous tensor."""
    s, b, heads, d = t.shape
    out = torch.empty((s, b, heads, d), dtype=t.dtype, device=t.device)
    f_stride_b = 0 if freqs.shape[1] == 1 else freqs.stride(1)
    _rope_kernel[(s * b,)](
        t, freqs, out, b, heads, t.stride(0), t.stride(1), t.stride(2), freqs.stride(0), f_stride_b, float(mscale),
        HALF=d // 2, BACKWARD=backward, BLOCK_H=triton.next_power_of_2(heads), num_warps=4,
    )
    return out


class FusedRope(torch.autograd.Function):
    """RoPE of t by the angles ``freqs`` (no gradient: a buffer's function) times ``mscale``."""

    @staticmethod
    def forward(ctx, t, freqs, mscale):
        ctx.save_for_backward(freqs)
        ctx.mscale = mscale
        return _rotate(t, freqs, mscale, backward=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _rotate(grad if grad.stride(-1) == 1 else grad.contiguous(), freqs, ctx.mscale, backward=True), None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """megatron-core's non-interleaved RoPE over the whole head, t [s, b, heads, d], freqs [s, 1 | b, 1, d]."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return FusedRope.apply(t, freqs.float().contiguous(), mscale)


def fused_rope_applies(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens, mla_rotary_interleaved) -> bool:
    """The case the kernel covers; everything else goes to megatron-core's own function."""
    return (t.is_cuda and t.dim() == 4 and cu_seqlens is None and not config.apply_rope_fusion
            and not config.rotary_interleaved and not mla_rotary_interleaved and config.mrope_section is None
            and freqs.dim() == 4 and freqs.shape[-1] == t.shape[-1] and t.shape[-1] % 2 == 0
            and freqs.shape[0] == t.shape[0] and freqs.shape[1] in (1, t.shape[1]) and freqs.shape[2] == 1
            and not freqs.requires_grad and t.shape[-1] // 2 == triton.next_power_of_2(t.shape[-1] // 2))


@functools.lru_cache(maxsize=None)
def _megatron_apply():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.apply_rotary_pos_emb


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None,
                         mla_rotary_interleaved: bool = False):
    """megatron-core's ``apply_rotary_pos_emb`` with the fused kernel where it applies."""
    if fused_rope_applies(t, freqs, config, cu_seqlens, mla_rotary_interleaved):
        return fused_rope(t, freqs, mscale)
    return _megatron_apply()(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                             mla_rotary_interleaved=mla_rotary_interleaved)


def install_fused_rope() -> None:
    """Route megatron-core's attention (``megatron.core.transformer.attention``, which imported the
    function by name) through ``apply_rotary_pos_emb``; idempotent. megatron-core's own function
    stays in ``rope_utils``: the cases the kernel does not cover reach it unchanged."""
    from megatron.core.transformer import attention

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
