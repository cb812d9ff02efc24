"""Teacher pass: cost of top-K extraction next to the teacher's forward pass (one CUDA device).

    python benchmarks/bench_teacher_topk.py [--layers 24] [--seq-length 8192] [--topk 100]

A GPT-OSS-20B-width dense teacher (h = 2880, GQA 64/8 heads, FFN 4h, V = 201,088, bf16, local
spec with SDPA attention) runs forward on one sequence; we time (a) the forward up to the final
hidden states, (b) ``vocab_parallel_topk`` of those states (projection + top-K + logsumexp,
chunked), (c) the bare bf16 projection hidden·Wᵀ that any teacher forward pays for its logits.
Overhead of extraction = (b - c) / (a + c): what the cache adds over a forward that yields logits.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_median_ms as median_ms  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--chunk-sizes", default="0,512,1024,2048", help="0 = automatic")
    p.add_argument("--breakdown", action="store_true", help="also time the steps of one 2048-token chunk")
    args = p.parse_args()

    from megatron_kd.distributed import init_process_group
    init_process_group("nccl")
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model
    from megatron_kd.ops.topk import vocab_parallel_topk
    from megatron_kd.teacher.sources import _hidden_and_weight

    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(0)
    h, vocab, s = 2880, 201_088, args.seq_length
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=64, num_query_groups=8,
                            kv_channels=64, ffn_hidden_size=4 * h, bf16=True, params_dtype=torch.bfloat16,
                            normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
                            add_bias_linear=False, persist_layer_norm=False)
    model = build_gpt_model(cfg, vocab_size=vocab, max_sequence_length=s, use_te=False).cuda().eval()
    tokens = torch.randint(0, vocab, (1, s), device="cuda")
    pos = torch.arange(s, device="cuda")[None]

    with torch.no_grad():
        def forward():
            return model(tokens, pos, None, output_processor=_hidden_and_weight)

        hidden, weight = forward()
        t_fwd = median_ms(forward)
        t_proj = median_ms(lambda: hidden.view(-1, h) @ weight.t())
        ref = torch.log_softmax(torch.mm(hidden.view(-1, h), weight.t(), out_dtype=torch.float32), -1)
        ref_lp = ref.topk(args.topk, -1).values
        del ref
        print(f"layers {args.layers}, h {h}, V {vocab}, {s} tokens, K {args.topk}, bf16")
        print(f"teacher forward to hidden states  {t_fwd:8.1f} ms")
        print(f"bare projection hidden @ W^T       {t_proj:8.1f} ms")
        for chunk in map(int, args.chunk_sizes.split(",")):
            run = lambda: vocab_parallel_topk(hidden, weight, args.topk, chunk_size=chunk or None)  # noqa: E731
            t_topk = median_ms(run)
            _, lps = run()
            err = (lps.view(-1, args.topk) - ref_lp).abs().max().item()  # sorted values: robust to ties
            overhead = (t_topk - t_proj) / (t_fwd + t_proj)
            print(f"vocab_parallel_topk chunk {chunk or 'auto':>5}  {t_topk:8.1f} ms  overhead over a logits forward "
                  f"{100 * overhead:5.1f}%  max |logprob - fp32 reference| {err:.1e}")
        if args.breakdown:  # per 2048-token chunk; x4 for the whole sequence
            hc = hidden.view(-1, h)[:2048]
            z = torch.mm(hc, weight.t(), out_dtype=torch.float32)
            zb = z.bfloat16()
            steps = {
                "gemm fp32 out": lambda: torch.mm(hc, weight.t(), out_dtype=torch.float32),
                "topk fp32": lambda: z.topk(args.topk, -1),
                "topk bf16": lambda: zb.topk(args.topk, -1),
                "topk fp32 sorted=False": lambda: z.topk(args.topk, -1, sorted=False),
                "amax": lambda: z.amax(-1),
                "exp-sum (logsumexp)": lambda: torch.logsumexp(z, -1),
            }
            for name, fn in steps.items():
                print(f"  chunk step {name:24} {median_ms(fn):7.2f} ms")


if __name__ == "__main__":
    main()
