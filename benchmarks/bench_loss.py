"""Speed and memory of the output-layer distillation loss, forward + backward, on CUDA.

Every (method, shape) runs in a fresh process so peak-memory numbers do not leak between runs.
Medians drift by a few percent over a call as the GPU warms, and by ±1% between machines of one
kind, so compare a method with the floor measured in the same call: --rounds N runs every
(shape, method) N times, interleaved, and prints each row's ratio to that round's floor.
Every method except floor and liger-flce computes the same loss: top-K KL, tail="none", τ = 1,
sum over tokens, K = 100, from bf16 hidden [T, h] and weight [V, h], teacher ids [T, K] int64 and
logprobs [T, K] fp32. --divergence times the ours-* methods (and dense) for other divergences too:
each (divergence, tail) is a row of its own, in the same round as the floor.

    python -m benchmarks.bench_loss --check                          # correctness of the KL methods (CPU ok)
    python -m benchmarks.bench_loss                                  # all methods x shapes, one GPU
    python -m benchmarks.bench_loss --methods floor,ours-triton --shapes gptoss-32k --out results.csv
    python -m benchmarks.bench_loss --methods floor,ours-triton-main-grad --shapes gptoss-32k --rounds 3
    python -m benchmarks.bench_loss --methods ours-triton --shapes gptoss-32k --chunk-size 512
    python -m benchmarks.bench_loss --methods floor,ours-triton-main-grad --shapes gptoss-32k \
        --divergence all --rounds 3                                 # forward, reverse, jsd vs the floor
    python -m benchmarks.bench_loss --check --divergence all       # the divergences' correctness too
    python -m benchmarks.bench_loss --tp 2 --shapes gptoss-32k,h4096-v64k-32k
    python -m benchmarks.bench_loss --methods ours-torch,ours-triton,ours-triton-main-grad \\
        --shapes gptoss-32k-half,h4096-v32k-32k                     # the same per-rank V at --tp 1

Methods:
    floor                  the three bf16 GEMMs alone (logits, grad_hidden, grad_weight): the physical floor
    dense                  topk_kl_reference: full fp32 logits, autograd (what a materializing loss does)
    forward-chunked        bf16 logits [T, V] kept; loss per token chunk under torch.utils.checkpoint
    recompute-fused        logits never kept: lse pass, loss pass, backward pass (loss_baselines.py)
    liger-flce             Liger-Kernel fused linear cross-entropy on random labels (CE, not KL), fp32
                           weight-grad accumulation: speed of a tuned fused head ("unavailable" if not
                           importable)
    ours-torch             fused_topk_kl(impl="torch"), weight grad into a fresh fp32 accumulator
    ours-torch-main-grad   the same with gradient_accumulation_fusion into an fp32 main_grad (Megatron DDP)
    ours-triton            fused_topk_kl(impl="triton")
    ours-triton-main-grad  fused_topk_kl(impl="triton", gradient_accumulation_fusion=True)
    megatron-ce            Megatron's own head without TE: bf16 logits GEMM (autograd, as ColumnParallelLinear
                           without gradient-accumulation fusion) + tensor_parallel.vocab_parallel_cross_entropy
                           on random labels (CE, not KL): GPTModel's default loss
    megatron-ce-fused      the same with megatron-core's native fused_vocab_parallel_cross_entropy
                           (--cross-entropy-loss-fusion --cross-entropy-fusion-impl native)
    ours-triton-ce-main-grad  the same cross-entropy through the fused op (kd_weight 0, ce_weight 1, one
                           padded teacher entry per token, main_grad): what ``--kd-ce-impl fused`` runs

Shapes (tokens, hidden, vocab):
    h4096-v64k-8k / -32k / -128k / -256k   8192 / 32768 / 131072 / 262144 tokens, h 4096, V 65536
    gptoss-32k                             32768, 2880, 201088 (GPT-OSS)
    h3072-v128k-8k ... -256k, h4096-...    8K-256K tokens, h 3072 / 4096, V 128,256 (Llama 3 students)
    gptoss-32k-half, h4096-v32k-32k        V halved: the per-rank work of gptoss-32k, h4096-v64k-32k at --tp 2

Flags:
    --chunk-size N   tokens per chunk for ours-*, recompute-fused and forward-chunked (default: each
                     method picks its own; ≤ 256 MiB fp32 logits block for the baselines)
    --tp N           ours-* methods only: N processes (NCCL, one GPU each) on the same tokens, each
                     with its own V/N rows of the weight, tp_group = the world group; the row reports
                     the max over ranks of each rank's median ms and of its peak memory
    --divergence D   comma-separated divergences of ours-* and dense: forward, reverse, jsd, or
                     all (default forward); the other methods compute forward KL only
    --tail T         comma-separated tails (default: none for forward, renorm and ghost for reverse
                     and jsd, which need one of those two); each (divergence, tail) is one row
    --ce-weight W    adds the hard-label cross-entropy on random labels (default 0) to ours-* and
                     dense: with renorm it is what gives reverse / jsd a dense gradient
    --check          runs every KL method on a tiny float32 problem on this machine's device and
                     checks loss and both gradients against topk_kl_reference in float64 (1e-4
                     relative norm error), for each (divergence, tail) the flags name; ours-triton*
                     only on CUDA (or with TRITON_INTERPRET=1)
    --reps N, --out FILE.csv

Reported: median ms of forward+backward, TFLOP/s per GPU counted as 6·T·h·V_local, peak memory,
and peak minus the memory of inputs + gradients (hidden, weight, teacher ids/logprobs, their
gradients; for *-main-grad the weight gradient is the fp32 main_grad).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from benchmarks.common.cuda_timing import cuda_median_ms

SHAPES = {  # name: (tokens, hidden, vocab)
    "h4096-v64k-8k": (8192, 4096, 65536),
    "h4096-v64k-32k": (32768, 4096, 65536),
    "h4096-v64k-128k": (131072, 4096, 65536),
    "h4096-v64k-256k": (262144, 4096, 65536),
    "gptoss-32k": (32768, 2880, 201088),
    # Llama 3's vocabulary at a 3B (h 3072) and an 8B (h 4096) student's width
    **{f"h{h}-v128k-{n}k": (n * 1024, h, 128256) for h in (3072, 4096) for n in (8, 32, 64, 128, 256)},
    "gptoss-32k-half": (32768, 2880, 100544),
    "h4096-v32k-32k": (32768, 4096, 32768),
}
KL_METHODS = (
    "dense", "forward-chunked", "recompute-fused",
    "ours-torch", "ours-torch-main-grad", "ours-triton", "ours-triton-main-grad",
)
CE_METHODS = ("megatron-ce", "megatron-ce-fused", "ours-triton-ce-main-grad")
METHODS = ("floor", *KL_METHODS[:3], "liger-flce", *KL_METHODS[3:], *CE_METHODS)
TP_METHODS = tuple(m for m in METHODS if m.startswith(("ours-", "megatron-")))
TOPK = 100
GiB = 2**30
DIVERGENCES = ("forward", "reverse", "jsd")
DEFAULT_TAILS = {"forward": ("none",), "reverse": ("renorm", "ghost"), "jsd": ("renorm", "ghost")}
# methods that take any (divergence, tail); the others compute forward KL with tail none only
LOSS_METHODS = ("dense", "ours-torch", "ours-torch-main-grad", "ours-triton", "ours-triton-main-grad")


@dataclass(frozen=True)
class Loss:
    """The KD loss a row times: divergence, tail and the CE weight (random labels when > 0)."""

    divergence: str = "forward"
    tail: str = "none"
    ce_weight: float = 0.0

    def kwargs(self, labels) -> dict:
        out = dict(divergence=self.divergence, tail=self.tail)
        if self.ce_weight:
            out.update(labels=labels, ce_weight=self.ce_weight)
        return out


def loss_variants(divergences: str, tails: str | None, ce_weight: float) -> list[Loss]:
    """Every (divergence, tail) the flags name; reverse / jsd skip tail none (they need renorm or ghost)."""
    names = DIVERGENCES if divergences == "all" else tuple(divergences.split(","))
    bad = [d for d in names if d not in DIVERGENCES]
    if bad:
        raise SystemExit(f"--divergence: {bad[0]!r} is not one of {', '.join(DIVERGENCES)} or all")
    out = []
    for d in names:
        for tail in (tails.split(",") if tails else DEFAULT_TAILS[d]):
            if d == "forward" or tail != "none":
                out.append(Loss(d, tail, ce_weight))
    return out


class Unavailable(Exception):
    pass


def _inputs(tokens, hidden, vocab, device, *, topk=TOPK, dtype=None, tp=1, rank=0):
    """hidden, this rank's weight rows [vocab/tp, hidden], global teacher ids and logprobs."""
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)  # same tokens on every rank
    h = torch.randn(tokens, hidden, device=device, generator=g).to(dtype)
    ids = torch.randint(0, vocab, (tokens, topk), device=device, generator=g)
    # teacher-like: the K entries hold ~90% of the mass
    lps = torch.log_softmax(torch.randn(tokens, topk, device=device, generator=g) * 2, -1) + torch.log(
        torch.tensor(0.9, device=device)
    )
    gw = torch.Generator(device=device).manual_seed(1 + rank)
    w = (torch.randn(vocab // tp, hidden, device=device, generator=gw) / hidden**0.5).to(dtype)
    return h, w, ids, lps


def _leaves(h, w, method):
    """Leaf hidden and weight parameter; *-main-grad weights carry Megatron DDP's fp32 main_grad."""
    import torch

    hp, wp = h.requires_grad_(), torch.nn.Parameter(w)
    if method.endswith("-main-grad"):
        wp.main_grad = torch.zeros(wp.shape, dtype=torch.float32, device=wp.device)
        wp.grad_added_to_main_grad = False
    return hp, wp


def _kl_fn(method, chunk_size, tp_group, loss: Loss, labels):
    """(hidden, weight, ids, logprobs) -> loss, for the KL methods."""
    from benchmarks.common import loss_baselines
    from megatron_kd.ops import fused_topk_kl, topk_kl_reference

    if method not in LOSS_METHODS and loss != Loss():
        raise Unavailable(f"{method} computes forward KL with tail none only")
    if method == "dense":
        return lambda *args: topk_kl_reference(*args, **loss.kwargs(labels))[0]
    if method == "forward-chunked":
        return partial(loss_baselines.forward_chunked_kl, chunk_size=chunk_size)
    if method == "recompute-fused":
        return partial(loss_baselines.recompute_fused_kl, chunk_size=chunk_size)
    if method.startswith("ours-"):
        kwargs = dict(impl=method.split("-")[1], chunk_size=chunk_size, tp_group=tp_group,
                      gradient_accumulation_fusion=method.endswith("-main-grad"), **loss.kwargs(labels))
        return lambda *args: fused_topk_kl(*args, **kwargs)[0]
    raise ValueError(method)


def _ce_fn(method, labels, tp_group):
    """(hidden, weight, ids, logprobs) -> summed cross-entropy on ``labels`` (the teacher is unused)."""
    import torch

    if method == "ours-triton-ce-main-grad":
        from megatron_kd.ops import fused_topk_kl

        def fused(h, w, _ids, _lps):
            no_teacher = torch.full((h.shape[0], 1), -1, dtype=torch.int32, device=h.device)
            no_lps = torch.full((h.shape[0], 1), float("-inf"), device=h.device)
            return fused_topk_kl(h, w, no_teacher, no_lps, labels=labels, kd_weight=0.0, ce_weight=1.0, tail="none",
                                 impl="triton", tp_group=tp_group, gradient_accumulation_fusion=True)[0]
        return fused
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    if tp_group is None:  # megatron-core's cross-entropy always all-reduces over its group
        tp_group = _single_rank_group()

    def megatron(h, w, _ids, _lps):
        logits = (h @ w.t()).unsqueeze(1)  # [s, b=1, V_local], bf16, as the output layer returns it
        target = labels.unsqueeze(1)
        if method == "megatron-ce-fused":
            return fused_vocab_parallel_cross_entropy(logits, target, tp_group).sum()
        return vocab_parallel_cross_entropy(logits, target, tp_group=tp_group).sum()
    return megatron


def _single_rank_group():
    import torch
    import torch.distributed as dist

    from megatron_kd.distributed import init_process_group
    init_process_group("nccl", device=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD


def _labels(hp, wp, tp_group):
    """Random hard labels over the global vocabulary, the same on every rank."""
    import torch

    g = torch.Generator(device=hp.device).manual_seed(2)
    vocab = wp.shape[0] * (1 if tp_group is None else torch.distributed.get_world_size(tp_group))
    return torch.randint(0, vocab, (hp.shape[0],), device=hp.device, generator=g)


def _step_fn(method, hp, wp, ids, lps, chunk_size=None, tp_group=None, loss=Loss()):
    """One forward+backward of ``method``, and the bytes of the gradients it leaves."""
    import torch

    wgrad = getattr(wp, "main_grad", wp)
    grad_bytes = hp.numel() * hp.element_size() + wgrad.numel() * wgrad.element_size()
    if method == "floor":
        h, w = hp.detach(), wp.detach()

        def step():
            logits = h @ w.t()
            return logits @ w, logits.t() @ h
        return step, grad_bytes

    if method in CE_METHODS:
        loss_fn = _ce_fn(method, _labels(hp, wp, tp_group), tp_group)
    elif method == "liger-flce":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except Exception as e:  # not installed, or no Triton/GPU to import it with
            raise Unavailable(f"{type(e).__name__}: {e}") from e
        g = torch.Generator(device=hp.device).manual_seed(2)
        labels = torch.randint(0, wp.shape[0], (hp.shape[0],), device=hp.device, generator=g)

        def loss_fn(h, w, _ids, _lps):
            return liger_fused_linear_cross_entropy(h, w, labels, reduction="sum", accum_dtype=torch.float32)
    else:
        loss_fn = _kl_fn(method, chunk_size, tp_group, loss, _labels(hp, wp, tp_group) if loss.ce_weight else None)

    def step():
        hp.grad = wp.grad = None
        loss = loss_fn(hp, wp, ids, lps)
        loss.backward()
        return loss
    return step, grad_bytes


def _measure(method, tokens, hidden, vocab, reps, chunk_size, loss, device, tp_group=None, tp=1, rank=0):
    import torch

    h, w, ids, lps = _inputs(tokens, hidden, vocab, device, tp=tp, rank=rank)
    input_bytes = sum(t.numel() * t.element_size() for t in (h, w, ids, lps))
    hp, wp = _leaves(h, w, method)
    try:
        step, grad_bytes = _step_fn(method, hp, wp, ids, lps, chunk_size, tp_group, loss)
    except Unavailable as e:
        return dict(status="unavailable", error=str(e))
    try:
        step()  # warm-up (allocator, cuBLAS handles, Triton autotuning)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = cuda_median_ms(step, reps=reps, warmup=0)
        if os.environ.get("BENCH_LOSS_PROFILE") and rank == 0:
            _print_kernel_profile(step)
    except torch.OutOfMemoryError:
        return dict(status="OOM")
    return dict(
        status="ok", ms=ms, tflops=6 * tokens * hidden * (vocab // tp) / ms / 1e9, peak_gib=peak / GiB,
        over_inputs_grads_gib=(peak - input_bytes - grad_bytes) / GiB,
        inputs_grads_gib=(input_bytes + grad_bytes) / GiB,
    )


def _print_kernel_profile(step, rows=14, steps=3):
    """CUDA time per kernel name over one step (stderr): where the milliseconds above the floor go.
    Then ``steps`` steps back to back, timed by events as the benchmark times them, against the
    kernels' busy time: a step slower than its kernels means time outside them (per-step host work)
    or kernels slower under sustained load than alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60),
          file=sys.stderr)
    print(_idle_report(prof.events()), file=sys.stderr)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    print(f"{steps} steps back to back: {start.elapsed_time(end) / steps:.2f} ms per step by events; kernels: "
          + _idle_report(prof.events(), top=3).replace("\n", "\n  "), file=sys.stderr)


def _idle_report(events, top=8) -> str:
    """GPU busy vs idle between the step's first and last kernel, and the longest idle gaps with the
    kernels on either side: time that no kernel table shows."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not kernels:
        return "no kernels recorded"
    gaps, busy, end, last = [], 0.0, kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, last, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    span = end - kernels[0][0]
    lines = [f"GPU span {span / 1e3:.2f} ms: busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms "
             f"in {len(gaps)} gaps; longest:"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:8.3f} ms  after {before[:50]}  before {after[:50]}")
    return "\n".join(lines)


def _tp_rank(rank, tp, port, results, *args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=tp, device_id=device)
    row = _measure(*args, device, dist.group.WORLD, tp, rank)
    results.put(dict(row, rank=rank))  # SimpleQueue: written before put returns
    if row["status"] != "ok":
        # Peers may wait in a collective forever; a rank exiting with an error makes spawn end them.
        os._exit(1)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_tp(method, tokens, hidden, vocab, reps, chunk_size, loss, tp):
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    results = mp.get_context("spawn").SimpleQueue()
    args = (tp, _free_port(), results, method, tokens, hidden, vocab, reps, chunk_size, loss)
    failure = None
    try:
        mp.spawn(_tp_rank, args=args, nprocs=tp)
    except ProcessException as e:
        failure = e
    ranks = []
    while not results.empty():
        ranks.append(results.get())
    ranks.sort(key=lambda r: r["rank"])
    bad = [r for r in ranks if r["status"] != "ok"]
    if bad:  # OOM or unavailable on some rank: that is the row's result
        return {k: v for k, v in bad[0].items() if k != "rank"}
    if failure is not None or len(ranks) != tp:
        raise RuntimeError(f"tp={tp} run failed") from failure
    ms = max(r["ms"] for r in ranks)
    return dict(
        status="ok", ms=ms, tflops=6 * tokens * hidden * (vocab // tp) / ms / 1e9,
        peak_gib=max(r["peak_gib"] for r in ranks),
        over_inputs_grads_gib=max(r["over_inputs_grads_gib"] for r in ranks),
        inputs_grads_gib=ranks[0]["inputs_grads_gib"], ms_per_rank=[round(r["ms"], 3) for r in ranks],
    )


def run_one(method, shape, reps, chunk_size=None, tp=1, loss=Loss()):
    import torch

    tokens, hidden, vocab = SHAPES[shape]
    row = dict(method=method, shape=shape, tokens=tokens, hidden=hidden, vocab=vocab,
               vocab_local=vocab // tp, tp=tp, chunk_size=chunk_size, **asdict(loss))
    if tp == 1:
        row.update(_measure(method, tokens, hidden, vocab, reps, chunk_size, loss, torch.device("cuda")))
    elif method not in TP_METHODS:
        row.update(status=f"unsupported at tp>1 (only {', '.join(TP_METHODS)})")
    else:
        assert vocab % tp == 0, f"vocab {vocab} of {shape} does not split over tp={tp}"
        row.update(_run_tp(method, tokens, hidden, vocab, reps, chunk_size, loss, tp))
    return row


def check(chunk_size=None, tol=1e-4, losses=(Loss(),)):
    """Loss, grad_hidden and grad_weight of every KL method against the float64 reference, for each
    of ``losses`` the method computes."""
    import torch

    from megatron_kd.ops import topk_kl_reference

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, w, ids, lps = _inputs(64, 32, 256, dev, topk=8, dtype=torch.float32)
    triton_ok = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    failed = []
    for loss_spec in losses:
        ref_h, ref_w = h.double().requires_grad_(), w.double().requires_grad_()
        ref, _ = topk_kl_reference(ref_h, ref_w, ids, lps, **loss_spec.kwargs(_labels(ref_h, ref_w, None)))
        ref.backward()
        ref = ref.detach()
        name = f"{loss_spec.divergence}/{loss_spec.tail}" + (f"/ce{loss_spec.ce_weight:g}" if loss_spec.ce_weight else "")
        for method in KL_METHODS:
            if method not in LOSS_METHODS and loss_spec != Loss():
                continue
            if "triton" in method and not triton_ok:
                print(f"check {name:16} {method:22} skipped (no CUDA)")
                continue
            hp, wp = _leaves(h.clone(), w.clone(), method)
            # 24 tokens by default: several chunks and a ragged last one
            step, _ = _step_fn(method, hp, wp, ids, lps, chunk_size=chunk_size or 24, loss=loss_spec)
            loss = step()
            pairs = (("loss", loss, ref), ("grad_hidden", hp.grad, ref_h.grad),
                     ("grad_weight", getattr(wp, "main_grad", wp.grad), ref_w.grad))
            errs = {n: float((x.detach().double() - r).norm() / r.norm()) for n, x, r in pairs}
            ok = all(e <= tol for e in errs.values())
            failed += [] if ok else [f"{method} ({name})"]
            print(f"check {name:16} {method:22} " + "  ".join(f"{k} {v:.1e}" for k, v in errs.items())
                  + ("  ok" if ok else "  FAIL"))
    if failed:
        raise SystemExit(f"check failed (relative error > {tol}): {', '.join(failed)}")


def kernel_sweep(shape: str, chunk: int, configs: str):
    """Time the two per-row Triton passes of one chunk for (BLOCK_V, num_warps) configs; HBM GB/s.
    Each timed call starts from a copy of its input block (the passes work in place); the copy's own
    time is measured alone and subtracted."""
    import torch

    from megatron_kd.ops.kl import chunk_torch as chunk_math
    from megatron_kd.ops.kl import chunk_triton

    tokens, hidden, vocab = SHAPES[shape]
    dev = torch.device("cuda")
    _, _, ids, lps = _inputs(chunk, 8, vocab, dev)
    logits = (torch.randn(chunk, vocab, device=dev) * 3).bfloat16()
    block = logits.clone()
    teacher = chunk_math.teacher_terms(ids, lps, tail="none", temperature=1.0, vocab_start=0,
                                       vocab_local=vocab, dtype=torch.float32)
    nbytes = block.numel() * block.element_size()
    t_copy = cuda_median_ms(lambda: block.copy_(logits), reps=10)
    for cfg in configs.split(","):
        block_v, warps = map(int, cfg.split("x"))
        chunk_triton._launch_config = lambda v, bv=block_v, w=warps: (bv, w)

        def exp_pass():
            block.copy_(logits)
            return chunk_triton.exp_row_stats_(block, teacher, None, None, 1.0, write=True)

        t_exp = cuda_median_ms(exp_pass, reps=10) - t_copy
        local, z_s, refs = exp_pass()
        exps = block.clone()
        terms = chunk_triton.row_terms(
            local.unsqueeze(0), 0, teacher, torch.ones(chunk, device=dev), None, torch.empty(chunk, device=dev), None,
            kd_weight=1.0, ce_weight=0.0, temperature=1.0, tail="none", need_grad=True)

        def fixup():
            block.copy_(exps)
            chunk_triton.grad_fixup_(block, local, z_s, refs, terms, teacher, None, None, 1.0)

        t_fix = {}
        for fixup_warps in (1, 2, 4, 8):
            chunk_triton.FIXUP_NUM_WARPS = fixup_warps
            t_fix[fixup_warps] = cuda_median_ms(fixup, reps=10) - t_copy
        print(f"kernels {shape} chunk {chunk} BLOCK_V {block_v:5d} warps {warps:2d}: exp_stats {t_exp:6.3f} ms "
              f"({2 * nbytes / t_exp / 1e6:5.0f} GB/s read + write), grad_fixup ms by warps: "
              + ", ".join(f"{w}: {t:.3f}" for w, t in t_fix.items()))


def print_summary(rows: list[dict]) -> None:
    """One line per row; a method's ratio to the floor of the same round and shape, where it ran."""
    floors = {(r["round"], r["shape"]): r["ms"] for r in rows if r["method"] == "floor" and r.get("status") == "ok"}
    print(f"\n{'round':>5} {'shape':16} {'method':22} {'loss':20} {'tp':>2} {'chunk':>6} {'ms':>9} {'x floor':>7} "
          f"{'TFLOP/s':>8} {'peak GiB':>9} {'over in+grad GiB':>17}")
    for r in rows:
        loss = "" if r["method"] == "floor" or r.get("divergence") is None else \
            f"{r['divergence']}/{r['tail']}" + (f"/ce{r['ce_weight']:g}" if r.get("ce_weight") else "")
        head = (f"{r['round']:5} {r['shape']:16} {r['method']:22} {loss:20} {r.get('tp', 1):>2} "
                f"{r.get('chunk_size') or 'auto':>6}")
        if r.get("status") == "ok":
            floor = floors.get((r["round"], r["shape"]))
            ratio = f"{r['ms'] / floor:7.3f}" if floor else f"{'':7}"
            print(f"{head} {r['ms']:9.1f} {ratio} {r['tflops']:8.0f} {r['peak_gib']:9.2f} "
                  f"{r['over_inputs_grads_gib']:17.2f}")
        else:
            print(f"{head} {r.get('status')}")



def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=None, help="comma-separated (default: all; at --tp > 1 the ours-* ones)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: each method's own)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel processes, one GPU each (ours-* methods)")
    p.add_argument("--check", action="store_true", help="correctness of the KL methods on a tiny problem")
    p.add_argument("--profile", action="store_true", help="print CUDA time per kernel for one step of each row")
    p.add_argument("--kernel-sweep", metavar="BLOCKxWARPS,...", default=None,
                   help="time the Triton kernels alone on one [chunk-size x V] block of each shape, per config")
    p.add_argument("--rounds", type=int, default=1, help="run every (shape, method) this many times, interleaved")
    p.add_argument("--divergence", default="forward",
                   help="comma-separated divergences of ours-* and dense: forward, reverse, jsd, or all")
    p.add_argument("--tail", default=None,
                   help="comma-separated tails (default: none for forward, renorm,ghost for reverse and jsd)")
    p.add_argument("--ce-weight", type=float, default=0.0, help="hard-label CE weight (random labels) of ours-*, dense")
    p.add_argument("--out", type=Path, default=None, help="CSV file for the results")
    p.add_argument("--one", nargs=5, metavar=("METHOD", "SHAPE", "DIVERGENCE", "TAIL", "CE_WEIGHT"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    losses = loss_variants(args.divergence, args.tail, args.ce_weight)
    if args.check:
        check(args.chunk_size, losses=losses)
        return
    if args.kernel_sweep:
        for shape in args.shapes.split(","):
            kernel_sweep(shape, args.chunk_size or 1024, args.kernel_sweep)
        return
    if args.one:
        method, shape, divergence, tail, ce_weight = args.one
        print(json.dumps(run_one(method, shape, args.reps, args.chunk_size, args.tp,
                                 Loss(divergence, tail, float(ce_weight)))))
        return

    methods = args.methods.split(",") if args.methods else (METHODS if args.tp == 1 else TP_METHODS)
    extra = ["--reps", str(args.reps), "--tp", str(args.tp)]
    if args.chunk_size:
        extra += ["--chunk-size", str(args.chunk_size)]
    rows = []
    # one row per (method, loss): the methods that compute one loss only get the default one
    runs = [(m, loss) for m in methods for loss in (losses if m in LOSS_METHODS else [Loss()])
            if m in LOSS_METHODS or Loss() in losses or m == "floor"]
    for rnd, shape, (method, loss) in itertools.product(range(1, args.rounds + 1), args.shapes.split(","), runs):
        env = dict(os.environ, **({"BENCH_LOSS_PROFILE": "1"} if args.profile else {}))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_loss", "--one", method, shape, loss.divergence,
                               loss.tail, str(loss.ce_weight), *extra], capture_output=True, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[1])
        if args.profile:
            print(proc.stderr[-6000:], file=sys.stderr)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else dict(
            method=method, shape=shape, tp=args.tp, chunk_size=args.chunk_size, status="error", **asdict(loss))
        if not lines:
            print(proc.stderr[-3000:], file=sys.stderr)
        row["round"] = rnd
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        keys = sorted({k for r in rows for k in r})
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, keys)
            writer.writeheader()
            writer.writerows(rows)
    print_summary(rows)

if __name__ == "__main__":
    main()
