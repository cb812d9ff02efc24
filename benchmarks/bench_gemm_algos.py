"""The loss's three per-chunk GEMMs and the floor's three, each against every algorithm cuBLASLt's
heuristic offers for it: does choosing the algorithm ourselves close part of the gap to the floor?

Why: the weight-gradient GEMM into the fp32 main_grad (beta = 1) costs 0.5-0.7 ms more per chunk
than the same product with a bf16 output and no accumulator (benchmarks/RESULTS.md). torch gives no
say in cuBLASLt's algorithm (TunableOp tunes only on ROCm); nvidia's nvmath-python lists cuBLASLt's
candidates and runs any of them, so this measures them all, interleaved with torch's own pick.
The floor's full-length GEMMs are swept the same way: an algorithm choice that also speeds up the
floor does not narrow the ratio.

Needs nvmath-python (not a dependency of megatron_kd: `pip install nvmath-python`) and a GPU.

    python -m benchmarks.bench_gemm_algos                          # GPT-OSS 32K and its TP = 2 shard
    python -m benchmarks.bench_gemm_algos --shapes gptoss-32k-half --no-floor
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common.cuda_timing import cuda_median_ms

HIDDEN = 2880
# shape: (tokens per chunk of the loss's default, local vocabulary)
SHAPES = {"gptoss-32k": (3648, 201088), "gptoss-32k-half": (4736, 100544)}
TOKENS = 32768


def sweep(name, a, b, c, beta, torch_fn, *, limit=8, rounds=3, reps=20):
    """Median ms of torch's GEMM and of each cuBLASLt candidate, interleaved over ``rounds``."""
    from nvmath.linalg.advanced import Matmul, MatmulOptions, MatmulPlanPreferences

    if c is None:
        mm = Matmul(a, b)
    else:  # D = C in place: the accumulator is read and written as cuBLAS's beta = 1 does
        mm = Matmul(a, b, c=c, beta=beta, options=MatmulOptions(inplace=True))
    algos = mm.plan(preferences=MatmulPlanPreferences(limit=limit))
    times = {"torch": []} | {i: [] for i in range(len(algos))}
    for _ in range(rounds):
        times["torch"].append(cuda_median_ms(torch_fn, reps=reps, warmup=2))
        for i, alg in enumerate(algos):
            times[i].append(cuda_median_ms(lambda alg=alg: mm.execute(algorithm=alg), reps=reps, warmup=2))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    best = min(range(len(algos)), key=med.__getitem__)
    alg = algos[best]
    print(f"{name:34s} torch {med['torch']:8.3f} ms | heuristic #0 {med[0]:8.3f} | best #{best} {med[best]:8.3f} "
          f"({med[best] / med['torch'] - 1:+.1%}; tile {alg.tile}, split-k {alg.split_k}) of {len(algos)}",
          flush=True)
    mm.free()


def sweep_shape(shape: str, floor: bool) -> None:
    """The chunk's three GEMMs (and the floor's) at one shape; its tensors die on return."""
    bf16, f32 = torch.bfloat16, torch.float32
    rows, vocab = SHAPES[shape]
    print(f"== {shape}: chunk {rows} x V_local {vocab} x h {HIDDEN}", flush=True)
    g = torch.randn(rows, vocab, device="cuda", dtype=bf16) * 1e-3
    h = torch.randn(rows, HIDDEN, device="cuda", dtype=bf16)
    w = torch.randn(vocab, HIDDEN, device="cuda", dtype=bf16) * 0.02
    main_grad = torch.zeros(vocab, HIDDEN, device="cuda", dtype=f32)
    print(f"{'grad_W, bf16 out, no accumulator':34s} torch {cuda_median_ms(lambda: g.t() @ h, reps=20):8.3f} ms")
    sweep("grad_W into fp32 main_grad", g.t(), h, main_grad, 1.0,
          lambda: torch.addmm(main_grad, g.t(), h, out_dtype=f32, out=main_grad))
    logits = torch.empty(rows, vocab, device="cuda", dtype=bf16)
    sweep("logits, bf16 out", h, w.t(), None, None, lambda: torch.mm(h, w.t(), out=logits))
    grad_h = torch.empty(rows, HIDDEN, device="cuda", dtype=f32)
    sweep("grad_h, fp32 out", g, w, grad_h, 0.0, lambda: torch.mm(g, w, out_dtype=f32, out=grad_h))
    if floor:  # the floor's three GEMMs over all tokens, bf16 out
        h_all = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=bf16)
        z_all = torch.empty(TOKENS, vocab, device="cuda", dtype=bf16)
        sweep("floor logits", h_all, w.t(), None, None, lambda: torch.mm(h_all, w.t(), out=z_all), rounds=2)
        z_all.normal_(std=1e-3)
        sweep("floor grad_h", z_all, w, None, None, lambda: z_all @ w, rounds=2)
        sweep("floor grad_W", z_all.t(), h_all, None, None, lambda: z_all.t() @ h_all, rounds=2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-floor", action="store_true", help="skip the floor's full-length GEMMs")
    args = p.parse_args()
    # Warm the clocks first: medians drift while the GPU heats.
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(400):
        x @ x
    for shape in args.shapes.split(","):
        sweep_shape(shape, floor=not args.no_floor)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
