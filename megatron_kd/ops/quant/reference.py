"""``fp4_qdq_reference``: the ground truth for ``fake_quantize``, in float64 from the definitions.

Shares no code with fp4.py: the E2M1 and E4M3 values are tables, each value goes to the nearest
table entry by distance (ties broken by the stated rule), and the scales are written from their
definitions. Where the rules (ModelOpt's, see fp4.py) round an intermediate to fp32, this does too,
with ``_f32``. A float64 product or quotient of fp32 values, rounded to fp32, is the correctly
rounded fp32 result (53 >= 2·24 + 2 bits: the double rounding is harmless), and float64's log2 is
accurate far below fp32's ulp, so the reference reproduces the correctly rounded fp32 arithmetic
of the rules (what torch computes on a CPU) without running it.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes by code; code parity = mantissa bit


def _e4m3_table() -> torch.Tensor:
    """Every finite non-negative FP8 E4M3 (fn) value by code: subnormals m/8 · 2^-6, normals
    (1 + m/8) · 2^(e - 7); exponent 15 with mantissa 7 is NaN, so the largest is 1.75 · 2^8 = 448."""
    values = [m / 8 * 2.0**-6 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(values, dtype=torch.float64)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float64)


def _nearest(a: torch.Tensor, table: torch.Tensor, ties: str) -> torch.Tensor:
    """Each a >= 0 to the nearest entry of the ascending ``table`` (its largest above it); a tie
    goes to the smaller entry (``ties="down"``) or to the one of even code (``ties="even"``)."""
    distance = (a.unsqueeze(-1) - table).abs()
    best = distance == distance.min(-1, keepdim=True).values  # one entry, or the two of a tie
    codes = torch.arange(len(table), dtype=torch.float64)
    if ties == "even":
        best &= (codes % 2 == 0) | (best.sum(-1, keepdim=True) == 1)
    pick = torch.where(best, codes, float("inf")).min(-1).values.long()  # the smaller of a tie
    return table[pick]


def _mxfp4(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 qdq of float64 blocks [..., 32]."""
    grid = torch.tensor(E2M1, dtype=torch.float64)
    amax = x.abs().amax(-1, keepdim=True)
    # the smallest 2^e with amax <= 6 · 2^e, with amax / 6 and its log2 rounded to fp32; 2^-127 at least
    e = torch.ceil(_f32(torch.log2(_f32(amax / 6)))).clamp_min(-127)
    y = x / 2.0**e  # exact in float64 (and in fp32: a power of two)
    q = _nearest(y.abs(), grid, ties="down")
    # the sign bit is set for y <= 0, so zeros read back as -0.0 unless y > 0
    return torch.where(y > 0, q, -q) * 2.0**e


def _nvfp4(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """NVFP4 qdq of float64 blocks [..., 16] (the whole tensor sets the per-tensor scale)."""
    grid = torch.tensor(E2M1, dtype=torch.float64)
    amax = x.abs().max()
    s2 = _f32(amax / (6 * 448)) if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
    block_amax = x.abs().amax(-1, keepdim=True)
    scale = _f32(block_amax / _f32(6 * s2))
    scale[scale == 0] = 1.0
    scale = _nearest(scale.clamp(2.0**-9, 448.0), _e4m3_table(), ties="even")
    step = _f32(scale * s2)
    y = _f32(x / step)
    q = torch.where(y < 0, -1.0, 1.0) * _nearest(y.abs(), grid, ties="even")
    if exact:  # the real E2M1 · scale · s2 (a 3-, 4- and 24-bit significand: exact in float64)
        return q * scale * s2 + 0.0
    return _f32(q * step) + 0.0  # + 0.0: zeros are +0.0


def fp4_qdq_reference(x: torch.Tensor, fmt: str, exact: bool = False) -> torch.Tensor:
    """``x`` quantized to ``fmt`` ("mxfp4" | "nvfp4") and read back, as float64 (each value an fp32
    one: round it to x's dtype to compare). Blocks of 32 / 16 along the last dim; finite x only.
    ``exact``: NVFP4's read-back E2M1 · scale · s2 as a real number, without its two fp32 roundings
    (of scale · s2, then of the product), for the same codes and scales (MXFP4's is exact anyway)."""
    block = {"mxfp4": 32, "nvfp4": 16}[fmt]
    xb = x.double().cpu().reshape(*x.shape[:-1], -1, block)
    return (_mxfp4(xb) if fmt == "mxfp4" else _nvfp4(xb, exact)).reshape(x.shape)
