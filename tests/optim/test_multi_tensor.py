"""megatron_kd.optim.multi_tensor: the foreach gradient norm and scale against float64, and inside
megatron-core's own gradient norm and clip (two gloo ranks, each holding different gradients)."""


import pytest
import torch

from megatron_kd.optim import multi_tensor
from tests.fixtures.dist_utils import spawn
from tests.fixtures.megatron_cpu import megatron_optimizer_cpu_patches

SIZES = (1, 255, 4096, 70_001)  # a scalar-like tensor, a partial block, one and many foreach chunks
NO_FLAG = torch.zeros(1, dtype=torch.int)


def _tensors(dtype, scale=1.0):
    return [torch.randn(n, dtype=torch.float64).mul_(scale).to(dtype) for n in SIZES]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_l2_norm_against_float64(dtype):
    grads = _tensors(dtype, scale=1e-3)
    total, per_tensor = multi_tensor.l2_norm(2048 * 32, NO_FLAG, [grads[:2], grads[2:]], True)
    exact = [g.double().norm() for g in grads]
    assert total.dtype == per_tensor.dtype == torch.float32 and total.shape == (1,)
    # fp32 sums of 70,001 exactly representable squares: ~sqrt(n) fp32 roundings of relative error
    assert abs(total.double().item() / torch.stack(exact).norm().item() - 1) < 1e-5
    torch.testing.assert_close(per_tensor.double(), torch.stack(exact), rtol=1e-5, atol=0)
    assert multi_tensor.l2_norm(0, NO_FLAG, [grads], False)[1] is None
    empty_total, empty_per_tensor = multi_tensor.l2_norm(0, NO_FLAG, [[]], True)
    assert empty_total.item() == 0 and empty_per_tensor.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_in_place_and_into_other_tensors(dtype):
    """In place (the clip's [grads, grads]) and from fp32 into ``dtype`` (a copy with a factor): the
    product in fp32 rounded once, bit for bit."""
    grads = _tensors(dtype)
    expected = [(g.float() * 0.37).to(dtype) for g in grads]
    multi_tensor.scale(0, NO_FLAG, [grads, grads], 0.37)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)

    sources = _tensors(torch.float32)
    targets = [torch.empty(s.shape, dtype=dtype) for s in sources]
    multi_tensor.scale(0, NO_FLAG, [sources, targets], 1.0)
    for source, target in zip(sources, targets):
        assert torch.equal(target, source.to(dtype))
    with pytest.raises(ValueError, match="3 source tensors for 4 targets"):
        multi_tensor.scale(0, NO_FLAG, [sources[:3], targets], 1.0)


def _megatron_norm_and_clip(rank, world_size):
    from megatron.core.optimizer import clip_grads

    torch.manual_seed(100 + rank)  # each rank its own gradients: the norm is over both ranks' tensors
    grads = _tensors(torch.bfloat16, scale=1e-2)
    mine = torch.stack([g.double().norm() for g in grads]).norm() ** 2
    every = [torch.zeros((), dtype=torch.float64) for _ in range(world_size)]
    torch.distributed.all_gather(every, mine)
    exact = torch.stack(every).sum().sqrt().item()
    group = torch.distributed.group.WORLD
    with megatron_optimizer_cpu_patches():
        local = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=group)  # megatron's fallback
        assert multi_tensor.install() and not multi_tensor.install()  # replaced once, then idempotent
        assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
        norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=group)
        assert abs(norm / exact - 1) < 1e-5
        assert abs(local / exact - 1) < 2e-2  # the fallback's per-tensor norms are rounded to bf16
        # bf16 gradients reach the clip as ``decoupled_grad`` (the precision-aware optimizer's)
        params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.bfloat16)) for g in grads]
        for p, g in zip(params, grads):
            p.decoupled_grad = g.clone()
        expected = [(g.float() * (0.5 / (norm + 1e-6))).to(torch.bfloat16) for g in grads]
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=0.5, total_norm=norm, use_decoupled_grad=True)
        for p, want in zip(params, expected):
            assert torch.equal(p.decoupled_grad, want)


def test_megatron_grad_norm_and_clip_over_two_ranks():
    spawn(_megatron_norm_and_clip, world_size=2)


@pytest.mark.cuda
def test_scale_in_place_on_cuda_rounds_once():
    """CUDA's foreach multiply: fp32 math, one rounding, bit for bit as the CPU's per-tensor ``mul_``."""
    grads = [g.cuda() for g in _tensors(torch.bfloat16)]
    expected = [(g.float() * 0.37).to(torch.bfloat16) for g in grads]
    multi_tensor.scale(0, NO_FLAG.cuda(), [grads, grads], 0.37)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)
    total, _ = multi_tensor.l2_norm(0, NO_FLAG.cuda(), [grads], False)
    exact = torch.stack([g.double().norm() for g in grads]).norm()
    assert abs(total.double().item() / exact.item() - 1) < 1e-5
