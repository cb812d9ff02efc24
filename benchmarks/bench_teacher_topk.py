"""Teacher pass: cost of top-K extraction next to the teacher's forward pass (one CUDA device).

    python benchmarks/bench_teacher_topk.py [--layers 24] [--seq-length 8192] [--topk 100]

A GPT-OSS-20B-width dense teacher (h = 2880, GQA 64/8 heads, FFN 4h, V = 201,088, bf16, local
spec with SDPA attention) runs forward on one sequence; we time (a) the forward up to the final
hidden states, (b) ``vocab_parallel_topk`` of those states (projection + top-K + logsumexp,
chunked), (c) the bare bf16 projection hidden·Wᵀ that any teacher forward pays for its logits.
Overhead of extraction = (b - c) / (a + c): what the cache adds over a forward that yields logits.

``--pass-samples N`` also times the whole teacher pass over N samples of random tokens written
to a temporary cache (``--codec``): ``capture_teacher`` (stores behind the forward, on a worker
thread) and the same steps with each micro-batch written inline (``CacheWriter.write``), each
against N x (a + c).
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
    p.add_argument("--pass-samples", type=int, default=0, help="also time a whole teacher pass over N samples")
    p.add_argument("--codec", default="topk-v2", help="the cache codec of --pass-samples")
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


        if args.pass_samples:
            time_teacher_pass(model, args, vocab, logits_forward_ms=t_fwd + t_proj)


def time_teacher_pass(model, args, vocab: int, *, logits_forward_ms: float):
    """The teacher pass end to end (forward, top-K, encode, store) against N logits forwards."""
    import tempfile
    import time

    from megatron_kd.cache import CacheWriter
    from megatron_kd.ops.topk import vocab_parallel_topk
    from megatron_kd.teacher import CaptureConfig, MegatronTeacher, capture_teacher

    n, s = args.pass_samples, args.seq_length
    gen = torch.Generator().manual_seed(0)
    dataset = [{"tokens": torch.randint(0, vocab, (s,), generator=gen), "position_ids": torch.arange(s)}
               for _ in range(n)]
    teacher = MegatronTeacher(model, vocab_size=vocab)
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def writer(path):
        return CacheWriter(path, vocab_size=vocab, topk=args.topk, seq_length=s, num_samples=n, codec=args.codec)

    def inline(w):  # the pass with each micro-batch stored before the next forward
        for i in w.pending_samples():
            x = dataset[int(i)]
            hidden, weight = teacher(x["tokens"][None].to(device), x["position_ids"][None].to(device))
            ids, lps = vocab_parallel_topk(hidden, weight, args.topk, vocab_size=vocab)
            w.write(int(i), ids[:, 0], lps[:, 0])

    def behind(w):
        capture_teacher(teacher, dataset, w, CaptureConfig(topk=args.topk), progress=False)

    with tempfile.TemporaryDirectory() as tmp:  # warm-up
        warm = writer(f"{tmp}/cache")
        inline(warm)
        warm.close()
    floor = n * logits_forward_ms / 1e3
    print(f"teacher pass over {n} x {s} tokens, codec {args.codec}; {n} logits forwards {floor:.2f} s")
    for name, run in (("stores inline", inline), ("stores behind (capture_teacher)", behind)):
        with tempfile.TemporaryDirectory() as tmp:
            w = writer(f"{tmp}/cache")
            sync()
            start = time.perf_counter()
            run(w)
            w.close()
            sync()
            took = time.perf_counter() - start
        print(f"  {name:32} {took:7.2f} s  {n * s / took:10,.0f} tokens/s  overhead over a logits forward "
              f"{100 * (took / floor - 1):5.1f}%")


if __name__ == "__main__":
    main()
