"""Bf16Adam on CUDA (skipped without a GPU): the Triton update against the torch ops, and the
stochastic-rounding bits against the CPU's.

1. random bits and stochastic rounding on CUDA equal the CPU's bit for bit (integer hashing)
2. the Triton update (the default on CUDA) against the torch ops, each step from the same state,
   several torch chunks and a partial one: moments within one 8-bit code, parameters within one
   bf16 step, both equal almost everywhere (fp32 contraction in the kernel can flip a rounding
   decision)
3. an 8-bit round trip on CUDA: quantize(dequantize(q)) == q
"""

import pytest
import torch

import megatron_kd.optim.adam as adam
from megatron_kd.optim import Bf16Adam, quantize
from megatron_kd.optim.rounding import random_bits16, stochastic_round_bf16, stream_key

pytestmark = pytest.mark.cuda


def test_random_bits_and_rounding_equal_the_cpu():
    key = stream_key(7, 0, 3, 11)
    cpu = random_bits16(key, 12345, 1 << 20, torch.device("cpu"))
    gpu = random_bits16(key, 12345, 1 << 20, torch.device("cuda"))
    assert torch.equal(cpu, gpu.cpu())
    x = torch.randn(1 << 20) * 1e-3
    assert torch.equal(stochastic_round_bf16(x, cpu), stochastic_round_bf16(x.cuda(), gpu).cpu())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 steps of the larger of the two magnitudes."""
    big = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return (a.float() - b.float()).abs() / torch.exp2(torch.floor(torch.log2(big)) - 7)


def _codes(opt, p, key) -> torch.Tensor:
    """A moment as stored: the 8-bit codes (int), or the fp32 values of a small tensor."""
    stored = opt.state[p][key]
    return quantize.packed_views(stored)[0][:p.numel()].int() if stored.dtype == torch.uint8 else stored


def test_triton_update_matches_torch_ops(monkeypatch):
    """Each step from the same state. The kernel contracts multiply-adds that torch's ops round
    twice, so an fp32 value on a rounding boundary can land on the other side: a bf16 parameter one
    step away, an 8-bit moment one code away, on a few elements. Run free, two trajectories do not
    stay that close: a moment one code off changes the next update, and the differences compound
    (an H200, 2026-12-02: one parameter 1 step apart after step 1, 28 steps apart on some elements by
    step 3, with moments 13 codes apart; from the same state every step: at most 1 step, 1 code).
    That is two valid roundings diverging, not a wrong update, so the update is checked per step."""
    monkeypatch.setattr(adam, "CHUNK", 1 << 16)  # several full chunks and a partial one per tensor
    torch.manual_seed(0)
    sizes = (3 * (1 << 16) + 1000, 5000, 300)  # 8-bit moments; and fp32 ones below 4,096 elements
    torch_params = [torch.nn.Parameter((torch.randn(n, device="cuda") * 0.05).bfloat16()) for n in sizes]
    kernel_params = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    torch_ops = Bf16Adam(torch_params, lr=1e-3, weight_decay=0.1, impl="torch", seed=1)
    kernel = Bf16Adam(kernel_params, lr=1e-3, weight_decay=0.1, impl="triton", seed=1)
    for step in range(3):  # the step's numbers change (bias corrections)
        for p, q in zip(torch_params, kernel_params):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
            if step:  # the same state before the step
                q.data.copy_(p.data)
                for key in ("exp_avg", "exp_avg_sq"):
                    kernel.state[q][key].copy_(torch_ops.state[p][key])
        torch_ops.step()
        kernel.step()
        for p, q in zip(torch_params, kernel_params):
            ulps = _ulps(p, q)
            assert ulps.max() <= 1, (step, p.numel(), float(ulps.max()))
            assert (ulps == 0).float().mean() > 0.999
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = _codes(torch_ops, p, key), _codes(kernel, q, key)
                if a.dtype == torch.float32:
                    # a few fp32 roundings of the operands apart (m = m + (1 - β1)(g - m) cancels)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
                else:
                    assert (a - b).abs().max() <= 1, (step, key)
                    assert (a == b).float().mean() > 0.999, (step, key)


def test_8bit_round_trip_on_cuda():
    x = torch.randn(100_000, device="cuda") * torch.rand(100_000, device="cuda") ** 4
    qmap = quantize.dynamic_map(True, "cuda")
    codes, scales = quantize.quantize(x, qmap)
    again = quantize.quantize(quantize.dequantize(codes, scales, qmap, x.numel()), qmap)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)
