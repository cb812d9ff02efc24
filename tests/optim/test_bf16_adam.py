"""Bf16Adam, its 8-bit moments and its stochastic rounding, against references (CPU, fast).

1. the update against a float64 reference of the same algorithm: moments within the 8-bit format's
   rounding of the exact ones (exact in fp32 mode), parameters one of the two bf16 neighbours of
   the exact value (stochastic) or the nearest one; with fp32 parameters and fp32 moments it is
   torch's AdamW bit for bit
2. stochastic rounding is unbiased: the mean of many draws of SR(x) is x within 5 standard
   deviations of the draws' own variance; an update far below bf16's resolution (lr 1e-5) moves the
   mean weight by exactly the fp64 trajectory, where rounding to nearest never moves it
3. the random bits of an element depend on (key, element index) only: a shard draws the slice of
   the whole tensor's bits
4. 8-bit moments: every code is the map entry nearest to x / scale (checked by brute force), the
   error is at most half the gap between the entries around it, and quantize(dequantize(q)) == q;
   the maps are bitsandbytes' / torchao's (torchao checked where installed), the signed one with -1
   in place of its entry nearest zero
5. checkpoint round trip: state_dict -> a new optimizer continues bit for bit; fp32 values through
   get_unscaled_state / set_scaled_state give back the same packed bytes; placeholders of the
   parameter's size are taken as values
6. megatron-core's keywords that contradict the choice are one clear error; the plan's bytes per
   parameter are what the state holds
7. the fused Triton kernel (Triton's interpreter) equals the torch ops bit for bit, step after step
"""

import copy
import math
import os

import pytest
import torch

from megatron_kd.errors import UserError
from megatron_kd.optim import Bf16Adam, quantize
from megatron_kd.optim.megatron import optimizer_memory
from megatron_kd.optim.rounding import random_bits16, stochastic_round_bf16, stream_key

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of the bf16 grid at |x| (float64)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def _reference_step(p, g, m, v, t, *, lr, betas, eps, weight_decay, adam_w_mode=True):
    """Adam(W) in float64 from the given (dequantized) moments."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    b1, b2 = betas
    if adam_w_mode:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr / (1 - b1 ** t) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps)
    return p, m, v


def _half_gap(normalized: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Half the distance between the two map entries around each value (float64)."""
    q = qmap.double()
    hi = torch.searchsorted(q, normalized.double()).clamp(1, 255)
    return (q[hi] - q[hi - 1]) / 2


@pytest.mark.parametrize("moments", ["8bit", "fp32"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_update_matches_float64_reference(moments, rounding, adam_w_mode):
    torch.manual_seed(0)
    n = 3 * quantize.BLOCK * 8 + 77  # quantized, with a partial last block
    p = torch.nn.Parameter((torch.randn(n) * 0.05).bfloat16())
    opt = Bf16Adam([p], **HYPER, rounding=rounding, moments=moments, adam_w_mode=adam_w_mode, seed=11)
    for t in range(1, 5):
        g = (torch.randn(n) * torch.rand(n) ** 3).bfloat16()  # gradients of many magnitudes
        before = p.detach().clone()
        m0, v0 = (opt.get_unscaled_state(p, key) for key in ("exp_avg", "exp_avg_sq")) if t > 1 else (
            torch.zeros(n), torch.zeros(n))
        p.grad = g
        opt.step()
        p64, m64, v64 = _reference_step(before, g, m0, v0, t, **HYPER, adam_w_mode=adam_w_mode)
        m, v = opt.get_unscaled_state(p, "exp_avg").double(), opt.get_unscaled_state(p, "exp_avg_sq").double()
        if moments == "fp32":
            # fp32 arithmetic on inputs of the size of the largest ones
            assert torch.allclose(m, m64, rtol=0, atol=1e-6 * m64.abs().max())
            assert torch.allclose(v, v64, rtol=0, atol=1e-6 * v64.abs().max())
        else:
            for stored, exact, signed in ((m, m64, True), (v, v64, False)):
                blocks = torch.nn.functional.pad(exact, (0, -n % quantize.BLOCK)).view(-1, quantize.BLOCK)
                scale = blocks.abs().amax(1).repeat_interleave(quantize.BLOCK)[:n]
                bound = _half_gap(exact / scale, quantize.dynamic_map(signed)) * scale
                assert ((stored - exact).abs() <= bound * (1 + 1e-4) + 1e-12 * scale).all()
        err = (p.detach().double() - p64).abs()
        ulp = _bf16_ulp(p64)
        if rounding == "nearest":
            assert (err <= ulp / 2 * (1 + 1e-3)).all()
        else:
            assert (err < ulp * (1 + 1e-3)).all()  # one of the two neighbours
            assert (err > ulp / 2 * (1 + 1e-3)).any()  # and not always the nearest


def test_fp32_parameters_and_moments_are_torch_adamw():
    torch.manual_seed(0)
    ours, theirs = (torch.nn.Parameter(torch.randn(3000)) for _ in range(2))
    theirs.data.copy_(ours.data)
    opt = Bf16Adam([ours], **HYPER, moments="fp32", rounding="nearest")
    ref = torch.optim.AdamW([theirs], **HYPER, foreach=False)
    for _ in range(5):
        g = torch.randn(3000)
        ours.grad, theirs.grad = g, g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)
    assert torch.equal(opt.state[ours]["exp_avg_sq"], ref.state[theirs]["exp_avg_sq"])


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = (torch.randn(64) * 10.0 ** torch.randint(-6, 3, (64,))).float()
    draws = 4000
    total = torch.zeros(64, dtype=torch.float64)
    for step in range(draws):
        total += stochastic_round_bf16(x, random_bits16(stream_key(1, step), 0, 64, x.device)).double()
    mean = total / draws
    lo = x.bfloat16().double()
    lo = torch.where(lo.abs() > x.double().abs(), lo - torch.sign(x.double()) * _bf16_ulp(x.double()), lo)
    frac = ((x.double() - lo).abs() / _bf16_ulp(x.double())).clamp(0, 1)  # probability of rounding away
    sd = _bf16_ulp(x.double()) * torch.sqrt(frac * (1 - frac) / draws)
    assert ((mean - x.double()).abs() <= 5 * sd + 1e-9 * x.double().abs()).all()
    # each draw is one of the two neighbours
    one = stochastic_round_bf16(x, random_bits16(stream_key(2), 0, 64, x.device)).double()
    assert ((one - x.double()).abs() < _bf16_ulp(x.double())).all()
    # inf and NaN are kept
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    out = stochastic_round_bf16(special, random_bits16((5, 0), 0, 3, special.device))
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()


def test_small_updates_accumulate_in_expectation_and_stall_when_rounded_to_nearest():
    """lr 1e-5 at weight 0.02 (bf16 step 1.2e-4): 50 updates of ~1e-5 each."""
    n, steps, lr = 20000, 50, 1e-5
    results = {}
    for rounding in ("stochastic", "nearest"):
        p = torch.nn.Parameter(torch.full((n,), 0.02).bfloat16())
        opt = Bf16Adam([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, rounding=rounding, moments="fp32")
        for _ in range(steps):
            p.grad = torch.ones(n, dtype=torch.bfloat16)  # m̂ / sqrt(v̂) = 1: each update is lr/(1 + eps)
            opt.step()
        results[rounding] = p.detach().double()
    start = torch.tensor(0.02).bfloat16().double()
    exact = start - steps * lr / (1 + 1e-8)
    ulp = _bf16_ulp(start)
    assert abs(results["stochastic"].mean() - exact) < 5 * ulp * math.sqrt(steps) / 2 / math.sqrt(n)
    assert torch.equal(results["nearest"], torch.full((n,), float(start), dtype=torch.float64))  # never moved


def test_random_bits_depend_on_the_element_only():
    key = stream_key(3, 1, 4, 1, 5)
    whole = random_bits16(key, 0, 10_000, torch.device("cpu"))
    assert torch.equal(random_bits16(key, 4321, 1000, torch.device("cpu")), whole[4321:5321])
    assert not torch.equal(random_bits16(stream_key(3, 1, 4, 1, 6), 0, 10_000, torch.device("cpu")), whole)
    assert whole.min() >= 0 and whole.max() < 2**16
    # uniform: each of 16 bins of the 16 bits holds 1/16 of the draws
    counts = torch.bincount(whole >> 12, minlength=16).double()
    assert ((counts - 625).abs() < 5 * math.sqrt(625)).all()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8bit_codes_are_nearest_and_round_trip_exactly(signed):
    torch.manual_seed(0)
    n = 40 * quantize.BLOCK + 13
    x = torch.randn(n) * torch.rand(n) ** 6 * 10.0 ** torch.randint(-8, 2, (n,))  # six decades within blocks
    x = x if signed else x.abs()
    x[: quantize.BLOCK] = 0.0  # an all-zero block
    x[quantize.BLOCK: 2 * quantize.BLOCK] = -x[quantize.BLOCK: 2 * quantize.BLOCK].abs() if signed else x[
        quantize.BLOCK: 2 * quantize.BLOCK]  # a block whose largest magnitude is negative
    qmap = quantize.dynamic_map(signed)
    codes, scales = quantize.quantize(x, qmap)
    values = quantize.dequantize(codes, scales, qmap, n)
    blocks = torch.nn.functional.pad(x, (0, -n % quantize.BLOCK)).view(-1, quantize.BLOCK)
    scale = blocks.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny).repeat_interleave(quantize.BLOCK)[:n]
    normalized = x.double() / scale.double()
    nearest = (normalized[:, None] - qmap.double()[None, :]).abs().min(1).values
    assert torch.allclose((values.double() / scale.double() - normalized).abs(), nearest, atol=1e-6)
    assert ((values.double() - x.double()).abs() <= _half_gap(normalized, qmap) * scale * (1 + 1e-5)).all()
    assert (values[:quantize.BLOCK] == 0).all()
    again = quantize.quantize(values, qmap)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)


def test_maps_are_bitsandbytes_as_torchao_has_them():
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    unsigned = torch.tensor(quant_utils.create_dynamic_map(signed=False), dtype=torch.float32)
    assert torch.equal(quantize.dynamic_map(False), unsigned)
    theirs = quant_utils.create_dynamic_map(signed=True)
    ours = quantize.dynamic_map(True).tolist()
    assert ours[0] == -1.0 and ours[-1] == 1.0 and -1.0 not in theirs
    swapped = min(v for v in theirs if v > 0)
    assert sorted(ours) == sorted([v for v in torch.tensor(theirs).tolist() if v != torch.tensor(swapped).item()] + [-1.0])
    # the same codes as torchao's quantizer on the same map
    x = torch.rand(4096) * 2 - 1
    assert torch.equal(quantize.nearest_codes(x, quantize.dynamic_map(True)),
                       quant_utils.quantize_8bit_with_qmap(x, quantize.dynamic_map(True)))


def _trained(seed=0, steps=3, **options):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(shape) * 0.05).bfloat16()) for shape in ((64, 96), (300,), (5000,))]
    opt = Bf16Adam(params, **HYPER, seed=9, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def test_checkpoint_round_trip_is_bitwise():
    params, opt = _trained()
    saved_params, saved = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    clones = [torch.nn.Parameter(p.clone()) for p in saved_params]
    resumed = Bf16Adam(clones, **HYPER, seed=9)
    resumed.load_state_dict(saved)
    assert [g["step"] for g in resumed.param_groups] == [3]
    torch.manual_seed(1)
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    for step in grads:
        for p, q, g in zip(params, clones, step):
            p.grad, q.grad = g, g.clone()
        opt.step()
        resumed.step()
    for p, q in zip(params, clones):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], resumed.state[q][key])


def test_unscaled_values_give_back_the_packed_state():
    params, opt = _trained()
    fresh = Bf16Adam([torch.nn.Parameter(p.detach().clone()) for p in params], **HYPER, seed=9)
    for p, q in zip(params, (q for g in fresh.param_groups for q in g["params"])):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            value = opt.get_unscaled_state(p, key)
            assert value.dtype == torch.float32 and value.shape == p.shape
            fresh.set_scaled_state(q, key, value.clone())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fresh.state[q][key]), key
        assert torch.equal(p, q) and fresh.state[q]["master_param"] is q
    # megatron-core's placeholders: tensors of the parameter's size, of any dtype, taken as values
    placeholders = copy.deepcopy(opt.state_dict())
    for i, state in placeholders["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = opt.get_unscaled_state(params[i], key).view(-1).to(torch.uint8 if key == "exp_avg_sq" else
                                                                          torch.float32)
    fresh.load_state_dict(placeholders)
    p = params[0]
    q = fresh.param_groups[0]["params"][0]
    assert torch.equal(opt.state[p]["exp_avg"], fresh.state[q]["exp_avg"])


def test_parameters_without_saved_state_get_zero_moments():
    params, opt = _trained(steps=0)
    opt.load_state_dict(opt.state_dict())  # megatron-core does this right after handing over its shards
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert (opt.get_unscaled_state(p, key) == 0).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"exp_avg_dtype": torch.float32}, "--exp-avg-dtype must be fp8"),
    ({"exp_avg_sq_dtype": torch.bfloat16}, "--exp-avg-sq-dtype must be fp8"),
    ({"master_weight_dtype": torch.float16}, "--main-params-dtype must be fp32"),
    ({"capturable": True}, "--optimizer-cuda-graph"),
    ({"amsgrad": True}, "amsgrad must be False"),
    ({"rounding": "up"}, "rounding must be one of"),
])
def test_contradicting_keywords_are_one_clear_error(kwargs, match):
    with pytest.raises(UserError, match=match):
        Bf16Adam([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], **kwargs)
    with pytest.raises(UserError, match="bf16 or fp32 parameters, got torch.float16"):
        Bf16Adam([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))])


def test_plan_bytes_per_parameter_are_what_the_state_holds():
    n = 1 << 20
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    opt = Bf16Adam([p])
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_bytes() / n == optimizer_memory("bf16-sr-8bit").state == 2 * (1 + 4 / 256)
    assert optimizer_memory("bf16-sr-8bit").gradient == 2.0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_triton_update_is_the_torch_update(adam_w_mode, seed):
    """The fused kernel (under Triton's interpreter on the CPU) against the torch ops, several steps
    with a new learning rate each and the same state before each: 8-bit moments over several
    programs with a partial last block, fp32 moments of a small tensor, a bf16 and an fp32
    parameter, stochastic rounding. The interpreter rounds each fp32 operation once, as numpy does;
    torch's CPU kernels fuse some multiply-adds, which moves an fp32 result by one unit in the last
    place on a few elements: fp32 values within that, and what is rounded from them (bf16 weights,
    8-bit codes) equal almost everywhere and at most one step apart where a value sat on a
    rounding boundary. On the GPU the kernel contracts multiply-adds itself:
    tests/optim/test_bf16_adam_cuda.py bounds that the same way."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((quantize.BLOCK * 4 * 5 + 37, torch.bfloat16), (300, torch.bfloat16), (5000, torch.float32))
    params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.05).to(dtype)) for n, dtype in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    kernel, torch_ops = (Bf16Adam(groups(ps), lr=1e-3, impl=impl, seed=3, adam_w_mode=adam_w_mode)
                         for ps, impl in ((params, "triton"), (twins, "torch")))
    for step in range(3):
        for opt in (kernel, torch_ops):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * 0.7 ** step  # a new number every step, as a schedule gives
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            q.grad = p.grad.clone()
            if step:  # the same state before the step
                p.data.copy_(q.data)
                for key in ("exp_avg", "exp_avg_sq"):
                    kernel.state[p][key].copy_(torch_ops.state[q][key])
        before = [q.detach().clone() for q in twins]
        kernel.step()
        torch_ops.step()
        _assert_same_update(kernel, torch_ops, params, twins, before, lr=1e-3 * 0.7 ** step, step=step)


def _assert_same_update(kernel, torch_ops, params, twins, before, *, lr: float, step: int) -> None:
    """The kernel's parameters and moments against the torch ops' (the bounds of the test above)."""
    for p, q, q0 in zip(params, twins, before):
        fp32_unit = torch.finfo(torch.float32).eps
        if p.dtype == torch.float32:  # units of the operands: the weight, and Adam's step (~lr m / √v)
            unit = 2 * fp32_unit * (q0.abs() + 10 * lr)
            assert ((p - q).abs() <= unit).all(), (step, p.numel())
        else:
            steps = (p.detach().double() - q.detach().double()).abs() / _bf16_ulp(q.detach().double())
            assert steps.max() <= 1 and (steps == 0).double().mean() > 0.999, (step, p.numel())
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = kernel.state[p][key], torch_ops.state[q][key]
            if a.dtype == torch.float32:
                # a few fp32 roundings of the operands apart (m = m + (1 - β1)(g - m) cancels)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
            else:
                codes = (quantize.packed_views(a)[0].int() - quantize.packed_views(b)[0].int()).abs()
                assert codes.max() <= 1 and (codes == 0).double().mean() > 0.999, (step, key)
                torch.testing.assert_close(quantize.packed_views(a)[1], quantize.packed_views(b)[1],
                                           rtol=2 * fp32_unit, atol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_one_launch_updates_shards_and_follows_new_addresses(seed):
    """The kernel's launch per group and kind (adam_triton.KernelBatch) on what megatron-core's
    distributed optimizer hands it: 1-D views of shards that start inside their parameters (the
    rounding streams continue at the shard's offset), two kinds in one group (8-bit and fp32
    moments), a tensor without a gradient on one step (the launch's tables change), gradients at new
    addresses every step and moments replaced by a checkpoint load; against the torch ops."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (quantize.BLOCK * 70 + 13, 6000, 700)  # a shard over two work items, one within one, fp32 moments
    params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.05).bfloat16()) for n in sizes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kernel, torch_ops = (Bf16Adam(ps, lr=1e-3, weight_decay=0.1, impl=impl, seed=5)
                         for ps, impl in ((params, "triton"), (twins, "torch")))
    cuts = (slice(3 * quantize.BLOCK + 50, None), slice(0, 5000), slice(100, 700))
    shards = [p.detach().view(-1)[cut] for p, cut in zip(params, cuts)]
    twin_shards = [q.detach().view(-1)[cut] for q, cut in zip(twins, cuts)]
    for opt, views in ((kernel, shards), (torch_ops, twin_shards)):
        opt.param_groups[0]["params"] = views
    for step in range(3):
        for i, (p, q) in enumerate(zip(shards, twin_shards)):
            g = None if (step, i) == (1, 1) else torch.randn(p.shape, generator=gen).bfloat16()
            p.grad, q.grad = g, (None if g is None else g.clone())
            if step:  # the same state before the step
                p.copy_(q)
                for key in ("exp_avg", "exp_avg_sq"):
                    if step == 2:  # as load_state_dict does: new tensors
                        kernel.state[p][key] = torch_ops.state[q][key].clone()
                    elif kernel.state[p]:
                        kernel.state[p][key].copy_(torch_ops.state[q][key])
        before = [q.clone() for q in twin_shards]
        kernel.step()
        torch_ops.step()
        _assert_same_update(kernel, torch_ops, shards, twin_shards, before, lr=1e-3, step=step)


def test_unknown_impl_is_one_clear_error():
    with pytest.raises(UserError, match="impl must be one of"):
        Bf16Adam([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], impl="compiled")

