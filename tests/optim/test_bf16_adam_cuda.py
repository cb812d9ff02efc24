"""Bf16Adam on CUDA (skipped without a GPU): the compiled update against the eager one, and the
stochastic-rounding bits against the CPU's.

1. random bits and stochastic rounding on CUDA equal the CPU's bit for bit (integer hashing)
2. the compiled update (torch.compile, the default on CUDA) against the eager one, several chunks
   and a partial one: moments within one 8-bit code, parameters within one bf16 step and equal
   almost everywhere (fp32 contraction in the compiled kernel can flip a rounding decision)
3. an 8-bit round trip on CUDA: quantize(dequantize(q)) == q
"""

import pytest
import torch

import megatron_kd.optim.adam as adam
from megatron_kd.optim import Bf16Adam, quantize
from megatron_kd.optim.rounding import random_bits16, stochastic_round_bf16, stream_key

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_random_bits_and_rounding_equal_the_cpu():
    key = stream_key(7, 0, 3, 11)
    cpu = random_bits16(key, 12345, 1 << 20, torch.device("cpu"))
    gpu = random_bits16(key, 12345, 1 << 20, torch.device("cuda"))
    assert torch.equal(cpu, gpu.cpu())
    x = torch.randn(1 << 20) * 1e-3
    assert torch.equal(stochastic_round_bf16(x, cpu), stochastic_round_bf16(x.cuda(), gpu).cpu())


def test_compiled_update_matches_eager(monkeypatch):
    monkeypatch.setattr(adam, "CHUNK", 1 << 16)  # several full chunks and a partial one per tensor
    torch.manual_seed(0)
    sizes = (3 * (1 << 16) + 1000, 5000, 300)
    eager_params = [torch.nn.Parameter((torch.randn(n, device="cuda") * 0.05).bfloat16()) for n in sizes]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = Bf16Adam(eager_params, lr=1e-3, weight_decay=0.1, compile=False, seed=1)
    compiled = Bf16Adam(compiled_params, lr=1e-3, weight_decay=0.1, compile=True, seed=1)
    for _ in range(3):
        for p, q in zip(eager_params, compiled_params):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
        eager.step()
        compiled.step()
    for p, q in zip(eager_params, compiled_params):
        diff = (p.float() - q.float()).abs()
        ulp = torch.exp2(torch.floor(torch.log2(p.float().abs().clamp_min(1e-30))) - 7)
        assert (diff <= ulp).all()
        assert (diff == 0).float().mean() > 0.999
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = eager.get_unscaled_state(p, key), compiled.get_unscaled_state(q, key)
            assert torch.allclose(a, b, rtol=0.02, atol=1e-3 * a.abs().max())


def test_8bit_round_trip_on_cuda():
    x = torch.randn(100_000, device="cuda") * torch.rand(100_000, device="cuda") ** 4
    qmap = quantize.dynamic_map(True, "cuda")
    codes, scales = quantize.quantize(x, qmap)
    again = quantize.quantize(quantize.dequantize(codes, scales, qmap, x.numel()), qmap)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)
