"""Teacher pass: cost of top-K extraction next to the teacher's forward pass (one CUDA device).

    python -m benchmarks.bench_teacher_topk [--layers 24] [--seq-length 8192] [--topk 100]
    python -m benchmarks.bench_teacher_topk --model 120b-rank --chunk-sizes 0 --pass-samples 6,12 \
        --codecs topk-v2 --no-inline

``--model dense`` (the default): a GPT-OSS-20B-width dense teacher (h = 2880, GQA 64/8 heads, FFN
4h, V = 201,088, bf16, local spec with SDPA attention). ``--model 120b-rank``: one rank of the
GPT-OSS-120B teacher's 8-GPU node (examples/gpt_oss/120b.sh's architecture through ``megatron-kd
train``'s model builder: 36 layers, windows and sinks, top-4 routing) holding its 16 of the 128
experts, expert parallelism 1: with top-4 routing over them it computes the expert FLOPs of all its
tokens, as a rank of EP = 8 does, without the all-to-all (``--layers`` / ``--seq-length`` default to
36 / 32,768 there). Random weights: neither speed nor memory depends on them.

The teacher runs forward on one sequence; we time (a) the forward up to the final hidden states,
(b) ``vocab_parallel_topk`` of those states (projection + top-K + logsumexp, chunked), (c) the bare
bf16 projection hidden·Wᵀ that any teacher forward pays for its logits. Overhead of extraction =
(b - c) / (a + c): what the cache adds over a forward that yields logits. The same for
``vocab_parallel_sample`` (``--topk`` draws per token) with each of ``--sample-impls``, and the
share of rows two implementations draw alike.

``--pass-samples N`` also times the whole teacher pass over N samples of random tokens written
to a temporary cache, for each of ``--codecs`` (sampled-counts-v1 in sampled mode, K draws per
token): ``capture_teacher`` (stores behind the forward, on ``--workers`` threads) and the same steps
with each micro-batch written inline (``CacheWriter.write``), each against N x (a + c). A pass
shorter than a few shards pays the last shard's compression after the last forward: at 8192 x
100 a shard holds 13 samples, so --pass-samples 8 is one shard written at the end. Two or more
lengths (``--pass-samples 52,104``) also give each pass's marginal cost between them: (t(N2) -
t(N1)) over N2 - N1 logits forwards, what every sample of a long pass costs once the fixed part
(the first forward's start, the last shard's compression) is paid. With ``--answer-fraction F``
each pass runs once more with chat data's loss mask (``CaptureConfig.masked``: the top-K or the
draws only at the answer tokens): answer spans alternate with prompt spans, lengths drawn from
exponentials of mean ``--span-tokens`` x F (answer) and x (1 - F) (prompt). ``--profile-pass``
runs the shortest pass once more per codec under torch's profiler: how much of it the GPU spends
busy, what over the logits forwards, and which kernels take it.

``--store-rate 1,2,4`` needs no GPU: it stores ``--store-samples`` synthetic samples (ids of
Zipf-like gaps, Student-t log-probs holding 0.9 of the mass; sampled rows draw K tokens from them)
through ``WriteBehind`` with each number of workers, and prints tokens/s and tokens per
CPU-second of the store alone (encoded beforehand, as a GPU pass encodes on its device) per codec:
how far the pool scales on the machine's cores.

    python -m benchmarks.bench_teacher_topk --store-rate 1,2,4,8,16 --store-samples 32
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common.cuda_timing import cuda_median_ms as median_ms
from benchmarks.common.teacher_pass import _writer_of, time_teacher_pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("dense", "120b-rank"), default="dense")
    p.add_argument("--layers", type=int, default=None, help="default: 24 (dense), 36 (120b-rank)")
    p.add_argument("--seq-length", type=int, default=None, help="default: 8192 (dense), 32768 (120b-rank)")
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--chunk-sizes", default="0,512,1024,2048", help="0 = automatic")
    p.add_argument("--sample-impls", default="torch,triton",
                   help="also time vocab_parallel_sample (--topk draws) with each implementation ('' for none)")
    p.add_argument("--breakdown", action="store_true", help="also time the steps of one 2048-token chunk")
    p.add_argument("--pass-samples", default="", metavar="N1[,N2,...]",
                   help="also time a whole teacher pass over N samples (each N; two or more: the marginal cost)")
    p.add_argument("--answer-fraction", type=float, default=None,
                   help="--pass-samples once more with a chat loss mask keeping this fraction of the tokens")
    p.add_argument("--span-tokens", type=int, default=400, help="mean tokens of a prompt + answer pair (--answer-fraction)")
    p.add_argument("--codecs", default="topk-v2,topk-v3,sampled-counts-v1",
                   help="the cache codecs of --pass-samples and --store-rate")
    p.add_argument("--workers", default=None, metavar="W1,W2,...",
                   help="store workers of --pass-samples, one pass each (default: write_behind.default_workers())")
    p.add_argument("--no-inline", action="store_true", help="--pass-samples without the inline pass")
    p.add_argument("--profile-pass", action="store_true",
                   help="--pass-samples: once more per codec (the shortest pass, stores behind) under torch's "
                        "profiler: the GPU's busy and idle time and its kernels by time")
    p.add_argument("--switch-intervals", default=None, metavar="S1,S2,...",
                   help="the interpreter's GIL switch interval (s) of each --pass-samples pass behind (default: "
                        "the process's, Python's 0.005)")
    p.add_argument("--store-rate", default=None, metavar="W1,W2,...",
                   help="CPU only: the store rate of synthetic rows with each number of workers, then exit")
    p.add_argument("--store-samples", type=int, default=32, help="samples per --store-rate measurement")
    p.add_argument("--rows-per-shard", type=int, default=None, help="of --store-rate (default: the writer's)")
    args = p.parse_args()
    if args.store_rate:
        args.seq_length = args.seq_length or 8192
        return store_rate(args)
    if args.answer_fraction is not None and not 0 < args.answer_fraction < 1:
        p.error(f"--answer-fraction must be in (0, 1), got {args.answer_fraction}")
    rank = args.model == "120b-rank"
    args.layers = args.layers or (36 if rank else 24)
    args.seq_length = args.seq_length or (32768 if rank else 8192)
    args.pass_samples = [int(n) for n in args.pass_samples.split(",") if n]

    from megatron_kd.distributed import init_process_group
    init_process_group("nccl")
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_kd.ops.teacher import sample_row_keys, vocab_parallel_sample, vocab_parallel_topk
    from megatron_kd.teacher.sources import _hidden_and_weight

    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(0)
    h, vocab, s = 2880, 201_088, args.seq_length
    model = (gpt_oss_rank_teacher if args.model == "120b-rank" else dense_teacher)(args, vocab).cuda().eval()
    print(f"{args.model} teacher: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    tokens = torch.randint(0, vocab, (1, s), device="cuda")
    pos = torch.arange(s, device="cuda")[None]

    with torch.no_grad():
        def forward():
            return model(tokens, pos, None, output_processor=_hidden_and_weight)

        hidden, weight = forward()
        t_fwd = median_ms(forward)
        t_proj = median_ms(lambda: hidden.view(-1, h) @ weight.t())
        # the fp32 reference on the first REFERENCE_TOKENS (all of 32K x 201,088 in fp32 is 24.5 GiB)
        ref = torch.log_softmax(torch.mm(hidden.view(-1, h)[:REFERENCE_TOKENS], weight.t(), out_dtype=torch.float32), -1)
        ref_lp = ref.topk(args.topk, -1).values
        del ref
        print(f"layers {args.layers}, h {h}, V {vocab}, {s} tokens, K {args.topk}, bf16")
        print(f"teacher forward to hidden states  {t_fwd:8.1f} ms")
        print(f"bare projection hidden @ W^T       {t_proj:8.1f} ms")
        for chunk in map(int, args.chunk_sizes.split(",")):
            run = lambda: vocab_parallel_topk(hidden, weight, args.topk, chunk_size=chunk or None)  # noqa: E731
            t_topk = median_ms(run)
            _, lps = run()
            err = (lps.view(-1, args.topk)[:REFERENCE_TOKENS] - ref_lp).abs().max().item()  # sorted values: robust to ties
            overhead = (t_topk - t_proj) / (t_fwd + t_proj)
            print(f"vocab_parallel_topk chunk {chunk or 'auto':>5}  {t_topk:8.1f} ms  overhead over a logits forward "
                  f"{100 * overhead:5.1f}%  max |logprob - fp32 reference| {err:.1e}")
        keys = sample_row_keys(0, torch.zeros(1, dtype=torch.int64, device="cuda"), s)  # [s, 1]: hidden's [s, b]
        draws = {}
        for impl in filter(None, args.sample_impls.split(",")):
            run = lambda: vocab_parallel_sample(hidden, weight, args.topk, row_keys=keys, impl=impl)  # noqa: E731
            t_sample = median_ms(run)
            draws[impl] = run()
            overhead = (t_sample - t_proj) / (t_fwd + t_proj)
            print(f"vocab_parallel_sample {impl:>6} {args.topk} draws  {t_sample:8.1f} ms  overhead over a logits "
                  f"forward {100 * overhead:5.1f}%")
        if len(draws) == 2:
            (ids_a, lps_a), (ids_b, lps_b) = draws.values()
            same = ((ids_a == ids_b).all(-1) & (lps_a == lps_b).all(-1)).float().mean().item()
            print(f"  rows drawn alike by {' and '.join(draws)}: {100 * same:.3f}%")
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


def dense_teacher(args, vocab: int):
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    h = 2880
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=64, num_query_groups=8,
                            kv_channels=64, ffn_hidden_size=4 * h, bf16=True, params_dtype=torch.bfloat16,
                            normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
                            add_bias_linear=False, persist_layer_norm=False)
    return build_gpt_model(cfg, vocab_size=vocab, max_sequence_length=args.seq_length, use_te=False)


REFERENCE_TOKENS = 8192
RANK_EXPERTS = 128 // 8  # the 120B teacher's experts on one rank of its 8-GPU node (EP = 8)


def gpt_oss_rank_teacher(args, vocab: int):
    """examples/gpt_oss/120b.sh's teacher as one rank of its node holds it (module docstring)."""
    from benchmarks.common.gpt_oss import LOCAL_SPEC_FLAGS
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.models.gpt import gpt_model_from_args
    from tests.fixtures.tiny_gpt_oss import recipe_flags

    flags = [*recipe_flags("120b", layout=False), "--num-layers", str(args.layers), "--num-experts", str(RANK_EXPERTS),
             "--expert-model-parallel-size", "1", "--seq-length", str(args.seq_length), "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(vocab), *LOCAL_SPEC_FLAGS, "--bf16", "--lr", "1e-5"]
    args_ = parse_megatron_args(flags)
    return gpt_model_from_args(args_).bfloat16()


def synthetic_rows(n: int, seq: int, k: int, vocab: int, *, sampled: bool, seed: int = 0):
    """(ids int64, logprobs float32) [n, seq, K] in a random order per token, as a teacher pass hands
    them over: K distinct ids per token from Zipf-like gaps (small ones common) below ``vocab``,
    Student-t (v = 10) logits x 2 holding 0.9 of the mass; ``sampled``: K draws from those (distinct
    ids with log(count / K), then padding)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = n * seq
    gaps = 1 + (torch.rand(tokens, k, generator=gen).pow(3) * (2 * vocab / k)).long()
    ids = torch.minimum(gaps.cumsum(-1), vocab - k + torch.arange(k))  # ascending, below vocab
    ids = torch.maximum(ids, torch.cat([ids[:, :1], ids[:, :-1] + 1], 1))  # distinct where the cap bit
    logits = torch.distributions.StudentT(10.0).sample((tokens, k)) * 2
    lps = torch.log_softmax(logits, -1) + float(np.log(0.9))
    if sampled:
        picks = torch.multinomial(lps.exp(), k, replacement=True, generator=gen)
        counts = torch.zeros(tokens, k).scatter_add_(1, picks, torch.ones(tokens, k))
        lps = torch.where(counts > 0, torch.log(counts / k), float("-inf"))
        ids = torch.where(counts > 0, ids, -1)
    order = torch.argsort(torch.rand(tokens, k, generator=gen), -1)
    return torch.gather(ids, 1, order).view(n, seq, k), torch.gather(lps, 1, order).view(n, seq, k)


def store_rate(args) -> None:
    """Tokens/s of WriteBehind's stores (CPU) against the number of workers, per codec."""
    import tempfile
    import time

    from megatron_kd.cache.encodings import SAMPLED_COUNTS_V1
    from megatron_kd.cache.write_behind import WriteBehind

    n, s, k, vocab = args.store_samples, args.seq_length, args.topk, 201_088
    counts = [int(w) for w in args.store_rate.split(",")]
    print(f"store rate of {n} x {s} tokens, K {k}, V {vocab}; {len(os.sched_getaffinity(0))} CPU cores")
    for codec in args.codecs.split(","):
        ids, lps = synthetic_rows(n, s, k, vocab, sampled=codec == SAMPLED_COUNTS_V1)
        tokens = torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(0))  # the ids read
        base = None
        for workers in counts:
            with tempfile.TemporaryDirectory() as tmp:
                writer = _writer_of(codec, f"{tmp}/cache", vocab=vocab, k=k, seq=s, n=n,
                                    rows_per_shard=args.rows_per_shard)
                # as the GPU hands them over
                encoded = [writer.encode(i, ids[i], lps[i], tokens=tokens[i]) for i in range(n)]
                wall, cpu = time.perf_counter(), time.process_time()
                with WriteBehind(writer, workers=workers) as behind:
                    for e in encoded:
                        behind.submit_encoded(e)
                writer.close()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rate = n * s / wall
            base = base or rate
            print(f"  {codec:17} {workers:3} workers  {rate / 1e6:6.3f} M tokens/s  x{rate / base:4.1f}  "
                  f"{n * s / cpu / 1e6:6.3f} M tokens per CPU-second  ({writer.shard_rows} rows per shard)",
                  flush=True)


if __name__ == "__main__":
    main()
