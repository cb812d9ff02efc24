"""The fused RoPE kernel (megatron_kd/models/rope.py) against megatron-core's RoPE in torch ops.

1. fp32: output and the gradient of q equal megatron-core's ``_apply_rotary_pos_emb_bshd`` (≤ 1e-5
   relative), q read through the strides of a split of the fused qkv projection, with the YaRN scale,
   for a table shared by the batch [s, 1, 1, d] and per-document positions [s, b, 1, d]
2. bf16: within one bf16 rounding of the float64 result (on CUDA closer to it on average than
   megatron-core's ops, which round four times)
3. the dispatch: the kernel only for what it covers (CUDA, bshd, whole-head, not interleaved); the
   rest goes to megatron-core's function
Runs on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, as CI sets it).
"""

import os
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron_kd.models.rope import fused_rope, fused_rope_applies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
S, B, HEADS, D = 48, 2, 3, 16


def _qkv_query(gen, dtype):
    """q [s, b, heads, d] as a view into a fused qkv projection of one query group (with more groups
    megatron-core's reshape copies it)."""
    mixed = torch.randn(S, B, 1, (HEADS + 2) * D, generator=gen).to(DEVICE, dtype)
    query = mixed[..., :HEADS * D].reshape(S, B, HEADS, D)
    assert not query.is_contiguous() and query.stride(-1) == 1
    return query.detach().requires_grad_()


def _angles(gen, per_document: bool):
    inv_freq = 1.0 / (150000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    if per_document:  # each sample's positions restart where its documents begin
        positions = torch.stack([torch.arange(S) % 17, torch.arange(S) % 29]).t().float()  # [s, b]
        angles = positions[..., None] * inv_freq  # [s, b, d/2]
        return torch.cat([angles, angles], -1)[:, :, None].to(DEVICE)  # [s, b, 1, d]
    angles = torch.arange(S, dtype=torch.float32)[:, None] * inv_freq + torch.rand(1, generator=gen)
    return torch.cat([angles, angles], -1)[:, None, None].to(DEVICE)  # [s, 1, 1, d]


@needs_triton
@pytest.mark.parametrize("per_document", [False, True], ids=["shared", "per-document"])
def test_fp32_equals_megatron_core(seed, per_document):
    gen = torch.Generator().manual_seed(seed)
    q, freqs, mscale = _qkv_query(gen, torch.float32), _angles(gen, per_document), 1.3466
    ours = fused_rope(q, freqs, mscale)
    ref_q = q.detach().clone().requires_grad_()
    ref = _apply_rotary_pos_emb_bshd(ref_q, freqs, mscale=mscale)
    assert ours.shape == ref.shape and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(ref.shape, generator=gen).to(DEVICE)
    ours.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(q.grad, ref_q.grad, rtol=1e-5, atol=1e-5)


@needs_triton
def test_bf16_is_one_rounding_of_the_exact_result(seed):
    gen = torch.Generator().manual_seed(seed)
    q, freqs = _qkv_query(gen, torch.bfloat16), _angles(gen, False)
    exact = _apply_rotary_pos_emb_bshd(q.detach().double(), freqs.double(), mscale=1.3466)
    ours = fused_rope(q, freqs, 1.3466).double()
    # one bf16 rounding of the fp32 result: within one unit in the last place (2^-7 relative at most;
    # Triton's interpreter casts to bf16 toward zero, the GPU to nearest: half that)
    assert ((ours - exact).abs() <= exact.abs() * 2 ** -7 + 1e-6).all()
    if DEVICE == "cuda":  # rounded to nearest once, against megatron-core's four roundings
        megatron = _apply_rotary_pos_emb_bshd(q.detach(), freqs, mscale=1.3466).double()
        assert (ours - exact).abs().mean() <= (megatron - exact).abs().mean()


def test_the_kernel_takes_only_what_it_covers():
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, mrope_section=None)
    t = torch.empty(8, 2, 4, 64, device="meta")
    freqs = torch.empty(8, 1, 1, 64, device="meta")
    cuda = torch.device("cuda")

    def applies(t=t, freqs=freqs, config=config, cu_seqlens=None, mla=False, on_cuda=True):
        if on_cuda:  # is_cuda without a GPU: a meta tensor that says so
            t = SimpleNamespace(is_cuda=True, dim=t.dim, shape=t.shape, device=cuda)
        return fused_rope_applies(t, freqs, config, cu_seqlens, mla)

    assert applies()
    assert applies(freqs=torch.empty(8, 2, 1, 64, device="meta"))  # per-document positions
    assert not applies(on_cuda=False)  # CPU: megatron-core's ops
    assert not applies(cu_seqlens=torch.zeros(3))  # THD
    assert not applies(mla=True)
    assert not applies(freqs=torch.empty(8, 1, 1, 32, device="meta"))  # RoPE over part of the head
    assert not applies(config=SimpleNamespace(**{**vars(config), "rotary_interleaved": True}))
    assert not applies(config=SimpleNamespace(**{**vars(config), "apply_rope_fusion": True}))  # TE's
    assert not applies(t=torch.empty(8, 2, 4, 96, device="meta"), freqs=torch.empty(8, 1, 1, 96, device="meta"))
