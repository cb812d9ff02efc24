"""FP4 fake quantization (quantize then dequantize) of weights, with a straight-through gradient.

``fake_quantize(weight, fmt)`` returns the weight as it would read back after quantization to
``fmt`` ("mxfp4" or "nvfp4"), in the weight's dtype; its gradient is the incoming one, unchanged.
Blocks run along the last dim (a linear's or an expert's input dim), as GPT-OSS's release stores
them. ``mxfp4_encode`` / ``mxfp4_decode`` convert to and from that release layout: ``blocks`` uint8
[..., in/32, 16] (two E2M1 codes a byte, element 2j in the low nibble) and ``scales`` uint8
[..., in/32] (E8M0: 2^(byte - 127)).

What follows which definition:

- Element format (both): E2M1 of the OCP Microscaling spec v1.0, magnitudes {0, 0.5, 1, 1.5, 2, 3,
  4, 6}, code = sign << 3 | index of the magnitude. Values beyond 6 (after scaling) saturate to 6.
- MXFP4 (OCP MX v1.0 format: 32 elements share an E8M0 scale), with nvidia-modelopt's
  ``MXFP4QTensor`` rules where it departs from the spec:
  * scale 2^e with e = ceil(log2(amax / 6)), the smallest power of two that keeps the block's
    amax within 6·scale (the spec's floor(log2 amax) - 2 may clip it), e >= -127 (byte 0). It is
    computed in fp32 as ModelOpt does: amax / 6 rounds to fp32, and fp32 log2 of a value a few ulps
    above 2^k is k, so such a block takes 2^k and its amax saturates to 6·2^k;
  * ties between two E2M1 values round to the smaller magnitude (0.25 -> 0, 0.75 -> 0.5, 5 -> 4);
  * the sign bit is set for every x <= 0: exact zeros (and all-zero blocks, scale byte 0) read
    back as -0.0, elements rounded to 0 keep their sign (so a second pass turns +0.0 into -0.0:
    qdq is idempotent in value, and in bits but for zeros);
  * a block whose amax reads back as 3 · scale re-encodes with half the scale (the same values).
- NVFP4 (NVIDIA's format, no public spec beyond ModelOpt): 16 elements share an FP8 E4M3 scale,
  times a per-tensor fp32 scale s2; all as ``NVFP4QTensor.quantize`` then ``dequantize``:
  * s2 = amax(tensor) / (6 · 448) in fp32, so the largest block scale is E4M3's max, 448;
  * block scale = amax(block) / (6 · s2) in fp32, 1 for an all-zero block, clamped to [2^-9, 448]
    and rounded to E4M3 (nearest, ties to even). Its rounding can put the block's amax above 6 times
    the scale: that element saturates at 6;
  * elements x / fl(scale · s2), rounded to nearest with ties to even (0.75 -> 1, 2.5 -> 2, 5 -> 4);
  * read back as E2M1 value · fl(scale · s2) in fp32; zeros are +0.0;
  * an all-zero tensor reads back as zeros (s2 = 1 then; ModelOpt's s2 = 0 makes every value NaN).
  A second pass may move s2 by an ulp (the read-back amax need not be amax) and, in a block whose
  scale is an E4M3 subnormal (amax below 2^-6 / 448 of the tensor's), pick another scale.

Arithmetic is fp32 whatever the weight's dtype (bf16 and fp32 weights are exact in it), and uses
the same torch operations as ModelOpt, so the results are ModelOpt's bit for bit on the device it
runs on (a CUDA division by a Python float multiplies by the reciprocal: on CUDA the scales are
those ModelOpt computes there). MXFP4 rounds fp32 weights above 3.5 · 2^126 (~3e38) and fp16
ones above 57344 up to 4 · scale, beyond the dtype's range: inf.
"""

from __future__ import annotations

import torch

FORMATS = ("mxfp4", "nvfp4")
BLOCK_SIZE = {"mxfp4": 32, "nvfp4": 16}

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127

# E2M1 magnitude by the low 3 bits of a code, and the midpoints between neighbours
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# value by full 4-bit code; code 8 (sign bit, magnitude 0) is -0.0 in MXFP4, +0.0 in ModelOpt's NVFP4 table
_VALUES = {
    "mxfp4": _E2M1 + tuple(-v for v in _E2M1),
    "nvfp4": _E2M1 + (0.0,) + tuple(-v for v in _E2M1[1:]),
}


def _check(weight: torch.Tensor, fmt: str, finite: bool = True) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"FP4 format {fmt!r}: expected one of {', '.join(FORMATS)}")
    block = BLOCK_SIZE[fmt]
    if not weight.is_floating_point() or weight.dim() == 0 or weight.shape[-1] % block:
        raise ValueError(f"{fmt}: weight of shape {tuple(weight.shape)} and dtype {weight.dtype}: expected a "
                         f"floating-point tensor whose last dim is a multiple of the block, {block}")
    if not finite:
        return block
    finite = torch.isfinite(weight)
    if not bool(finite.all()):  # one sync, and the index only when there is something to report
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(f"{fmt}: weight of shape {tuple(weight.shape)} holds {weight[where].item()} at index "
                         f"{where} (the first non-finite value); FP4 quantization needs finite weights")
    return block


def _blocked(weight: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 [..., n_blocks, block] view of the weight (its blocks along the last dim)."""
    return weight.float().reshape(*weight.shape[:-1], -1, block)


def _e2m1_codes(y: torch.Tensor, negative: torch.Tensor, ties_to_even: bool) -> torch.Tensor:
    """uint8 E2M1 codes of the scaled values ``y``: the nearest magnitude (6 above 6), sign bit from ``negative``."""
    a = y.abs()
    midpoints = torch.tensor(_MIDPOINTS, device=y.device)
    index = torch.bucketize(a, midpoints, out_int32=True)  # midpoints strictly below a: a tie rounds down
    if ties_to_even:
        # a tie sits on midpoint `index`; it rounds up to index + 1 when that code is even (index odd)
        tie = a == midpoints[index.clamp(max=len(_MIDPOINTS) - 1)]
        index += tie & (index % 2 == 1)
    return (index | negative.int() << 3).to(torch.uint8)


def _values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.tensor(_VALUES[fmt], device=codes.device)[codes.int()]


def _mxfp4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E2M1 codes [..., n, 32] and the fp32 scale exponents [..., n, 1] of ``weight``'s MXFP4 blocks."""
    x = _blocked(weight, BLOCK_SIZE["mxfp4"])
    amax = x.abs().amax(-1, keepdim=True)
    # ModelOpt's rule and arithmetic: fp32 quotient, fp32 log2; log2(0) = -inf takes the floor, 2^-127
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp_min(-E8M0_BIAS)
    y = x / torch.exp2(exponent)  # exact: a power of two
    return _e2m1_codes(y, y <= 0, ties_to_even=False), exponent  # ModelOpt sets the sign bit of zeros too


def _mxfp4_qdq(weight: torch.Tensor) -> torch.Tensor:
    codes, exponent = _mxfp4_codes(weight)
    return (_values(codes, "mxfp4") * torch.exp2(exponent)).reshape(weight.shape)  # exact: E2M1 · 2^e


def _nvfp4_qdq(weight: torch.Tensor) -> torch.Tensor:
    x = _blocked(weight, BLOCK_SIZE["nvfp4"])
    amax = x.abs().amax()
    # per-tensor scale (ModelOpt's weights_scaling_factor_2); 1 for an all-zero tensor, where 0 gives 0/0
    s2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0)
    scale = x.abs().amax(-1, keepdim=True) / (E2M1_MAX * s2)
    scale = torch.where(scale == 0, 1.0, scale)  # an all-zero block: any scale reads back zeros
    scale = scale.clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn).float()
    step = scale * s2  # one fp32 rounding, in quantize and dequantize alike
    y = x / step
    codes = _e2m1_codes(y, y < 0, ties_to_even=True)
    return (_values(codes, "nvfp4") * step).reshape(weight.shape)


class _FakeQuantize(torch.autograd.Function):
    """Quantize-dequantize forward; straight-through backward (the gradient passes unchanged)."""

    @staticmethod
    def forward(ctx, weight, fmt):
        qdq = _mxfp4_qdq(weight) if fmt == "mxfp4" else _nvfp4_qdq(weight)
        return qdq.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(weight: torch.Tensor, fmt: str, *, check_finite: bool = True) -> torch.Tensor:
    """``weight`` quantized to ``fmt`` ("mxfp4" or "nvfp4", blocks along the last dim) and read back,
    in its dtype; differentiable with the straight-through gradient. ValueError for an unknown
    format, a last dim not a multiple of the block (32 / 16), or (``check_finite``: one host sync) a
    NaN or ±inf in the weight."""
    _check(weight, fmt, check_finite)
    if weight.numel() == 0:
        return weight.clone()
    return _FakeQuantize.apply(weight, fmt)


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., in] in GPT-OSS's MXFP4 release layout: ``blocks`` uint8 [..., in/32, 16]
    (element 2j of a block in the low nibble of byte j, 2j + 1 in the high one) and ``scales``
    uint8 [..., in/32] (E8M0, 2^(byte - 127)); the same codes and scales ModelOpt's quantize makes."""
    _check(weight, "mxfp4")
    codes, exponent = _mxfp4_codes(weight.detach())
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks, (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The [..., in] weight in ``dtype`` that ``blocks`` [..., in/32, 16] and ``scales`` [..., in/32]
    (uint8, release layout) hold; ``mxfp4_decode(*mxfp4_encode(w), w.dtype) == fake_quantize(w, "mxfp4")``."""
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2
            or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]):
        raise ValueError(f"mxfp4: blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)}: expected uint8 [..., n, 16] and uint8 [..., n]")
    if bool((scales == 255).any()):
        raise ValueError("mxfp4: a scale byte is 255, E8M0's NaN")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    values = _values(codes, "mxfp4") * torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)
