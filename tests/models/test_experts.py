"""Grouped-GEMM experts (megatron_kd/models/experts.py) equal megatron-core's SequentialMLP.

1. the experts alone, GPT-OSS's clamped gated activation with biases, uneven and empty expert
   groups: output and the gradients of the input, the probabilities and every expert parameter
   (bf16 on CPU, where torch's grouped_mm has a backward; bf16 on CUDA), without recompute and with
   the activation recomputed (``--recompute-modules moe_act``, under selective and block recompute)
2. recomputing the activation changes nothing: output and every gradient bitwise equal on CPU (within
   1e-3 on CUDA, where the compiled activation's forward and backward graphs differ)
3. what forward keeps for backward (counted with saved_tensors_hooks): never a stacked weight copy;
   with the activation recomputed exactly fc1's input with its bias column, fc1's output, the
   probabilities and the offsets, at least fc2's whole input less than without
4. a whole one-layer MoE model at expert-parallel size 2 (gloo, megatron-core's all-gather token
   dispatcher): logits and every gradient, grouped vs sequential experts
"""

import functools

import pytest
import torch

from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err

HIDDEN, FFN, EXPERTS, TOKENS = 32, 24, 4, 40
BF16_TOL = 2e-2


# megatron-core's recompute settings per case (moe_act under selective needs --moe-grouped-gemm)
RECOMPUTE = {
    None: {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True),
    "block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
                  recompute_modules=["moe_act"]),
}


def _config(ep=1, recompute=None):
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**RECOMPUTE[recompute],num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                             moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=2,
                             expert_model_parallel_size=ep, moe_token_dispatcher_type="allgather",
                             moe_router_load_balancing_type="none", gated_linear_unit=True, activation_func=quick_gelu,
                             glu_linear_offset=1.0, activation_func_clamp_value=7.0, bias_activation_fusion=False,
                             add_bias_linear=True, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                             bf16=True, init_method_std=0.5, hidden_dropout=0.0, attention_dropout=0.0)


def _experts_pair(device, recompute=None):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_kd.models.experts import ExpertRowParallelLinear, GroupedGemmExperts

    config = _config(recompute=recompute)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=ExpertRowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    sequential = SequentialMLP(EXPERTS, _config(), submodules, pg_collection=pgs).to(device)
    grouped = GroupedGemmExperts(EXPERTS, config, submodules, pg_collection=pgs).to(device)
    grouped.load_state_dict(sequential.state_dict())
    with torch.no_grad():  # biases of order one and pre-activations that reach the ±7 clamps
        for p in (*sequential.parameters(), *grouped.parameters()):
            p.mul_(8.0)
    return sequential, grouped


COUNTS = [11, 0, 25, TOKENS - 36]  # uneven, one expert without tokens


def _inputs(device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(device, torch.bfloat16)
    probs = torch.rand(TOKENS, generator=g).to(device)
    d_out = torch.randn(TOKENS, HIDDEN, generator=g).to(device, torch.bfloat16)
    return x, probs, d_out


def _run(module, x, probs, d_out):
    """Output and gradients of one forward + backward, and the bytes of each storage that forward
    saved for backward besides the parameters (by storage, so views count once)."""
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_storages:
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dim())
        return t

    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, bias = module(xi, torch.tensor(COUNTS), pi)
    assert bias is None
    out.backward(d_out)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    return (out, xi.grad, pi.grad, grads), list(saved.values())


def _compare_experts(device, seed, recompute=None):
    sequential, grouped = _experts_pair(device, recompute)
    inputs = _inputs(device, seed)
    results = []
    for module in (sequential, grouped):
        (out, gx, gp, grads), _ = _run(module, *inputs)
        results.append((out.float(), gx.float(), gp.float(), {n: g.float() for n, g in grads.items()}))
    (o1, x1, p1, g1), (o2, x2, p2, g2) = results
    assert rel_err(o2, o1) < BF16_TOL and rel_err(x2, x1) < BF16_TOL and rel_err(p2, p1) < BF16_TOL
    assert g1.keys() == g2.keys()
    for name in g1:
        if "local_experts.1." in name:  # the expert without tokens gets zero gradients from both
            assert not g1[name].any() and not g2[name].any(), name
        else:
            assert rel_err(g2[name], g1[name]) < BF16_TOL, name


def _check_recompute_and_saved_bytes(device, seed):
    from megatron_kd.models.experts import bias_column_width

    _, kept = _experts_pair(device)
    _, recomputed = _experts_pair(device, "selective")
    inputs = _inputs(device, seed)
    (out1, *grads1), saved_kept = _run(kept, *inputs)
    (out2, *grads2), saved_recomputed = _run(recomputed, *inputs)
    # eager CPU kernels recompute bitwise; on CUDA the compiled activation runs as an inference graph
    # in forward and a training graph in backward
    same = torch.equal if device.type == "cpu" else (lambda a, b: rel_err(a.float(), b.float()) < 1e-3)
    assert same(out1, out2)
    assert same(grads1[0], grads2[0]) and same(grads1[1], grads2[1])
    assert grads1[2].keys() == grads2[2].keys()
    for name in grads1[2]:
        assert same(grads1[2][name], grads2[2][name]), name

    # the stacked weights ([E, out, in], the only 3-D tensors) are rebuilt in backward, never kept
    assert all(dim < 3 for _, dim in saved_kept + saved_recomputed)
    fc1_in, fc2_in = bias_column_width(HIDDEN, torch.bfloat16), bias_column_width(FFN, torch.bfloat16)
    bf16, fp32, int32 = 2, 4, 4
    exactly = TOKENS * fc1_in * bf16 + TOKENS * 2 * FFN * bf16 + TOKENS * fp32 + EXPERTS * int32
    assert sum(n for n, _ in saved_recomputed) == exactly  # [x | 1], h, probabilities, offsets
    assert sum(n for n, _ in saved_kept) - exactly >= TOKENS * fc2_in * bf16  # [a | p] is not kept


def _experts_worker(rank, world, seed, device):
    from tests.fixtures.dist_utils import init_tensor_parallel

    def checks(device):
        for recompute in RECOMPUTE:
            _compare_experts(device, seed, recompute)
        _check_recompute_and_saved_bytes(device, seed)

    if device == "cuda":
        init_tensor_parallel(1)
        checks(torch.device("cuda"))
        return
    with megatron_cpu_patches():
        init_tensor_parallel(1)
        checks(torch.device("cpu"))


def test_grouped_experts_equal_sequential_cpu_bf16(seed):
    spawn(_experts_worker, seed, "cpu", world_size=1)


@pytest.mark.cuda
def test_grouped_experts_equal_sequential_cuda(seed):
    spawn(_experts_worker, seed, "cuda", world_size=1, backend="nccl")


def _model(spec_experts):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from megatron_kd.models.gpt import gpt_layer_spec

    config = _config(ep=torch.distributed.get_world_size())
    spec = gpt_layer_spec(config, use_te=False)
    moe = spec.submodules.mlp.keywords["submodules"]
    if spec_experts is not None:
        moe.experts = functools.partial(spec_experts, submodules=moe.experts.keywords["submodules"])
    torch.manual_seed(0)  # same weights on both models; experts differ per EP rank (model-parallel RNG)
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=16, position_embedding_type="learned_absolute")
    return Float16Module(config, model)  # bf16 throughout, as megatron.training wraps it


def _ep_worker(rank, world, seed):
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP

    with megatron_cpu_patches():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        models = [_model(None), _model(SequentialMLP)]
        models[1].load_state_dict(models[0].state_dict())
        assert type(models[0].module.decoder.layers[0].mlp.experts).__name__ == "GroupedGemmExperts"
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed + rank))
        results = []
        for model in models:
            logits = model(tokens, torch.arange(16).expand(2, 16), None)
            logits.float().pow(2).mean().backward()
            results.append((logits.float(), {n: p.grad.float() for n, p in model.named_parameters()
                                             if p.grad is not None}))
        (l1, g1), (l2, g2) = results
        assert rel_err(l1, l2) < BF16_TOL
        assert g1.keys() == g2.keys() and any("local_experts" in n for n in g1)
        for name in g1:
            assert rel_err(g1[name], g2[name]) < BF16_TOL, name


def test_grouped_experts_expert_parallel_2(seed):
    spawn(_ep_worker, seed, world_size=2)
