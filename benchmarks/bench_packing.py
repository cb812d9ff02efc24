"""Attention over packed documents at 32K tokens on one GPU: forward + backward, masked vs not.

    python -m benchmarks.bench_packing --out packing.json [--seq 32768] [--reps 10] [--commit HASH]

GPT-OSS-20B's attention shape (64 query / 8 KV heads of dimension 64, bf16, one sample of --seq
tokens laid out as CoreAttention receives it) for its two kinds of layer: window (128 keys) +
sinks, and full causal + sinks. Documents: one per sample (no packing: today's paths, the
baseline of each kind), or packed documents with lengths drawn from an exponential distribution
of mean 2K and 8K tokens (``--means``; the sample's end cuts the last one). Candidates:

  window  flex    unpacked: today's window block mask; packed: ``_causal_block_mask`` with the documents
          varlen  flash's variable-length kernels, window native (``_VarlenAttention``)
  full    cudnn   unpacked only: ``_CudnnSinkAttention``, today's default
          flex    causal + document block mask, sinks through its LSE (what "auto" runs packed)
          varlen  flash's variable-length kernels, sinks folded in as for cuDNN
          cudnn-ragged  cuDNN's SDPA with ragged offsets (aten ``_cudnn_attention_forward`` with
                  cu_seqlens, K/V repeated to the query heads) and the same sink fold: defined here
                  only, a candidate torch 2.11 keeps switched off in its own ``varlen_attn``

Each row: the median of ``--reps`` forward + backward passes after warm-up (the first compiles
flex), peak memory above the inputs, and for packed rows the relative difference (Frobenius) of
the output and of dq from packed flex, whose exactness tests/models/test_packing_cuda.py checks.
A candidate that fails prints its error instead. A last row times what a micro-batch pays once
for all its layers: the documents from the tokens and the block masks of both kinds of layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
from pathlib import Path

import torch

HEADS, GROUPS, HEAD_DIM, WINDOW = 64, 8, 64, (127, 0)
EOD = 1


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--means", default="2048,8192", help="mean document lengths of the packed rows")
    p.add_argument("--layers", default="window,full")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="", help="the commit measured (recorded in the JSON)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args()


def document_lengths(seq: int, mean: float | None, seed: int) -> list[int]:
    """Exponential lengths of ``mean`` tokens filling ``seq`` (the last one cut); [seq] for None."""
    if mean is None:
        return [seq]
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(max(1, round(rng.expovariate(1 / mean))))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def tokens_of(lengths: list[int]) -> torch.Tensor:
    tokens = torch.full((1, sum(lengths)), 5, dtype=torch.int64, device="cuda")
    tokens[0, torch.tensor(lengths, device="cuda").cumsum(0) - 1] = EOD
    return tokens


def causal_work(lengths: list[int], window: tuple[int, int] | None) -> float:
    """Visible (query, key) pairs as a fraction of the unpacked layer's."""
    def pairs(n):
        if window is None:
            return n * (n + 1) / 2
        w = window[0] + 1
        return sum(min(i + 1, w) for i in range(n)) if n <= w else w * (w + 1) / 2 + (n - w) * w
    return sum(pairs(n) for n in lengths) / pairs(sum(lengths))


class RaggedCudnnSink(torch.autograd.Function):
    """Candidate: cuDNN's ragged SDPA over the documents, the sink folded in as ``_CudnnSinkAttention``
    does. q [T, heads, d], k / v [T, groups, d]; cuDNN takes equal head counts."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens, longest, scale):
        t, n, d = q.shape
        r = n // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_seqlens, cu_seqlens, longest, longest, True, 0.0, True, False, scale=scale)
        # the layout of its log-sum-exp is not documented: per head then token, or per token then head
        if lse.shape[:2] == (n, t):
            ctx.sink_shape = (n, 1, *([1] * (lse.dim() - 2)))
            ctx.to_tokens = lambda x: x.reshape(n, t).t()  # -> [T, heads]
        elif lse.shape[:2] == (t, n):
            ctx.sink_shape = (1, n, *([1] * (lse.dim() - 2)))
            ctx.to_tokens = lambda x: x.reshape(t, n)
        else:
            raise RuntimeError(f"cuDNN ragged log-sum-exp of shape {tuple(lse.shape)} for {t} tokens x {n} heads")
        lse_sink = torch.logaddexp(lse, sink.float().view(ctx.sink_shape))
        out_sink = (out.float() * ctx.to_tokens(torch.exp(lse - lse_sink)).unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, out_sink, lse_sink, sink, seed, offset, cum_q, cum_k)
        ctx.scale, ctx.max_q, ctx.max_k, ctx.r = scale, max_q, max_k, r
        return out_sink

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out_sink, lse_sink, sink, seed, offset, cum_q, cum_k = ctx.saved_tensors
        d_out = torch.empty_like(out_sink).copy_(d_out)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            d_out, q, k, v, out_sink, lse_sink, seed, offset, None, cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, True,
            scale=ctx.scale)
        t, n, d = q.shape
        dk = dk.view(t, n // ctx.r, ctx.r, d).sum(2)
        dv = dv.view(t, n // ctx.r, ctx.r, d).sum(2)
        rowsum = (d_out.float() * out_sink.float()).sum(-1)  # D' [T, heads]
        p_sink = ctx.to_tokens(torch.exp(sink.float().view(ctx.sink_shape) - lse_sink))
        d_sink = -(p_sink * rowsum).sum(0).to(sink.dtype)
        return dq, dk, dv, d_sink, None, None, None


def ragged_cudnn(q, k, v, *, scale, sink, documents):
    b, n, s, d = q.shape
    cu_seqlens, longest = documents.varlen()
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    return RaggedCudnnSink.apply(*flat, sink, cu_seqlens, longest, scale).view(b, s, n, d).transpose(1, 2)


def candidates(layer: str, packed: bool) -> list[str]:
    if layer == "window":
        return ["flex", "varlen"] if packed else ["flex"]
    return ["flex", "varlen", "cudnn-ragged"] if packed else ["cudnn"]


def run_attention(impl, inputs, window, documents):
    from megatron_kd.models.attention import core_attention

    q, k, v, sink = inputs
    if impl == "cudnn-ragged":
        return ragged_cudnn(q, k, v, scale=0.125, sink=sink, documents=documents)
    return core_attention(q, k, v, scale=0.125, window=window, sink=sink, impl=impl, documents=documents)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(opts) -> list[dict]:
    from benchmarks.common.cuda_timing import cuda_median_ms
    from megatron_kd.models.attention import _causal_block_mask
    from megatron_kd.models.documents import Documents

    s = opts.seq
    g = torch.Generator(device="cuda").manual_seed(opts.seed)
    q, k, v = (torch.randn(s, 1, n, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16).permute(1, 2, 0, 3)
               for n in (HEADS, GROUPS, GROUPS))
    sink = torch.randn(HEADS, device="cuda", generator=g, dtype=torch.bfloat16)
    d_out = torch.randn(1, HEADS, s, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
    means = [None] + [float(m) for m in opts.means.split(",") if m]
    rows, baseline = [], {}
    for layer in opts.layers.split(","):
        window = WINDOW if layer == "window" else None
        for mean in means:
            lengths = document_lengths(s, mean, opts.seed)
            documents = Documents.from_tokens(tokens_of(lengths), EOD) if mean is not None else None
            reference = None
            for impl in candidates(layer, mean is not None):
                row = {"layer": layer, "mean_document": mean, "documents": len(lengths),
                       "work": causal_work(lengths, window), "impl": impl}

                def step():
                    for t in leaves:
                        t.grad = None
                    out = run_attention(impl, leaves, window, documents)
                    out.backward(d_out)
                    return out

                try:
                    out = step()
                    result = [out.detach()] + [leaves[0].grad.detach().clone()]
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    row["ms"] = cuda_median_ms(step, reps=opts.reps)
                    row["peak_mib"] = (torch.cuda.max_memory_allocated() - held) / 2**20
                except Exception as e:  # noqa: BLE001 - a candidate's failure is a result
                    row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    rows.append(row)
                    print(row, flush=True)
                    continue
                if mean is None:
                    baseline[layer] = row["ms"]
                elif impl == "flex":
                    reference = result
                elif reference is not None:
                    row["diff_out"], row["diff_dq"] = rel(result[0], reference[0]), rel(result[1], reference[1])
                row["x_unpacked"] = row["ms"] / baseline[layer] if layer in baseline else None
                rows.append(row)
                print(row, flush=True)
    # once per micro-batch, for every layer: the documents and the block masks of both kinds of layer
    tokens = tokens_of(document_lengths(s, float(means[-1] or s), opts.seed))

    def per_batch():
        documents = Documents.from_tokens(tokens, EOD)
        for window in (WINDOW, None):
            _causal_block_mask(documents.starts.shape[1], window, starts=documents.starts)

    rows.append({"layer": "per micro-batch", "impl": "documents + block masks", "ms": cuda_median_ms(per_batch)})
    return rows


def table(rows) -> str:
    head = "| layer | mean doc | docs | pairs vs unpacked | impl | fwd+bwd ms | x unpacked | peak MiB | Δout | Δdq |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fmt = lambda key, f: (f.format(r[key]) if r.get(key) is not None else "")  # noqa: E731
        if "error" in r:
            lines.append(f"| {r['layer']} | {fmt('mean_document', '{:.0f}') or '-'} | {r.get('documents', '')} | "
                         f"{fmt('work', '{:.3f}')} | {r['impl']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['layer']} | {fmt('mean_document', '{:.0f}') or '-'} | {r.get('documents', '')} | "
                     f"{fmt('work', '{:.3f}')} | {r['impl']} | {r['ms']:.2f} | {fmt('x_unpacked', '{:.3f}')} | "
                     f"{fmt('peak_mib', '{:.0f}')} | {fmt('diff_out', '{:.1e}')} | {fmt('diff_dq', '{:.1e}')} |")
    return "\n".join(lines)


def main():
    opts = parse()
    if not torch.cuda.is_available():
        raise SystemExit("bench_packing.py needs a CUDA GPU")
    rows = measure(opts)
    print(table(rows))
    if opts.out:
        record = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "commit": opts.commit, "seq": opts.seq,
                  "shape": {"heads": HEADS, "groups": GROUPS, "head_dim": HEAD_DIM, "window": WINDOW[0] + 1},
                  "reps": opts.reps, "rows": rows}
        Path(opts.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
