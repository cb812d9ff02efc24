"""GPT-OSS students without Transformer Engine at 32K tokens: step time, memory, TFLOP/s, layers.

    python -m benchmarks.bench_gptoss --layers 4 --out results.json                 # one GPU
    torchrun --nproc-per-node 2 -m benchmarks.bench_gptoss --layers 4 --ep 2       # two GPUs, EP=2
    python -m benchmarks.bench_gptoss --tiny                                        # CPU smoke run

The model is examples/gpt_oss's 20B recipe at its real width (hidden 2880, 64/8 heads, 32
experts top-4, vocabulary 201,088, window 128 on even layers, sinks, YaRN) with the depth cut to
``--layers``, built by ``megatron-kd train``'s own code (Megatron-LM's parser on the recipe flags,
``gpt_model_from_args``, Megatron's DDP with fp32 ``main_grad``, bf16) and stepped by its own
forward step (``KDForwardStep``) on one micro-batch of ``--seq`` tokens per GPU. Each loss is timed
as forward + backward of one micro-batch (no optimizer step):

  ce        Megatron's own output layer + vocab-parallel cross-entropy (no teacher)
  fused-ce  the same cross-entropy through the fused op (``--kd-ce-impl fused``, no teacher)
  fused  fused top-K KD (K = 100, ghost tail; teacher-like synthetic cache rows)
  dense  the same KD loss on materialized logits (``--kd-impl dense``)

Model FLOPs per step count the matmuls of forward and backward (3x forward): attention
projections, scores and values (causal half on full layers, 128 keys on window layers), router,
the top-k experts, and the logits. ``--layer-bench`` also times, at the same shapes, one
attention layer fwd+bwd per implementation and the experts grouped vs sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common.gpt_oss import model_flags, model_flops


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (= the number of processes)")
    p.add_argument("--losses", default="ce,fused-ce,fused,dense")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layer-bench", action="store_true")
    p.add_argument("--profile-experts", action="store_true", help="print the kernel breakdown of the grouped experts")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def teacher_rows(seq: int, vocab: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-like top-K rows (heavy-tailed logits, top-1 p ~ 0.5), made on the device in chunks."""
    ids, lps = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for start in range(0, seq, 2048):
        rows = min(2048, seq - start)
        logits = torch.randn(rows, vocab, device=device, generator=gen) * 2.0
        logits = logits / torch.sqrt(torch.distributions.Chi2(torch.tensor(10.0, device=device))
                                     .sample((rows, vocab)) / 10.0)
        lp, idx = torch.log_softmax(logits, -1).topk(k, -1)
        ids.append(idx.int())
        lps.append(lp.float())
    return torch.cat(ids), torch.cat(lps)


def step_stats(model, forward_step, batch, steps: int, device) -> dict:
    def one():
        output, loss_fn = forward_step(iter([batch]), model)
        loss = loss_fn(output)[0]
        loss.backward()
        return float(loss)

    one()  # warm-up: compiles flex attention for these shapes
    model.zero_grad_buffer()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad_buffer()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"step_s": sorted(times)[len(times) // 2], "peak_gib": peak}


def attention_bench(args, seq: int, device) -> dict:
    from benchmarks.common.cuda_timing import cuda_median_ms
    from megatron_kd.models.attention import core_attention

    n, g, d = args.num_attention_heads, args.num_query_groups, args.kv_channels
    out = {}
    q, k, v = (torch.randn(seq, 1, heads, d, device=device, dtype=torch.bfloat16).permute(1, 2, 0, 3)
               .requires_grad_() for heads in (n, g, g))
    sink = torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True)
    d_out = torch.randn(1, n, seq, d, device=device, dtype=torch.bfloat16)
    cases = {"sdpa causal, no sinks": ("sdpa", None, None), "cudnn causal + sinks": ("cudnn", None, sink),
             "flex causal + sinks": ("flex", None, sink), "flex window 128 + sinks": ("flex", (127, 0), sink)}
    for name, (impl, window, s) in cases.items():
        def run(impl=impl, window=window, s=s):
            core_attention(q, k, v, scale=d ** -0.5, window=window, sink=s, impl=impl).backward(d_out)
        out[f"attention fwd+bwd ms: {name}"] = cuda_median_ms(run, reps=5)
    return out


def experts_bench(args, seq: int, device, profile: bool = False) -> dict:
    from benchmarks.common.cuda_timing import cuda_median_ms
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_kd.models.experts import ExpertRowParallelLinear, GroupedGemmExperts
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_kd.models.gpt import correct_config

    out = {}
    config = correct_config(core_transformer_config_from_args(args))
    experts = args.num_experts // args.expert_model_parallel_size
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=ExpertRowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    tokens = seq * args.moe_router_topk
    counts = torch.distributions.Multinomial(tokens, torch.ones(experts)).sample().long()
    x = torch.randn(tokens, args.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device=device)
    d_x = torch.randn_like(x)
    for name, cls in (("grouped", GroupedGemmExperts), ("sequential", SequentialMLP)):
        module = cls(experts, config, sub, pg_collection=pgs).to(device)

        def run(module=module):
            module(x, counts, probs)[0].backward(d_x)
        out[f"experts fwd+bwd ms: {name} ({experts} experts, {tokens} routed tokens)"] = cuda_median_ms(run, reps=5)
        if profile and name == "grouped":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
        del module
    return out


def main():
    opts = parse()
    if opts.tiny:
        opts.seq, opts.layers, opts.steps = 64, 2, 1
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cuda = torch.cuda.is_available() and not opts.tiny
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from megatron_kd.distributed import init_process_group
    init_process_group("nccl" if cuda else "gloo")
    if cuda:
        run(opts, device)
    else:  # the smoke run: megatron-core on the CPU through the test harness's patches
        from tests.fixtures.dist_utils import megatron_cpu_patches

        with megatron_cpu_patches():
            run(opts, device)
    torch.distributed.destroy_process_group()


def run(opts, device):
    cuda = device.type == "cuda"
    rank = torch.distributed.get_rank()

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.loss import KDForwardStep
    from megatron_kd.models.gpt import gpt_model_from_args

    args = parse_megatron_args(model_flags(opts))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=opts.ep, expert_tensor_parallel_size=1)
    if cuda:
        model_parallel_cuda_manual_seed(1234)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.distributed.get_world_size(),
               "layers": opts.layers, "seq": opts.seq, "ep": opts.ep}
    if opts.layer_bench and cuda:
        results["layers_ms"] = {**attention_bench(args, opts.seq, device), **experts_bench(args, opts.seq, device, opts.profile_experts)}

    module = gpt_model_from_args(args)
    if cuda:
        module = module.to(device)
    config = module.config
    # bf16 training accumulates and reduces gradients in fp32 (Megatron-LM forces it for --bf16)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    Float16Module(config, module))
    params = sum(p.numel() for p in module.parameters())
    flops = model_flops(args, opts.seq)
    results.update(parameters_per_rank=params, model_tflop_per_step_per_gpu=flops / 1e12)

    vocab = 201088 if not opts.tiny else 1000
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (1, opts.seq), generator=gen)
    ids, lps = teacher_rows(opts.seq, vocab, 100 if not opts.tiny else 8, device)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(1, opts.seq),
             "position_ids": torch.arange(opts.seq).unsqueeze(0),
             "teacher_ids": ids.unsqueeze(0), "teacher_logprobs": lps.unsqueeze(0)}
    for loss in opts.losses.split(","):
        config = KDConfig(impl="dense" if loss == "dense" else "fused", tail="ghost",
                          ce_impl="fused" if loss == "fused-ce" else "megatron")
        step = KDForwardStep(config, device=device)
        with_teacher = loss in ("fused", "dense")
        run_batch = {k: v for k, v in batch.items() if with_teacher or not k.startswith("teacher")}
        try:
            stats = step_stats(model, step, run_batch, opts.steps, device)
            stats["model_tflops_per_gpu"] = flops / stats["step_s"] / 1e12
        except torch.OutOfMemoryError as e:
            stats = {"oom": str(e).split("\n")[0][:200]}
            model.zero_grad_buffer()
            torch.cuda.empty_cache()
        results[loss] = stats
        if rank == 0:
            print(f"{loss:8s} {json.dumps(stats)}", flush=True)
    if rank == 0:
        print(json.dumps(results, indent=2))
        if opts.out:
            Path(opts.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
