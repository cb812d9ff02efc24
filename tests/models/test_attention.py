"""Core attention with sliding windows and sinks (megatron_kd/models/attention.py).

1. CPU: ``CoreAttention`` equals megatron-core's own ``DotProductAttention`` (which materializes the
   scores) in output and in the gradients of q, k, v and the sink: window and full layers, GQA,
   sinks learnable or absent, at TP = 1 and TP = 2 (gloo, each rank its heads)
2. CUDA: the flex (window), cuDNN (full causal) and FlashAttention-4 (both; where flash-attn-4 is
   installed on an SM90 / SM100 GPU) paths, bf16, against the fp32 math reference at 4K-32K
   tokens: output and every gradient, the sink's included
3. bad ``impl`` names and combinations raise ValueError
"""

import pytest
import torch

from megatron_kd.models.attention import core_attention, flash4_available
from tests.fixtures.dist_utils import init_tensor_parallel, megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err

HEADS, GROUPS, HEAD_DIM, SEQ = 4, 2, 8, 24


def _config(tp, *, window, softmax_type):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=HEAD_DIM, use_cpu_initialization=True,
                             params_dtype=torch.float64, attention_dropout=0.0, tensor_model_parallel_size=tp,
                             window_size=window, window_attn_skip_freq=2 if window else None,
                             softmax_type=softmax_type, masked_softmax_fusion=False)


CASES = [(window, layer_number, softmax_type) for window, layer_number in [((5, 0), 1), ((5, 0), 2), (None, 1)]
         for softmax_type in ("learnable", "vanilla")]  # window layer, full layer of a windowed model, full


def _worker(rank, world, seed):
    with megatron_cpu_patches():
        init_tensor_parallel(world)
        for case in CASES:
            _compare(rank, world, seed, *case)


def _compare(rank, world, seed, window, layer_number, softmax_type):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_kd.models.attention import CoreAttention

    config = _config(world, window=window, softmax_type=softmax_type)
    theirs = DotProductAttention(config, layer_number, AttnMaskType.causal, "self")
    ours = CoreAttention(config, layer_number, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(seed)
    heads, groups = HEADS // world, GROUPS // world
    # every rank draws the full problem and keeps its heads: rank r holds heads [r·n/tp, (r+1)·n/tp)
    q = torch.randn(SEQ, 2, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)[:, :, rank * heads:(rank + 1) * heads]
    k = torch.randn(SEQ, 2, GROUPS, HEAD_DIM, generator=g, dtype=torch.float64)[:, :, rank * groups:(rank + 1) * groups]
    v = torch.randn(SEQ, 2, GROUPS, HEAD_DIM, generator=g, dtype=torch.float64)[:, :, rank * groups:(rank + 1) * groups]
    d_out = torch.randn(SEQ, 2, heads * HEAD_DIM, generator=g, dtype=torch.float64)
    if softmax_type == "learnable":
        sink = torch.randn(HEADS, generator=g, dtype=torch.float64)[rank * heads:(rank + 1) * heads]
        with torch.no_grad():
            theirs.softmax_offset.copy_(sink)
            ours.softmax_offset.copy_(sink)
    results = []
    for module in (theirs, ours):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*inputs, None)
        out.backward(d_out)
        grads = [t.grad for t in inputs]
        if softmax_type == "learnable":
            grads.append(module.softmax_offset.grad)
        results.append((out.detach(), grads))
    (out_theirs, grads_theirs), (out_ours, grads_ours) = results
    assert ours.window == (tuple(window) if window and layer_number % 2 else None)
    case = (window, layer_number, softmax_type)
    assert rel_err(out_ours, out_theirs) < 1e-12, case
    for name, a, b in zip("qkv" + "s", grads_ours, grads_theirs):
        assert rel_err(a, b) < 1e-12, (name, case)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_core_attention_equals_megatron(seed, tp):
    spawn(_worker, seed, world_size=tp)


def test_bad_impl():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="impl must be one of"):
        core_attention(q, q, q, scale=0.3, impl="fast")
    with pytest.raises(ValueError, match="neither windows nor sinks"):
        core_attention(q, q, q, scale=0.3, window=(2, 0), impl="sdpa")
    with pytest.raises(ValueError, match="full causal layers"):
        core_attention(q, q, q, scale=0.3, window=(2, 0), sink=torch.zeros(2), impl="cudnn")
    with pytest.raises(ValueError, match="dropout"):
        core_attention(q, q, q, scale=0.3, window=(2, 0), dropout_p=0.1, impl="flex")
    with pytest.raises(ValueError, match="needs the flash-attn-4 package"):
        core_attention(q, q, q, scale=0.3, sink=torch.zeros(2), impl="flash4")


@pytest.mark.cuda
@pytest.mark.xdist_group("gpu_memory")  # its fp32 [s, s] references take up to ~60 GiB
@pytest.mark.parametrize("impl, window, with_sink", [("flex", (127, 0), True), ("cudnn", None, True), ("flex", None, True),
                                                     ("flash4", (127, 0), True), ("flash4", None, True),
                                                     ("flash4", None, False)])
@pytest.mark.parametrize("seq, heads, groups", [(4096, 8, 1), (16384, 8, 2), (32768, 2, 1)])
def test_cuda_attention_matches_fp32_reference(seed, impl, window, with_sink, seq, heads, groups):
    if impl == "flash4" and not flash4_available(torch.device("cuda")):
        pytest.skip("flash-attn-4 is not installed or this GPU has no FlashAttention-4 kernels")
    g = torch.Generator(device="cuda").manual_seed(seed)
    # megatron's layout: [s, b, n, d] permuted to [b, n, s, d] views, as CoreAttention passes them
    q, k, v = (torch.randn(seq, 1, n, 64, device="cuda", generator=g, dtype=torch.bfloat16).permute(1, 2, 0, 3)
               for n in (heads, groups, groups))
    sink = torch.randn(heads, device="cuda", generator=g, dtype=torch.bfloat16)
    d_out = torch.randn(1, heads, seq, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    results = []
    for run_impl, dtype in ((impl, torch.bfloat16), ("math", torch.float32)):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sink)]
        out = core_attention(*inputs[:3], scale=0.125, window=window, sink=inputs[3] if with_sink else None,
                             impl=run_impl)
        out.backward(d_out.to(dtype))
        results.append([out.detach().float()] + [t.grad.float() for t in inputs[:4 if with_sink else 3]])
        del out, inputs
    for name, ours, ref in zip(["out", "dq", "dk", "dv", "dsink"], *results):
        assert rel_err(ours, ref) < 2e-2, (name, rel_err(ours, ref))
