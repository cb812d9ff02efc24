"""Speed and memory of the output-layer distillation loss, forward + backward, on one CUDA device.

Every (method, shape) runs in a fresh process so peak-memory numbers do not leak between runs.

    python benchmarks/bench_loss.py                                  # all methods x shapes
    python benchmarks/bench_loss.py --methods floor,ours --shapes gptoss-32k --out results.csv

Methods:
    floor          the three bf16 GEMMs alone (logits, grad_hidden, grad_weight): the physical floor
    dense          topk_kl_reference: full fp32 logits, autograd (what a materializing loss does)
    ours           fused_topk_kl, impl="torch", weight grad into a fresh fp32 accumulator
    ours-main-grad fused_topk_kl with gradient_accumulation_fusion into an fp32 main_grad (Megatron DDP)

Reported: median ms of forward+backward, TFLOP/s counted as 6·T·h·V, peak memory, and peak minus
the memory of inputs + gradients (hidden, weight, teacher ids/logprobs, their gradients).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_median_ms  # noqa: E402

SHAPES = {  # name: (tokens, hidden, vocab_local)
    "h4096-v64k-8k": (8192, 4096, 65536),
    "h4096-v64k-32k": (32768, 4096, 65536),
    "gptoss-32k": (32768, 2880, 201088),
}
METHODS = ("floor", "dense", "ours", "ours-main-grad")
TOPK = 100
GiB = 2**30


def _inputs(tokens, hidden, vocab, device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(vocab, hidden, device=device, generator=g) / hidden**0.5).bfloat16()
    ids = torch.randint(0, vocab, (tokens, TOPK), device=device, generator=g)
    # teacher-like: the K entries hold ~90% of the mass
    lps = torch.log_softmax(torch.randn(tokens, TOPK, device=device, generator=g) * 2, -1) + torch.log(
        torch.tensor(0.9, device=device)
    )
    return h, w, ids, lps


def _step_fn(method, h, w, ids, lps):
    import torch

    from megatron_kd.ops import fused_topk_kl, topk_kl_reference

    hp = h.requires_grad_()
    wp = torch.nn.Parameter(w)
    grad_bytes = hp.numel() * 2 + wp.numel() * 2
    if method == "floor":
        def step():
            logits = hp.detach() @ wp.detach().t()
            gh = logits @ wp.detach()
            gw = logits.t() @ hp.detach()
            return gh, gw
    elif method in ("ours", "dense"):
        fn = fused_topk_kl if method == "ours" else topk_kl_reference

        def step():
            hp.grad = wp.grad = None
            loss, _ = fn(hp, wp, ids, lps, impl="torch") if method == "ours" else fn(hp, wp, ids, lps)
            loss.backward()
            return loss
    elif method == "ours-main-grad":
        wp.main_grad = torch.zeros(wp.shape, dtype=torch.float32, device=wp.device)
        wp.grad_added_to_main_grad = False
        grad_bytes = hp.numel() * 2 + wp.main_grad.numel() * 4

        def step():
            hp.grad = wp.grad = None
            loss, _ = fused_topk_kl(hp, wp, ids, lps, gradient_accumulation_fusion=True)
            loss.backward()
            return loss
    else:
        raise ValueError(method)
    return step, grad_bytes


def run_one(method, shape, reps):
    import torch

    tokens, hidden, vocab = SHAPES[shape]
    dev = torch.device("cuda")
    h, w, ids, lps = _inputs(tokens, hidden, vocab, dev)
    input_bytes = sum(t.numel() * t.element_size() for t in (h, w, ids, lps))
    step, grad_bytes = _step_fn(method, h, w, ids, lps)
    result = dict(method=method, shape=shape, tokens=tokens, hidden=hidden, vocab=vocab)
    try:
        step()  # warm-up (allocator, cuBLAS handles)
        h.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = cuda_median_ms(step, reps=reps, warmup=0)
    except torch.OutOfMemoryError:
        result.update(status="OOM")
        return result
    result.update(
        status="ok", ms=ms, tflops=6 * tokens * hidden * vocab / ms / 1e9, peak_gib=peak / GiB,
        over_inputs_grads_gib=(peak - input_bytes - grad_bytes) / GiB,
        inputs_grads_gib=(input_bytes + grad_bytes) / GiB,
    )
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None, help="CSV file for the results")
    p.add_argument("--one", nargs=2, metavar=("METHOD", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.reps)))
        return

    rows = []
    for shape in args.shapes.split(","):
        for method in args.methods.split(","):
            proc = subprocess.run(
                [sys.executable, __file__, "--one", method, shape, "--reps", str(args.reps)],
                capture_output=True, text=True,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else dict(method=method, shape=shape, status="error")
            if not lines:
                print(proc.stderr[-3000:], file=sys.stderr)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        keys = sorted({k for r in rows for k in r})
        with args.out.open("w", newline="") as f:
            csv.DictWriter(f, keys).writeheader()
            csv.DictWriter(f, keys).writerows(rows)
    print(f"\n{'shape':16} {'method':15} {'ms':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'over in+grad GiB':>17}")
    for r in rows:
        if r.get("status") == "ok":
            print(f"{r['shape']:16} {r['method']:15} {r['ms']:9.1f} {r['tflops']:8.0f} {r['peak_gib']:9.2f} "
                  f"{r['over_inputs_grads_gib']:17.2f}")
        else:
            print(f"{r['shape']:16} {r['method']:15} {r.get('status')}")


if __name__ == "__main__":
    main()
