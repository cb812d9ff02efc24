"""Time one ``--kd-optimizer bf16-sr-8bit`` step (``Bf16Adam``) over a GPT-OSS rank's parameters.

    python -m benchmarks.bench_optimizer_step --size 20b --impls torch,triton     # one H200
    python -m benchmarks.bench_optimizer_step --size 120b --impls triton

The tensors are the ones one rank of the 8-GPU node updates (``--rank-of 8`` in bench_node.py: the
local experts' fc1 / fc2 weights and biases as megatron-core's SequentialMLP names them, one tensor
each; attention, router, norms and both embeddings whole, as the unsharded dense state of the
one-GPU emulation), bf16 weights with bf16 gradients, 8-bit moments: 20B 4.19B parameters in 603
tensors, 120B 16.5B in 2,631. Reported per implementation: the median of ``--steps`` timed steps
after ``--warmup`` (CUDA events around ``step()``), and the memory traffic the step needs at the
least (10 bytes per element: read weight, gradient and both codes, write weight and codes) over
that time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from megatron_kd.optim import Bf16Adam

HIDDEN, FFN, VOCAB, QKV_OUT, PROJ_IN = 2880, 2880, 201088, (64 + 2 * 8) * 64, 64 * 64
SIZES = {"20b": dict(layers=24, local_experts=4, experts=32), "120b": dict(layers=36, local_experts=16, experts=128)}
BYTES_PER_ELEMENT = 10


def rank_shapes(layers: int, local_experts: int, experts: int) -> list[tuple[int, ...]]:
    shapes = [(VOCAB, HIDDEN), (VOCAB, HIDDEN), (HIDDEN,)]  # embedding, output layer, final norm
    for _ in range(layers):
        shapes += [(HIDDEN,), (QKV_OUT, HIDDEN), (QKV_OUT,), (HIDDEN, PROJ_IN), (HIDDEN,), (64,),  # attention, sinks
                   (HIDDEN,), (experts, HIDDEN), (experts,)]  # pre-MLP norm, router
        for _ in range(local_experts):
            shapes += [(2 * FFN, HIDDEN), (2 * FFN,), (HIDDEN, FFN), (HIDDEN,)]
    return shapes


def time_steps(impl: str, shapes, steps: int, warmup: int) -> list[float]:
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02))
        p.grad = torch.empty_like(p).normal_(0, 1e-3)
        params.append(p)
    opt = Bf16Adam(params, lr=1e-5, weight_decay=0.1, impl=impl)
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    del opt, params
    torch.cuda.empty_cache()
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="20b")
    parser.add_argument("--impls", default="triton", help="comma-separated: torch, triton")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation, state allocation)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    opts = parser.parse_args(argv)
    shapes = rank_shapes(**SIZES[opts.size])
    elements = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    for impl in opts.impls.split(","):
        times = time_steps(impl, shapes, opts.steps, opts.warmup)
        seconds = statistics.median(times)
        rows.append(dict(size=opts.size, impl=impl, tensors=len(shapes), parameters=elements, seconds=seconds,
                         times=times, least_bytes_gb_per_s=BYTES_PER_ELEMENT * elements / seconds / 1e9))
        print(f"{opts.size} {impl}: {len(shapes)} tensors, {elements / 1e9:.2f}B parameters, "
              f"step {seconds * 1e3:.1f} ms (median of {len(times)}), "
              f"{rows[-1]['least_bytes_gb_per_s']:.0f} GB/s of the least traffic", flush=True)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        results = dict(device=torch.cuda.get_device_name(), rows=rows)
        (opts.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
