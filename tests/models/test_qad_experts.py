"""Quantization-aware distillation on megatron_kd's grouped experts (``--kd-quant``).

1. with ``weight_quant`` set, the grouped experts compute exactly what the same experts compute
   with their weights replaced by the quantized ones (``bake_quantized_experts``): output, the input
   and probability gradients bitwise; every weight gradient bitwise equal to the gradient of the
   quantized weight (straight through); biases untouched; for MXFP4 and NVFP4, with and without the
   activation recomputed (bf16 on CPU, where grouped_mm has a backward); fp32 weights under bf16
   autocast compute what bf16 weights compute
2. experts that would take the sequential loop (fp32 on CPU) refuse in one line rather than train
   unquantized
3. the flag check refuses ``--kd-quant`` in one line for a model without experts and for expert
   tensor parallelism
"""

import pytest
import torch

from megatron_kd.errors import FlagError
from megatron_kd.megatron.flags import check_megatron_flags
from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.models import test_experts
from tests.models.test_experts import COUNTS, _experts_pair, _inputs, _run


def _worker(rank, world, seed):
    from megatron_kd.models.experts import bake_quantized_experts, quantize_experts
    from megatron_kd.ops.quant import fake_quantize
    from tests.fixtures.dist_utils import init_tensor_parallel

    cpu = torch.device("cpu")
    # the experts of test_experts.py at widths FP4's blocks divide (32 inputs for MXFP4); this
    # process is the spawned worker's own
    test_experts.HIDDEN, test_experts.FFN = 64, 96
    with megatron_cpu_patches():
        init_tensor_parallel(1)
        for fmt in ("mxfp4", "nvfp4"):
            for recompute in (None, "selective"):
                _, quantized = _experts_pair(cpu, recompute)
                _, baked = _experts_pair(cpu, recompute)
                masters = {n: p.detach().clone() for n, p in quantized.named_parameters()}
                assert quantize_experts(quantized, fmt) == 1
                baked.weight_quant = fmt
                bake_quantized_experts(baked)
                baked.weight_quant = None
                for name, p in baked.named_parameters():
                    want = fake_quantize(masters[name], fmt) if name.endswith("weight") else masters[name]
                    assert torch.equal(p, want), name
                inputs = _inputs(cpu, seed)
                (out_q, gx_q, gp_q, grads_q), _ = _run(quantized, *inputs)
                (out_b, gx_b, gp_b, grads_b), _ = _run(baked, *inputs)
                case = f"{fmt}, recompute {recompute}"
                assert torch.equal(out_q, out_b) and torch.equal(gx_q, gx_b) and torch.equal(gp_q, gp_b), case
                for name, p in quantized.named_parameters():  # the optimizer's weights are untouched
                    assert torch.equal(p, masters[name]), (case, name)
                    assert torch.equal(grads_q[name], grads_b[name]), (case, name)
                assert not torch.equal(out_q, _run(_experts_pair(cpu, recompute)[1], *inputs)[0][0]), case

        # fp32 weights under bf16 autocast (mixed precision without Megatron's bf16 copy): grouped_mm has
        # no autocast rule, so the experts cast as autocast casts mm; they compute what bf16 weights compute
        # and the fp32 weights get the same gradients
        for fmt in (None, "mxfp4"):
            (_, bf16), (_, mixed) = _experts_pair(cpu), _experts_pair(cpu)  # one seed: the same weights
            mixed.float()
            bf16.weight_quant = mixed.weight_quant = fmt
            inputs = _inputs(cpu, seed)
            (out_b, gx_b, gp_b, grads_b), _ = _run(bf16, *inputs)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                (out_m, gx_m, gp_m, grads_m), _ = _run(mixed, *inputs)
            assert out_m.dtype == torch.bfloat16 and torch.equal(out_m, out_b), fmt
            assert torch.equal(gx_m, gx_b) and torch.equal(gp_m, gp_b), fmt
            for name, grad in grads_m.items():
                assert grad.dtype == torch.float32 and torch.equal(grad, grads_b[name].float()), (fmt, name)

        _, fp32 = _experts_pair(cpu)
        fp32.float().weight_quant = "mxfp4"
        x, probs, _ = _inputs(cpu, seed)
        with pytest.raises(ValueError, match="runs on the grouped path only"):
            fp32(x.float(), torch.tensor(COUNTS), probs)


def test_quantized_experts_are_the_baked_ones_with_straight_through_gradients(seed):
    spawn(_worker, seed, world_size=1)


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--train-iters", "1", "--global-batch-size", "2", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion"]


@pytest.mark.parametrize("extra, message", [
    ([], "this model has none"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size above 1"),
])
def test_kd_quant_is_refused_where_it_cannot_apply(extra, message):
    with pytest.raises(FlagError, match=f"^--kd-quant mxfp4 fake-quantizes megatron_kd's grouped MoE experts.*{message}"):
        check_megatron_flags([*MODEL, *extra, "--kd-quant", "mxfp4"])
    check_megatron_flags([*MODEL, "--num-experts", "4", "--kd-quant", "nvfp4"])
