"""fake_quantize (MXFP4, NVFP4) against its float64 reference and nvidia-modelopt's quantize + dequantize.

Checked:
- equality, bit for bit, with ``fp4_qdq_reference`` on fresh random [E, out, in] and [out, in]
  weights in fp32 and bf16. MXFP4 values (E2M1 · 2^e) are exact in fp32. NVFP4's are not: the
  step fl(E4M3 scale · s2) is rounded (a 4-bit by a 24-bit significand) and so is E2M1 · step;
  the reference rounds at those two points too, so equality is still exact, and the result is
  within 2^-23 (two half ulps) of the real product E2M1 · scale · s2;
- edge cases: exact ties between E2M1 values (MXFP4 down, NVFP4 to even) and one ulp either side,
  all-zero blocks and tensors, all-equal blocks, a block's max (6 · scale), FP4's 0.5 and what
  rounds to it or to 0, E8M0's range (2^-127 to 2^126), mixed signs, and the fp32 log2 of ModelOpt's
  MXFP4 scale rule just above a power of two;
- a NaN or ±inf, a last dim off the block, or an unknown format: one-line ValueErrors;
- the straight-through gradient: exactly the incoming one;
- ModelOpt's MXFP4QTensor / NVFP4QTensor quantize + dequantize: the same bits (MXFP4's packed
  codes and scale bytes too), on CPU, and on CUDA tensors where there is a GPU;
- mxfp4_encode / mxfp4_decode: the release layout (nibble order, scale bytes) of a hand-made
  block, and the round trip;
- idempotence: MXFP4 exactly; NVFP4 exactly in bf16 and whenever the tensor's amax reads back as
  itself, else (fp32) within 2^-22: the per-tensor scale is recomputed from the read-back amax.
"""

import math

import pytest
import torch
from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor

from megatron_kd.ops.quant import FORMATS, fake_quantize, fp4_qdq_reference, mxfp4_decode, mxfp4_encode

BLOCK = {"mxfp4": 32, "nvfp4": 16}
SHAPES = [(4, 8, 64), (24, 96)]  # [E, out, in] experts, [out, in] linear
DTYPES = [torch.float32, torch.bfloat16]
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
TIES = {"mxfp4": [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0],  # to the smaller magnitude (ModelOpt's MXFP4)
        "nvfp4": [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]}  # to the even code (round half to even)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so -0.0 and 0.0 differ), on CPU."""
    return t.detach().cpu().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    differ = bits(a) != bits(b)
    assert not differ.any(), f"{int(differ.sum())} of {a.numel()} differ, first at {differ.nonzero()[0].tolist()}"


def random_weight(shape, dtype, device="cpu") -> torch.Tensor:
    """Gaussian weights whose rows span 2^-12 to 2^2 in scale (blocks of very different amax), and
    a few exact zeros (whose sign the rules set)."""
    w = torch.randn(shape) * torch.exp2(torch.randint(-12, 3, (*shape[:-1], 1)).float())
    w.view(-1)[torch.randperm(w.numel())[:7]] = 0.0
    return w.to(dtype=dtype, device=device)


def modelopt_qdq(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "mxfp4":
        q, scale = MXFP4QTensor.quantize(w, 32)
        return q.dequantize(scale=scale, block_sizes={-1: 32})
    q, scale, s2 = NVFP4QTensor.quantize(w, 16)
    return q.dequantize(scale=scale, double_scale=s2, block_sizes={-1: 16})


def reference(w: torch.Tensor, fmt: str) -> torch.Tensor:
    return fp4_qdq_reference(w, fmt).to(w.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_qdq_equals_reference(seed, fmt, dtype, shape):
    w = random_weight(shape, dtype)
    assert_same_bits(fake_quantize(w, fmt), reference(w, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qdq_equals_modelopt(seed, fmt, dtype):
    for shape in SHAPES:
        w = random_weight(shape, dtype)
        assert_same_bits(fake_quantize(w, fmt), modelopt_qdq(w, fmt))


def test_mxfp4_codes_and_scales_are_modelopts(seed):
    w = random_weight((3, 5, 96), torch.bfloat16)
    blocks, scales = mxfp4_encode(w)
    q, e8m0 = MXFP4QTensor.quantize(w, 32)
    assert torch.equal(blocks, q._quantized_data.reshape(3, 5, 3, 16))
    assert torch.equal(scales, e8m0.reshape(3, 5, 3))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qdq_on_cuda_equals_modelopt_on_cuda(seed, fmt, dtype):
    for shape in SHAPES:
        w = random_weight(shape, dtype, device="cuda")
        q = fake_quantize(w, fmt)
        assert q.is_cuda
        assert_same_bits(q, modelopt_qdq(w, fmt))
        g = torch.randn_like(w)
        (grad,) = torch.autograd.grad((fake_quantize(w.requires_grad_(), fmt) * g).sum(), w)
        assert_same_bits(grad, g)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_cases_on_cuda(fmt):
    """The hand-made edge cases below on a GPU: ModelOpt's bits there, and the CPU's for the ties,
    whose scales are exact powers of two. Not for the scale range: CUDA divides by multiplying with a
    rounded reciprocal (NVFP4's s2) and its fp32 arithmetic on subnormal amax differs from the CPU's
    (MXFP4's 1e-38 and 1e-40 blocks, seen on one H100 2026-12-08), as ModelOpt's does on each."""
    for w, same_as_cpu in [(tie_block(fmt, -4), True), (scale_range_rows(), False)]:
        q = fake_quantize(w.cuda(), fmt)
        assert_same_bits(q, modelopt_qdq(w.cuda(), fmt))
        if same_as_cpu:
            assert_same_bits(q, fake_quantize(w, fmt))


def tie_block(fmt: str, k: int) -> torch.Tensor:
    """Rows whose scale is exactly 2^k (NVFP4: per-tensor s2 = 2^k and block scale 1) holding every
    midpoint between E2M1 values times 2^k, negated too, and the fp32 neighbours of each."""
    n = BLOCK[fmt]
    ties = torch.tensor(MIDPOINTS, dtype=torch.float64) * 2.0**k
    rows = []
    for values in (ties, ties.float().nextafter(torch.tensor(0.0)), ties.float().nextafter(torch.tensor(9.0))):
        for sign in (1, -1):
            row = torch.zeros(n, dtype=torch.float64)
            row[0] = 6 * 2.0**k  # the block's amax sets its scale to 2^k exactly
            row[1:8] = sign * values.double()
            rows.append(row)
    w = torch.stack(rows).float()
    if fmt == "nvfp4":  # one more block whose amax sets s2 = amax / 2688 = 2^k
        extra = torch.zeros(len(rows), n)
        extra[0, 0] = 6 * 448 * 2.0**k
        w = torch.cat([w, extra], dim=1)
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_between_e2m1_values(fmt):
    k = -4
    q = fake_quantize(tie_block(fmt, k), fmt).double() / 2.0**k
    expected = torch.tensor(TIES[fmt], dtype=torch.float64)
    below = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0], dtype=torch.float64)
    above = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    for r, want in enumerate([expected, below, above]):
        assert torch.equal(q[2 * r, 1:8], want)
        assert torch.equal(q[2 * r + 1, 1:8], -want)
        assert (q[2 * r: 2 * r + 2, 0] == 6).all()
    assert_same_bits(fake_quantize(tie_block(fmt, k), fmt), reference(tie_block(fmt, k), fmt))


def test_zero_blocks_and_zero_tensors():
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-1, 1, 32)  # a nonzero block; the other three are all zero
    mx = fake_quantize(w, "mxfp4")
    assert (mx[0, 32:] == 0).all() and (mx[1] == 0).all()
    assert torch.signbit(mx[1]).all()  # MXFP4: the sign bit of x <= 0 is set (ModelOpt's rule): -0.0
    assert mxfp4_encode(w)[1].tolist() == [[127 - 2, 0], [0, 0]]  # zero blocks take E8M0's least, 2^-127
    nv = fake_quantize(w, "nvfp4")
    assert (nv[:, 32:] == 0).all() and not torch.signbit(nv[:, 32:]).any()  # NVFP4's zeros are +0.0
    for fmt in FORMATS:
        assert_same_bits(fake_quantize(w, fmt), reference(w, fmt))
        assert_same_bits(fake_quantize(w, fmt), modelopt_qdq(w, fmt))
        # an all-zero tensor reads back as zeros (ModelOpt's NVFP4 gives NaN there: its s2 is 0)
        for z in (torch.zeros(3, 32), -torch.zeros(3, 32)):
            out = fake_quantize(z, fmt)
            assert (out == 0).all()
            assert_same_bits(out, reference(z, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_equal_blocks(seed, fmt):
    n = BLOCK[fmt]
    values = torch.cat([torch.tensor([1.0, -0.25, 3.0, 2.0**-20]), torch.randn(4) * 10])
    w = values.repeat_interleave(n).reshape(4, 2 * n)
    q = fake_quantize(w, fmt)
    blocks = q.reshape(-1, n)
    assert (blocks == blocks[:, :1]).all()
    assert (torch.sign(blocks[:, 0]) * torch.sign(values) >= 0).all()  # or 0: NVFP4's block scale floor, 2^-9
    assert_same_bits(q, reference(w, fmt))
    if fmt == "mxfp4":  # a power of two is an E2M1 value times a power of two: exact
        assert torch.equal(q.reshape(-1, n)[[0, 1, 3], 0], values[[0, 1, 3]])


def test_mxfp4_block_max_reads_back_as_6_times_the_scale(seed):
    k = torch.randint(-30, 30, (8, 1)).float()
    w = torch.rand(8, 32) * 2 * torch.exp2(k) * 6 - torch.exp2(k) * 6  # |w| < 6 · 2^k
    w[torch.arange(8), torch.randint(0, 32, (8,))] = torch.tensor([1.0, -1.0] * 4) * 6 * torch.exp2(k[:, 0])
    q = fake_quantize(w, "mxfp4")
    assert torch.equal(q.abs().amax(-1), 6 * torch.exp2(k[:, 0]))
    assert mxfp4_encode(w)[1][:, 0].tolist() == (k[:, 0] + 127).int().tolist()
    assert_same_bits(q, reference(w, "mxfp4"))
    # any block: its amax lies in (3, 6] scales (the smallest power of two keeping it within 6),
    # so it reads back as the E2M1 value nearest it, 3, 4 or 6 scales, and is never clipped further
    w = random_weight((16, 64), torch.float32)
    _, scales = mxfp4_encode(w)
    scale = torch.exp2(scales.double() - 127)
    amax = w.double().abs().reshape(16, 2, 32).amax(-1)
    assert ((amax / scale > 3) & (amax / scale <= 6 * (1 + 2**-20))).all()  # 6+: the fp32 log2 (test below)


def test_nvfp4_tensor_max_reads_back_as_6_steps(seed):
    w = random_weight((8, 64), torch.float32)
    i = w.abs().argmax()
    amax = w.abs().max().double()
    s2 = amax.float() / (6 * 448)  # fp32, as the rule computes it; the max's block scale is 448
    step = (448 * s2.double()).float().double()
    q = fake_quantize(w, "nvfp4").view(-1)[i].double()
    assert q == math.copysign((6 * step).float().item(), w.view(-1)[i].item())
    assert abs(q.abs() - amax) <= 2.0**-22 * amax


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_within_two_roundings_of_the_real_product(seed, dtype):
    """fl(fl(scale · s2) · E2M1): |relative error| <= (1 + 2^-24)^2 - 1 against the real product."""
    w = random_weight((6, 128), dtype)
    q = fake_quantize(w, "nvfp4").double()
    real = fp4_qdq_reference(w, "nvfp4", exact=True)
    if dtype == torch.float32:
        assert ((q - real).abs() <= ((1 + 2.0**-24) ** 2 - 1) * real.abs()).all()
        assert (q != real).any()  # the roundings are real: most steps need more than 24 bits
    else:  # then rounded once more, to bf16
        assert torch.equal(q, real.float().bfloat16().double()) or ((q - real).abs() <= 2.0**-8 * real.abs()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_values(fmt):
    k = -6
    w = torch.zeros(2, 2 * BLOCK[fmt])
    w[0, 0] = 6 * 2.0**k if fmt == "mxfp4" else 6 * 448 * 2.0**k  # scale 2^k (NVFP4: s2 = 2^k, scale 448)
    row = [0.5, -0.5, 0.25, -0.25, 0.2500001, -0.2500001, 0.2499999, 1e-30]
    w[1, :8] = torch.tensor(row) * 2.0**k * (1 if fmt == "mxfp4" else 448)
    w[1, 8] = 6 * 2.0**k * (1 if fmt == "mxfp4" else 448)
    q = fake_quantize(w, fmt)[1, :8] / (2.0**k * (1 if fmt == "mxfp4" else 448))
    assert q.tolist() == [0.5, -0.5, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0]
    assert_same_bits(fake_quantize(w, fmt), reference(w, fmt))


def scale_range_rows() -> torch.Tensor:
    """Rows of blocks from fp32's largest magnitudes to its subnormals: E8M0's range, 2^-127 to 2^126,
    and, for NVFP4, block scales clamped at E4M3's least 2^-9."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(32, generator=g) * m for m in (2.0**100, 1e37, 1.0, 2.0**-100, 1e-38, 1e-40, 1e-44)]
    rows.append(torch.full((32,), 1e38))
    return torch.stack(rows).reshape(4, 64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_and_tiny_scales(fmt):
    w = scale_range_rows()
    q = fake_quantize(w, fmt)
    assert torch.isfinite(q).all()
    assert_same_bits(q, reference(w, fmt))
    assert_same_bits(q, modelopt_qdq(w, fmt))
    if fmt == "mxfp4":
        scales = mxfp4_encode(w)[1].flatten().tolist()
        amax = w.double().abs().reshape(-1, 32).amax(-1)
        assert scales == (torch.ceil(torch.log2(amax / 6)).clamp_min(-127) + 127).int().tolist()
        assert scales[-1] == 127 + 124 and scales[5] == scales[6] == 0  # 1e38 / 6 -> 2^124; subnormals: 2^-127


def test_mxfp4_scale_takes_fp32_log2_as_modelopt_does():
    """amax just above 6 · 2^-5: amax / 6 rounds to 2^-5 (1 + 2^-23), whose fp32 log2 is exactly -5,
    so the scale is 2^-5 (not the 2^-4 of exact arithmetic): the amax saturates to 6 · 2^-5 and 2^-6
    (half a scale) is kept, where 2^-4 would have rounded it to 0."""
    amax = torch.tensor(6 * 2.0**-5).nextafter(torch.tensor(1.0))
    assert torch.log2(amax / 6) == -5 and amax.double() > 6 * 2.0**-5
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = amax, 2.0**-6
    q = fake_quantize(w, "mxfp4")
    assert q[0, :2].tolist() == [6 * 2.0**-5, 2.0**-6]
    assert mxfp4_encode(w)[1].item() == 127 - 5
    assert_same_bits(q, reference(w, "mxfp4"))
    assert_same_bits(q, modelopt_qdq(w, "mxfp4"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_signs(seed, fmt):
    w = random_weight((4, 128), torch.float32).abs() + 1e-3
    flip = torch.rand(w.shape) < 0.5
    signed = torch.where(flip, -w, w)
    q, q_abs = fake_quantize(signed, fmt), fake_quantize(w, fmt)
    assert torch.equal(q.abs(), q_abs)  # the scales see |w| only
    assert (torch.sign(q) * torch.sign(signed) >= 0).all()
    assert_same_bits(q, reference(signed, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_refused(fmt, bad):
    w = torch.randn(2, 3, 64)
    w[1, 2, 17] = bad
    w[1, 2, 40] = bad
    with pytest.raises(ValueError) as err:
        fake_quantize(w, fmt)
    msg = str(err.value)
    assert "\n" not in msg and fmt in msg and "(1, 2, 17)" in msg and str(bad) in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_shapes_and_formats_refused(fmt):
    for shape in [(4, BLOCK[fmt] + 8), (BLOCK[fmt] // 2,)]:
        with pytest.raises(ValueError, match=rf"^{fmt}: weight of shape \({shape[0]}.*multiple of the block, {BLOCK[fmt]}$"):
            fake_quantize(torch.randn(shape), fmt)
    with pytest.raises(ValueError, match=r"^FP4 format 'fp4': expected one of mxfp4, nvfp4$"):
        fake_quantize(torch.randn(2, 32), "fp4")
    with pytest.raises(ValueError, match="mxfp4: weight of shape"):
        mxfp4_encode(torch.randn(2, 16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_straight_through_gradient(seed, fmt, dtype):
    w = random_weight((3, 4, 64), dtype).requires_grad_()
    g = torch.randn(w.shape, dtype=dtype)
    (grad,) = torch.autograd.grad((fake_quantize(w, fmt) * g).sum(), w)
    assert_same_bits(grad, g)


def test_mxfp4_release_layout_of_a_hand_made_block():
    # block 0 of row 0 has amax 6: scale 2^0, byte 127; row 0's block 1 is the same halved: byte 126
    values = [6, -0.5, 1, 4, 0, 0.5, -6, 3, 1.5, -1.5, 2, -2, 0.2, -0.2, 5.5, 0.75] + [0.0] * 16
    w = torch.zeros(2, 64)
    w[0, :32] = torch.tensor(values)
    w[0, 32:] = torch.tensor(values) / 2
    w[1, 32:] = -torch.tensor(values)
    blocks, scales = mxfp4_encode(w)
    assert blocks.shape == (2, 2, 16) and blocks.dtype == torch.uint8 and scales.shape == (2, 2)
    assert scales.tolist() == [[127, 126], [0, 127]]
    # codes (sign << 3 | index of 0, .5, 1, 1.5, 2, 3, 4, 6), element 2j low nibble of byte j:
    # 6 -> 7, -0.5 -> 9 | 1 -> 2, 4 -> 6 | 0 -> 8 (x <= 0 sets the sign), 0.5 -> 1 | -6 -> 15, 3 -> 5 |
    # 1.5 -> 3, -1.5 -> 11 | 2 -> 4, -2 -> 12 | 0.2 -> 0, -0.2 -> 8 | 5.5 -> 7, 0.75 -> 1 (tie down)
    assert blocks[0, 0].tolist() == [0x97, 0x62, 0x18, 0x5F, 0xB3, 0xC4, 0x80, 0x17] + [0x88] * 8
    assert blocks[0, 1].tolist() == blocks[0, 0].tolist()  # halved values under a halved scale
    assert blocks[1, 0].tolist() == [0x88] * 16
    assert blocks[1, 1].tolist()[:3] == [0x1F, 0xEA, 0x98]  # negated: the sign bits flip, but -0.0 stays 8
    decoded = mxfp4_decode(blocks, scales, torch.float32)
    assert decoded[0, :16].tolist() == [6, -0.5, 1, 4, 0, 0.5, -6, 3, 1.5, -1.5, 2, -2, 0, 0, 6, 0.5]
    assert_same_bits(decoded, fake_quantize(w, "mxfp4"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_round_trip(seed, dtype):
    for shape in SHAPES:
        w = random_weight(shape, dtype)
        blocks, scales = mxfp4_encode(w)
        assert blocks.shape == (*shape[:-1], shape[-1] // 32, 16) and scales.shape == (*shape[:-1], shape[-1] // 32)
        decoded = mxfp4_decode(blocks, scales, dtype)
        assert_same_bits(decoded, fake_quantize(w, "mxfp4"))
        # and back: the same values. The same bytes but for +0's code 0 (read back +0.0, encoded as
        # 8 as all zeros are), and for blocks whose max read back as 3 scales: amax / 6 is then half a
        # scale, so they take half the scale and twice the codes' values (3 -> 6)
        again, again_scales = mxfp4_encode(decoded)
        assert torch.equal(mxfp4_decode(again, again_scales, dtype), decoded)
        nibbles = torch.stack([blocks & 0x0F, blocks >> 4])
        nibbles[nibbles == 0] = 8
        max_is_3 = (nibbles & 0x07).amax(dim=(0, -1)) == 5
        assert torch.equal(again_scales, scales - max_is_3.to(torch.uint8))
        assert torch.equal(again[~max_is_3], (nibbles[0] | nibbles[1] << 4)[~max_is_3])
    with pytest.raises(ValueError, match="E8M0's NaN"):
        mxfp4_decode(blocks, torch.full_like(scales, 255))
    with pytest.raises(ValueError, match=r"expected uint8 \[\.\.\., n, 16\]"):
        mxfp4_decode(blocks[..., :8], scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_idempotent(seed, dtype):
    w = random_weight((4, 8, 64), dtype)
    q = fake_quantize(w, "mxfp4")
    qq = fake_quantize(q, "mxfp4")
    # the same values; the same bits but for the zeros, which the second pass makes all -0.0
    assert torch.equal(qq, q) and torch.equal(bits(qq)[q != 0], bits(q)[q != 0])
    assert torch.signbit(qq[qq == 0]).all() and not torch.signbit(q[q == 0]).all()
    # NVFP4, blocks of normal E4M3 scales (amax > 2^-6 · 448^-1 of the tensor's, as in plain randn)
    w = torch.randn(4, 8, 64, dtype=dtype)
    q = fake_quantize(w, "nvfp4")
    qq = fake_quantize(q, "nvfp4")
    if dtype == torch.bfloat16:  # bf16 rounds the read-back amax back to amax: the same s2 and scales
        assert_same_bits(qq, q)
    else:  # the read-back amax, fl(6 · fl(448 · s2)), may not be amax: s2 moves by up to 3 roundings,
        # each step by 2 more, each value by 2 more: 7 · 2^-24 < 2^-21
        assert ((qq.double() - q.double()).abs() <= 2.0**-21 * q.double().abs()).all()
        # a tensor whose amax reads back as itself (here s2 a power of two: every step is exact)
        w[0, 0, 0] = 6 * 448 * 2.0 ** math.ceil(math.log2(w.abs().max().item() / 2688))
        q = fake_quantize(w, "nvfp4")
        assert_same_bits(fake_quantize(q, "nvfp4"), q)


def test_nvfp4_subnormal_block_scale_is_not_a_fixed_point():
    """A block whose scale is an E4M3 subnormal (multiples of 2^-9) can land its amax on 4 steps
    (amax / scale = 4.8 here), and the second pass picks a smaller scale: ModelOpt's rule, kept."""
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0  # s2 = 1
    w[0, 16] = 6 * 1.6 * 2.0**-9  # block scale 1.6 · 2^-9 -> E4M3 2 · 2^-9; amax = 4.8 steps -> 4
    q = fake_quantize(w, "nvfp4")
    assert q[0, 16].item() == 4 * 2 * 2.0**-9
    qq = fake_quantize(q, "nvfp4")  # scale 4 · 2^-8 / 6 -> 2^-9; 8 steps saturate at 6
    assert qq[0, 16].item() == 6 * 2.0**-9
    assert_same_bits(q, modelopt_qdq(w, "nvfp4"))
    assert_same_bits(qq, modelopt_qdq(q, "nvfp4"))
