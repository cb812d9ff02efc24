"""8-bit blockwise storage of Adam's moments: the format of bitsandbytes' and torchao's 8-bit Adam
(Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861), packed into one
uint8 tensor per moment.

A moment of n elements is cut into blocks of ``BLOCK`` = 256 consecutive elements (the last block
padded with zeros). Each block keeps its absolute maximum s (fp32) and each element the index
(uint8) of the entry of a 256-entry table, the *dynamic map*, nearest to x / s: a sign, a run of
zero bits that says the decade (1 down to 1e-6 of s) and a fraction in the bits left, so small
entries keep a relative precision instead of rounding to zero. The first moment uses the signed map,
the second (non-negative) the unsigned one.

One change to the signed map of bitsandbytes / torchao: theirs holds +1 but not -1 (127 negative
entries, zero, 128 positive), so a block whose largest magnitude is negative comes back from
dequantization with a smaller maximum, and quantizing it again changes its scale and codes. Here the
positive entry closest to zero (5.5e-7) gives its place to -1: the block's extreme element is then
always coded as exactly ±1, dequantizing gives back exactly ±s, and **quantize(dequantize(q)) == q
bit for bit**. That is what lets a checkpoint hold the moments as plain fp32 values (Megatron's
optimizer checkpoint formats, readable by any Adam) and still resume the same codes and scales.

Layout of one packed moment (``packed_numel``): ``[codes: nb·256 uint8][scales: nb fp32 as 4·nb
bytes]``, nb = ceil(n / 256): 1 + 4/256 bytes per element. Tensors of fewer than
``MIN_QUANTIZED_NUMEL`` elements (biases, norms, the edges of data-parallel shards) keep fp32
moments, as bitsandbytes does: they cost nothing and such parameters are the sensitive ones.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 256
MIN_QUANTIZED_NUMEL = 4096
# the scale of an all-zero block: any positive number; the smallest normal keeps x / s finite
ZERO_BLOCK_SCALE = torch.finfo(torch.float32).tiny


def _bitsandbytes_dynamic_map(signed: bool) -> list[float]:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`` (as torchao
    0.18 ports it: no zero padding), entry for entry."""
    data, exponent_bits = [], 7
    for i in range(exponent_bits):
        fraction_items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        decade = 10 ** (-(exponent_bits - 1) + i)
        data += (decade * means).tolist()  # fp32 products, as theirs
        if signed:
            data += (-decade * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return sorted(data)


@functools.lru_cache(maxsize=None)
def _dynamic_map_values(signed: bool) -> tuple[float, ...]:
    data = _bitsandbytes_dynamic_map(signed)
    if signed:  # symmetric extremes (module docstring): -1 replaces the positive entry nearest zero
        data.remove(min(x for x in data if x > 0))
        data.append(-1.0)
    return tuple(sorted(data))


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 sorted fp32 entries of the signed (first moment) or unsigned (second) map."""
    return torch.tensor(_dynamic_map_values(signed), dtype=torch.float32, device=device)


def nearest_codes(normalized: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Index of the ``qmap`` entry nearest to each value of ``normalized`` (in [-1, 1]), as uint8.

    Branchless binary search for the last entry <= x (eight table lookups, as torchao's
    ``quantize_8bit_with_qmap`` does it), then one step up when x is at least halfway to the next
    entry."""
    codes = torch.where(normalized >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += torch.where(normalized >= qmap[codes + step], step, 0)
    up = (codes + 1).clamp(max=255)
    below, above = qmap[codes], qmap[up]
    codes = torch.where(normalized - below >= (above - below) * 0.5, up, codes)
    return codes.to(torch.uint8)


def quantize(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat fp32 tensor of n elements -> (codes uint8 [nb·BLOCK], scales fp32 [nb])."""
    n = x.numel()
    blocks = -(-n // BLOCK)
    padded = torch.nn.functional.pad(x.reshape(-1), (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    scales = padded.abs().amax(1).clamp_min(ZERO_BLOCK_SCALE)
    # x / s is exactly ±1 for the block's extreme element (IEEE division of x by |x|)
    codes = nearest_codes((padded / scales[:, None]).view(-1), qmap)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor, n: int) -> torch.Tensor:
    """(codes, scales) -> the first ``n`` fp32 values."""
    values = qmap[codes.long()].view(scales.numel(), BLOCK) * scales[:, None]
    return values.view(-1)[:n]


# ---- one uint8 tensor per moment ---------------------------------------------------------------


def is_quantized(numel: int) -> bool:
    """Whether a moment of ``numel`` elements is stored in 8 bits (else fp32)."""
    return numel >= MIN_QUANTIZED_NUMEL


def packed_numel(numel: int) -> int:
    """Bytes of one packed 8-bit moment of ``numel`` elements."""
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK + 4 * blocks


def moment_bytes(numel: int) -> int:
    """Bytes one moment of a ``numel``-element tensor takes (packed 8-bit, or fp32 when small)."""
    return packed_numel(numel) if is_quantized(numel) else 4 * numel


def packed_zeros(numel: int, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """A packed moment of ``numel`` zeros: every code that of 0, every scale that of a zero block."""
    packed = torch.empty(packed_numel(numel), dtype=torch.uint8, device=device)
    codes, scales = packed_views(packed)
    codes.fill_(_dynamic_map_values(signed).index(0.0))
    scales.fill_(ZERO_BLOCK_SCALE)
    return packed


def packed_views(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) views into a packed moment (no copies)."""
    blocks = packed.numel() // (BLOCK + 4)
    codes = packed[: blocks * BLOCK]
    scales = packed[blocks * BLOCK:].view(torch.float32)  # 256-byte aligned offset: a valid fp32 view
    return codes, scales


def is_packed(tensor: torch.Tensor, numel: int) -> bool:
    """Whether ``tensor`` has the packed layout of a ``numel``-element moment."""
    return tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.numel() == packed_numel(numel)
