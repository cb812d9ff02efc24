"""``Bf16Adam``'s update as one Triton kernel per tensor: dequantize, Adam(W), quantize, round.

The torch path (``adam._chunk_step``) reads and writes each element in many passes (the moments'
table lookups, the update, the blockwise absmax, the binary search for the nearest code, the hash
of the rounding bits in 64-bit integers, the copies back), and launches them per chunk of every
tensor: a GPT-OSS-120B rank's 16.4B parameters in ~3,000 tensors. Here one program owns
``BLOCKS`` quantization blocks of 256 elements and does everything in registers: per element it
reads the bf16 weight and gradient and the two 8-bit codes (plus a scale per block), and writes
the weight and the codes back, 10 bytes, as a fused AdamW does for 16.

Same numbers as the torch path, in the same order of operations (``adam._adam_chunk``), with
IEEE-rounded division and square root (``div_rn`` / ``sqrt_rn``; Triton's ``/`` is approximate);
like the compiled path it contracts multiply-adds, so a value on a rounding boundary may land one
bf16 step or one 8-bit code away from eager torch on a few elements (``tests/optim``). The
rounding bits are ``rounding.random_bits16``'s hash in native 32-bit unsigned arithmetic (the
torch path emulates it in int64), bit for bit the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_kd.optim import quantize

BLOCKS = 4  # quantization blocks per program: 1,024 elements


@triton.jit
def _mix32(x):
    """``rounding._mix32`` (lowbias32) on uint32."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _nearest_codes(x, qmap_ptr):
    """``quantize.nearest_codes``: branchless binary search in the 256-entry table, then one step up
    when x is at least halfway to the next entry."""
    codes = tl.where(x >= tl.load(qmap_ptr + 128), 128, 0)
    for i in tl.static_range(7):
        codes += tl.where(x >= tl.load(qmap_ptr + codes + (64 >> i)), 64 >> i, 0)
    up = tl.minimum(codes + 1, 255)
    below = tl.load(qmap_ptr + codes)
    above = tl.load(qmap_ptr + up)
    return tl.where(x - below >= (above - below) * 0.5, up, codes)


@triton.jit
def _requantize(values, codes_ptr, scales_ptr, qmap_ptr, block_ids, offs, num_blocks, tiny):
    """Store [BLOCKS, 256] fp32 values (zero past the tensor's end) as their blocks' absmax scales
    and nearest codes; blocks past ``num_blocks`` are not stored."""
    scale = tl.maximum(tl.max(tl.abs(values), axis=1), tiny)
    codes = _nearest_codes(tl.math.div_rn(values, scale[:, None]), qmap_ptr)
    tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=block_ids[:, None] < num_blocks)
    tl.store(scales_ptr + block_ids, scale, mask=block_ids < num_blocks)


@triton.jit
def _uint32(halves_hi, halves_lo):
    return (halves_hi.to(tl.uint32) << 16) | halves_lo.to(tl.uint32)


# The rounding stream's words and the tensor's offset in it change with every step and tensor. Triton
# compiles a kernel per argument type (int32 below 2^31, int64 above) and per divisibility of an
# integer: they come as 16-bit halves, never specialized, and neither are the sizes (which only
# bound masks), so one compiled kernel serves every tensor of a kind.
@triton.jit(do_not_specialize=["n", "num_blocks", "key1_hi", "key1_lo", "key2_hi", "key2_lo", "offset_hi",
                               "offset_lo"])
def bf16_adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, m_scales_ptr, v_scales_ptr, qmap_signed_ptr, qmap_unsigned_ptr,
                     scalars_ptr, n, num_blocks, key1_hi, key1_lo, key2_hi, key2_lo, offset_hi, offset_lo, tiny,
                     QUANTIZED: tl.constexpr, ADAM_W: tl.constexpr, STOCHASTIC: tl.constexpr,
                     BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """One Adam(W) step of elements [pid·BLOCKS·BLOCK, ...) of a flat tensor of ``n`` elements.

    QUANTIZED: m_ptr / v_ptr are the packed moments' codes (uint8, ``num_blocks``·BLOCK of them, the
    last block's padding included) with their scales; else fp32 moments of n elements. ``scalars_ptr``:
    ``adam.step_scalars`` as fp32 on the device. ``key1``, ``key2``, ``offset`` (each as 16-bit
    halves): the rounding stream and this tensor's first element in it (STOCHASTIC only)."""
    pid = tl.program_id(0).to(tl.int64)
    block_ids = pid * BLOCKS + tl.arange(0, BLOCKS)
    offs = block_ids[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = offs < n
    in_blocks = block_ids[:, None] < num_blocks  # padding of the last block: codes exist, elements do not

    decay = tl.load(scalars_ptr + 0)
    l2 = tl.load(scalars_ptr + 1)
    lerp = tl.load(scalars_ptr + 2)
    beta2 = tl.load(scalars_ptr + 3)
    grad_sq = tl.load(scalars_ptr + 4)
    bias2_sqrt = tl.load(scalars_ptr + 5)
    eps = tl.load(scalars_ptr + 6)
    neg_step = tl.load(scalars_ptr + 7)

    p32 = tl.load(p_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    g32 = tl.load(g_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if QUANTIZED:
        m_scale = tl.load(m_scales_ptr + block_ids, mask=block_ids < num_blocks, other=1.0)
        v_scale = tl.load(v_scales_ptr + block_ids, mask=block_ids < num_blocks, other=1.0)
        m_code = tl.load(m_ptr + offs, mask=in_blocks, other=0).to(tl.int32)
        v_code = tl.load(v_ptr + offs, mask=in_blocks, other=0).to(tl.int32)
        m = tl.load(qmap_signed_ptr + m_code) * m_scale[:, None]
        v = tl.load(qmap_unsigned_ptr + v_code) * v_scale[:, None]
    else:
        m = tl.load(m_ptr + offs, mask=valid, other=0.0)
        v = tl.load(v_ptr + offs, mask=valid, other=0.0)

    # adam._adam_chunk, operation for operation
    if ADAM_W:
        p32 = p32 * decay
    else:
        g32 = g32 + p32 * l2
    # lerp_ as torch's kernel computes it: from the nearer end
    m = tl.where(lerp < 0.5, m + lerp * (g32 - m), g32 - (g32 - m) * (1.0 - lerp))
    v = v * beta2 + (g32 * grad_sq) * g32
    denom = tl.math.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p32 = p32 + tl.math.div_rn(m * neg_step, denom)
    # the padding of the last block quantizes as zeros (quantize.quantize pads with zeros)
    m = tl.where(valid, m, 0.0)
    v = tl.where(valid, v, 0.0)

    if STOCHASTIC:  # rounding.stochastic_round_bf16 with rounding.random_bits16's bits
        # offset + n <= 2^32 (Bf16Adam checks the tensor size): the element's index wraps nowhere
        index = offs.to(tl.uint32) + _uint32(offset_hi, offset_lo)
        h = _mix32(_mix32(index + _uint32(key1_hi, key1_lo)) ^ _uint32(key2_hi, key2_lo))
        bits16 = (h >> 16).to(tl.int32)
        bits = p32.to(tl.int32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        toward_zero = bits & -0x10000
        away = (bits16 < (bits & 0xFFFF)) & finite
        rounded = tl.where(away, toward_zero + 0x10000, toward_zero).to(tl.float32, bitcast=True)
        p32 = tl.where(finite, rounded, p32)
    tl.store(p_ptr + offs, p32.to(p_ptr.dtype.element_ty), mask=valid)

    if QUANTIZED:
        _requantize(m, m_ptr, m_scales_ptr, qmap_signed_ptr, block_ids, offs, num_blocks, tiny)
        _requantize(v, v_ptr, v_scales_ptr, qmap_unsigned_ptr, block_ids, offs, num_blocks, tiny)
    else:
        tl.store(m_ptr + offs, m, mask=valid)
        tl.store(v_ptr + offs, v, mask=valid)


def triton_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  qmaps: tuple[torch.Tensor, torch.Tensor], scalars: torch.Tensor, *, key: tuple[int, int] | None,
                  offset: int, adam_w_mode: bool) -> None:
    """One step of a whole contiguous tensor in place: ``param`` (bf16 / fp32), its gradient (any
    float dtype, contiguous), the moments as ``Bf16Adam`` stores them (packed 8-bit or fp32), the
    (signed, unsigned) maps and ``step_scalars`` as an fp32 device tensor."""
    n = param.numel()
    quantized = exp_avg.dtype == torch.uint8
    if quantized:
        (m, m_scales), (v, v_scales) = quantize.packed_views(exp_avg), quantize.packed_views(exp_avg_sq)
        num_blocks = m_scales.numel()
    else:
        m, v, m_scales, v_scales = exp_avg, exp_avg_sq, exp_avg, exp_avg_sq  # scales unused
        num_blocks = -(-n // quantize.BLOCK)
    words = (*(key if key is not None else (0, 0)), offset)
    halves = [half for word in words for half in (word >> 16, word & 0xFFFF)]
    grid = (triton.cdiv(num_blocks, BLOCKS),)
    bf16_adam_kernel[grid](
        param, grad, m, v, m_scales, v_scales, *qmaps, scalars, n, num_blocks, *halves,
        quantize.ZERO_BLOCK_SCALE, QUANTIZED=quantized, ADAM_W=adam_w_mode, STOCHASTIC=key is not None,
        BLOCKS=BLOCKS, BLOCK=quantize.BLOCK, num_warps=4,
    )
