"""``Bf16Adam``'s update as one Triton kernel launch per kind of tensor: dequantize, Adam(W),
quantize, round.

The torch path (``adam._chunk_step``) reads and writes each element in many passes (the moments'
table lookups, the update, the blockwise absmax, the binary search for the nearest code, the hash
of the rounding bits in 64-bit integers, the copies back), and launches them per chunk of every
tensor: a GPT-OSS-120B rank's 16.5B parameters in 2,631 tensors. Here a program does everything
in registers, ``BLOCKS`` quantization blocks of 256 elements at a time: per element it reads the
bf16 weight and gradient and the two 8-bit codes (plus a scale per block), and writes the weight
and the codes back, 10 bytes, as a fused AdamW does for 16.

One launch updates every tensor of a parameter group that shares the dtypes and the moments'
storage (``KernelBatch``), as apex's and torch's multi-tensor ("foreach") optimizers do: a table on
the device holds each tensor's addresses, size and rounding stream, and each program takes one work
item of ``ITEM_BLOCKS`` blocks of one tensor. A launch per tensor cost the host ~70 us, 190 ms for
a 120B rank's tensors (one H200, 2026-12-04, 3d80ffd), most of them small ones (biases, norms) during which
the GPU waited. The table is rebuilt only when an address changes (a checkpoint load replaces the
moments; megatron-core's gradient buffers keep theirs).

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

# quantization blocks a program holds at once, and its warps: one block per warp, whose absmax is
# then a reduction within the warp (shuffles, no shared memory or barrier), 8 elements per thread.
# An H200 sweep over a 120B rank's 2,631 tensors, one launch per kind (2026-12-04, 2191483): BLOCKS=1 with
# 1 warp 226.6 ms, 1 / 2 242.1, 1 / 4 250.4, 2 / 2 269.1, 2 / 4 283.7, 4 / 4 349.9; with a launch
# per tensor (3d80ffd), 4 / 4 took 298.6 ms, 190 ms of it the host's launches.
BLOCKS = 1
NUM_WARPS = 1
ITEM_BLOCKS = 64  # blocks per work item (16,384 elements): a 120B rank is ~1M items
# columns of the tensor table (int64), in KernelBatch._row's order: the parameter's, the two moments'
# and their scales' addresses, elements, blocks, the rounding stream's prefix (2) and offset
FIELDS = tl.constexpr(10)


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


@triton.jit
def _update_blocks(p_ptr, g_ptr, m_ptr, v_ptr, m_scales_ptr, v_scales_ptr, qmap_signed_ptr, qmap_unsigned_ptr,
                   block_ids, n, num_blocks, key1, key2, offset, decay, l2, lerp, beta2, grad_sq, bias2_sqrt, eps,
                   neg_step, tiny, QUANTIZED: tl.constexpr, ADAM_W: tl.constexpr, STOCHASTIC: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One Adam(W) step of the quantization blocks ``block_ids`` of a flat tensor of ``n`` elements.

    QUANTIZED: m_ptr / v_ptr are the packed moments' codes (uint8, ``num_blocks``·BLOCK of them, the
    last block's padding included) with their scales; else fp32 moments of n elements. ``key1``,
    ``key2`` (uint32): the rounding stream; ``offset``: the tensor's first element in it."""
    offs = block_ids[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = offs < n
    in_blocks = block_ids[:, None] < num_blocks  # padding of the last block: codes exist, elements do not

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
        index = offs.to(tl.uint32) + offset
        h = _mix32(_mix32(index + key1) ^ key2)
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


# The step's number changes every step: it comes as 16-bit halves that Triton does not specialize
# on (it compiles a kernel per argument type and per divisibility of an integer), so one compiled
# kernel serves every step.
@triton.jit(do_not_specialize=["step_hi", "step_lo"])
def bf16_adam_kernel(tensors_ptr, grads_ptr, work_ptr, qmap_signed_ptr, qmap_unsigned_ptr, scalars_ptr, step_hi,
                     step_lo, tiny, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, QUANTIZED: tl.constexpr,
                     ADAM_W: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
                     ITEM_BLOCKS: tl.constexpr):
    """Work item ``program_id``: blocks [first, first + ITEM_BLOCKS) of tensor t, with (t, first) in
    ``work_ptr`` (int32 pairs). ``tensors_ptr``: the int64 table of ``KernelBatch`` (a row per
    tensor, ``FIELDS`` columns); ``grads_ptr``: the gradients' addresses (int64, a row per tensor);
    ``scalars_ptr``: ``adam.step_scalars`` as fp32 on the device; ``step``: the step's number, which
    finishes each tensor's rounding-stream key (``rounding.stream_key_from``)."""
    item = tl.program_id(0)
    t = tl.load(work_ptr + 2 * item).to(tl.int64)
    first = tl.load(work_ptr + 2 * item + 1).to(tl.int64)
    row = tensors_ptr + t * FIELDS
    moment = tl.uint8 if QUANTIZED else tl.float32
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(grads_ptr + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(row + 1).to(tl.pointer_type(moment))
    v_ptr = tl.load(row + 2).to(tl.pointer_type(moment))
    m_scales_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    v_scales_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 5)
    num_blocks = tl.load(row + 6)
    key1 = tl.load(row + 7).to(tl.uint32)
    key2 = tl.load(row + 8).to(tl.uint32)
    offset = tl.load(row + 9).to(tl.uint32)
    if STOCHASTIC:  # rounding.stream_key_from(prefix, step) for a step below 2^32
        step = _uint32(step_hi, step_lo)
        key1 = _mix32(key1 ^ step)
        key2 = _mix32((key2 + step) ^ tl.full([], 0x9E3779B9, tl.uint32))

    decay = tl.load(scalars_ptr + 0)
    l2 = tl.load(scalars_ptr + 1)
    lerp = tl.load(scalars_ptr + 2)
    beta2 = tl.load(scalars_ptr + 3)
    grad_sq = tl.load(scalars_ptr + 4)
    bias2_sqrt = tl.load(scalars_ptr + 5)
    eps = tl.load(scalars_ptr + 6)
    neg_step = tl.load(scalars_ptr + 7)

    # a fixed trip count (the blocks past the tensor's end are masked in _update_blocks): the last item
    # of a tensor is its only partial one
    for start in range(0, ITEM_BLOCKS, BLOCKS):
        _update_blocks(p_ptr, g_ptr, m_ptr, v_ptr, m_scales_ptr, v_scales_ptr, qmap_signed_ptr, qmap_unsigned_ptr,
                       first + start + tl.arange(0, BLOCKS), n, num_blocks, key1, key2, offset, decay, l2, lerp, beta2,
                       grad_sq, bias2_sqrt, eps, neg_step, tiny, QUANTIZED, ADAM_W, STOCHASTIC, BLOCK)


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class KernelBatch:
    """The tensors of one launch: one parameter group's tensors of one kind (parameter and gradient
    dtype, 8-bit or fp32 moments, stochastic rounding or not). Keeps the device tables between
    steps and rebuilds one when an address or size in it changes."""

    def __init__(self):
        self._rows: list[tuple[int, ...]] | None = None
        self._grad_ptrs: list[int] | None = None
        self._tables: dict[str, torch.Tensor] = {}

    def launch(self, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], prefixes: list[tuple[int, int]], offsets: list[int],
               qmaps: tuple[torch.Tensor, torch.Tensor], scalars: torch.Tensor, *, step: int, stochastic: bool,
               adam_w_mode: bool) -> None:
        """One step of every tensor: flat contiguous ``params`` (bf16 / fp32, one dtype) and ``grads``
        (one float dtype), the moments as ``Bf16Adam`` stores them (all packed 8-bit or all fp32),
        each tensor's rounding-stream prefix (``rounding.stream_key`` of its seed, stream and index)
        and first element in that stream, the (signed, unsigned) maps and ``step_scalars`` as an
        fp32 device tensor."""
        if not params:
            return
        if stochastic and step >= 1 << 32:
            raise ValueError(f"Bf16Adam's kernel finishes the rounding key with a 32-bit step: step {step}")
        quantized = exp_avgs[0].dtype == torch.uint8
        device = params[0].device
        rows = [self._row(p, m, v, prefix, offset, quantized)
                for p, m, v, prefix, offset in zip(params, exp_avgs, exp_avg_sqs, prefixes, offsets)]
        if rows != self._rows:
            self._rows = rows
            self._tables["tensors"] = torch.tensor(rows, dtype=torch.int64).to(device)
            self._tables["work"] = _work_items([row[6] for row in rows]).to(device)
        grad_ptrs = [g.data_ptr() for g in grads]
        if grad_ptrs != self._grad_ptrs:
            self._grad_ptrs = grad_ptrs
            self._tables["grads"] = torch.tensor(grad_ptrs, dtype=torch.int64).to(device)
        work = self._tables["work"]
        bf16_adam_kernel[(work.shape[0],)](
            self._tables["tensors"], self._tables["grads"], work, *qmaps, scalars, step >> 16, step & 0xFFFF,
            quantize.ZERO_BLOCK_SCALE, P_DTYPE=_TRITON_DTYPES[params[0].dtype], G_DTYPE=_TRITON_DTYPES[grads[0].dtype],
            QUANTIZED=quantized, ADAM_W=adam_w_mode, STOCHASTIC=stochastic, BLOCKS=BLOCKS, BLOCK=quantize.BLOCK,
            ITEM_BLOCKS=ITEM_BLOCKS, num_warps=NUM_WARPS,
        )

    @staticmethod
    def _row(p, m, v, prefix, offset, quantized) -> tuple[int, ...]:
        n = p.numel()
        num_blocks = -(-n // quantize.BLOCK)
        # packed layout (quantize.packed_views): the codes of num_blocks blocks, then their scales
        scales = num_blocks * quantize.BLOCK if quantized else 0
        return (p.data_ptr(), m.data_ptr(), v.data_ptr(), m.data_ptr() + scales, v.data_ptr() + scales, n,
                num_blocks, *prefix, offset)


def _work_items(num_blocks: list[int]) -> torch.Tensor:
    """(tensor, first block) int32 pairs: each tensor's blocks in items of ITEM_BLOCKS."""
    blocks = torch.tensor(num_blocks, dtype=torch.int64)
    items = (blocks + ITEM_BLOCKS - 1) // ITEM_BLOCKS
    tensor = torch.repeat_interleave(torch.arange(len(num_blocks)), items)
    starts = torch.cumsum(items, 0) - items
    first = (torch.arange(int(items.sum())) - starts[tensor]) * ITEM_BLOCKS
    if int(blocks.max()) >= 1 << 31:
        raise ValueError(f"Bf16Adam's kernel indexes blocks with 31 bits: {int(blocks.max())} blocks")
    return torch.stack([tensor, first], 1).to(torch.int32).contiguous()
