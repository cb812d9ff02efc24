"""GPT-OSS's core attention at long context on one GPU: every path of models/attention.py that takes
the layer, forward and forward + backward, with the sink's gradient.

    python -m benchmarks.bench_attention --out runs/attention            # H200, ~1 min
    python -m benchmarks.bench_attention --seq 131072 --heads 24 --groups 8 --no-sink --out runs/a128k

The layers are GPT-OSS-20B's at one rank of the 8-GPU node: 64 query heads over 8 key/value groups of
head dim 64, bf16, b = 1, in megatron's [s, b, heads, d] memory as CoreAttention passes it. Two
layers: full causal with a sink per head, and the 128-key window with sinks. Each impl runs where
``core_attention`` accepts it (flash4 only with flash-attn-4 on an SM90 / SM100 GPU).

FLOPs (the convention of FlashAttention's benchmarks): forward 4·s·keys·d·heads with keys the mean
number of keys a query sees (s/2 + 1/2 causal, at most the window), backward 2.5× forward. The
rate is against the GPU's dense bf16 peak (``--peak-tflops``, 989 for the H200 SXM). Each impl's
output and gradients are compared with the first impl's (relative error; the fp32 references of
the equality tests, tests/models/test_attention.py, do not fit at 32K).
Written to ``--out``: attention.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.common.cuda_timing import cuda_median_ms
from megatron_kd.models.attention import core_attention, flash4_available

LAYERS = {"full": None, "window": (127, 0)}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-sink", action="store_true", help="plain causal attention (Llama's layers)")
    p.add_argument("--layers", default="full,window", help="of: " + ",".join(LAYERS))
    p.add_argument("--impls", default="cudnn,flash4,flex", help="in order; the first is the others' yardstick")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def mean_keys(s: int, window) -> float:
    """Keys a query sees on average under causal attention, within ``window`` (left, 0) if given."""
    reach = s if window is None else window[0] + 1  # the most keys one query sees
    n = min(s, reach)  # the first n queries see 1 … n keys, the rest ``reach`` each
    return (n * (n + 1) / 2 + (s - n) * reach) / s


def runs_on(impl: str, window, sink: bool) -> bool:
    if impl == "flash4":
        return flash4_available(torch.device("cuda"))
    if impl == "cudnn":
        return window is None
    if impl == "sdpa":
        return window is None and not sink
    return True


def measure(opts, layer: str, impl: str, inputs, d_out):
    window = LAYERS[layer]
    q, k, v, sink = inputs

    def forward():
        return core_attention(q, k, v, scale=opts.head_dim ** -0.5, window=window, sink=sink, impl=impl)

    def step():
        out = forward()
        out.backward(d_out)
        return out

    for t in inputs:
        if t is not None:
            t.grad = None
    out = step()
    grads = [None if t is None else t.grad.detach().clone() for t in inputs]
    fwd_ms = cuda_median_ms(lambda: forward(), opts.reps)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step_ms = cuda_median_ms(step, opts.reps)
    flops = 4 * opts.seq * mean_keys(opts.seq, window) * opts.head_dim * opts.heads
    bwd_ms = step_ms - fwd_ms
    return out.detach(), grads, {
        "forward_ms": fwd_ms, "backward_ms": bwd_ms, "step_ms": step_ms,
        "forward_tflops": flops / fwd_ms / 1e9, "backward_tflops": 2.5 * flops / bwd_ms / 1e9,
        "step_tflops": 3.5 * flops / step_ms / 1e9, "step_of_peak": 3.5 * flops / step_ms / 1e9 / opts.peak_tflops,
        "peak_gib_above_inputs": (torch.cuda.max_memory_allocated() - before) / 2**30}


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None):
    opts = parse(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    opts.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    # megatron's [s, b, heads, d], viewed as core_attention's [b, heads, s, d]
    q, k, v = (torch.randn(opts.seq, 1, n, opts.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
               .permute(1, 2, 0, 3).requires_grad_() for n in (opts.heads, opts.groups, opts.groups))
    sink = None if opts.no_sink else torch.randn(opts.heads, device="cuda", generator=g,
                                                 dtype=torch.bfloat16).requires_grad_()
    d_out = torch.randn(1, opts.heads, opts.seq, opts.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "seq": opts.seq, "heads": opts.heads, "groups": opts.groups,
               "head_dim": opts.head_dim, "sink": sink is not None, "peak_tflops": opts.peak_tflops, "layers": {}}
    for layer in opts.layers.split(","):
        rows, yardstick = {}, None
        for impl in opts.impls.split(","):
            if not runs_on(impl, LAYERS[layer], sink is not None):
                continue
            out, grads, row = measure(opts, layer, impl, (q, k, v, sink), d_out)
            if yardstick is None:
                yardstick = (impl, out, grads)
            else:
                row["vs"] = yardstick[0]
                for name, ours, ref in zip(("out", "dq", "dk", "dv", "dsink"), (out, *grads), (yardstick[1],
                                                                                              *yardstick[2])):
                    if ours is not None:
                        row[f"rel_err_{name}"] = rel_err(ours, ref)
            rows[impl] = row
            print(layer, impl, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
        results["layers"][layer] = rows
    (opts.out / "attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
