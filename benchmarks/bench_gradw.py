"""The loss's weight-gradient GEMM, main_grad += Gᵀ · h in fp32: cuBLAS against a Triton GEMM that
starts its accumulator from main_grad.

Why: at GPT-OSS 32K the fused loss runs 12 of these per step (G: one chunk's [c, V] bf16 logit
gradient, h: its [c, 2880] hidden states, main_grad: Megatron's fp32 [V, 2880] buffer). cuBLAS
(beta = 1) takes 4.79 ms each where its bf16 GEMM of the same work takes ~3.96: the read and write of
the 2.3 GB fp32 accumulator are not hidden behind the math (benchmarks/RESULTS.md, the 2749d58 entry). A
kernel whose tiles start from main_grad instead of zeros pays that traffic inside the main loop.
This script measures whether such a Triton kernel beats cuBLAS on these shapes before the loss
uses it.

    python -m benchmarks.bench_gradw                       # GPT-OSS chunk, all configs
    python -m benchmarks.bench_gradw --rows 2752 --vocab 100544
    python -m benchmarks.bench_gradw --check               # correctness only, tiny shapes (CPU with TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_origin(tile, tiles_m, tiles_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first column) of output tile ``tile``. Tiles go in groups of GROUP_M rows, so
    neighbouring programs share their B tiles in L2; a tile past the last one stays well defined."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.maximum(tl.minimum(tiles_m - first_m, GROUP_M), 1)
    return (first_m + (tile % per_group) % group_rows) * BLOCK_M, ((tile % per_group) // group_rows) * BLOCK_N


@triton.jit
def _c_tile(c_ptr, stride_cm, om, on, M, N, valid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to the C tile at (om, on) and its mask (``valid``: the tile exists)."""
    rows = om + tl.arange(0, BLOCK_M)
    cols = on + tl.arange(0, BLOCK_N)
    ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    return ptrs, (rows[:, None] < M) & (cols[None, :] < N) & valid


@triton.jit
def gemm_tn_accumulate_kernel(
    a_ptr, b_ptr, c_ptr,  # A [K, M] bf16 (row-major), B [K, N] bf16, C [M, N] fp32: C += Aᵀ·B
    M, N,
    stride_ak, stride_bk, stride_cm,
    K: tl.constexpr,  # rows of the chunk: a known trip count (two compiles per run: full and last chunk)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    C_FIRST: tl.constexpr,  # start the accumulator from C (else add C after the main loop)
):
    om, on = _tile_origin(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = om + tl.arange(0, BLOCK_M)
    offs_n = on + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    c_ptrs, c_mask = _c_tile(c_ptr, stride_cm, om, on, M, N, True, BLOCK_M, BLOCK_N)
    if C_FIRST:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_ptrs = a_ptr + offs_k[:, None].to(tl.int64) * stride_ak + offs_m[None, :]  # [BLOCK_K, BLOCK_M]
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :]  # [BLOCK_K, BLOCK_N]
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(a_ptrs, mask=(offs_k[:, None] < k_left) & (offs_m[None, :] < M), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if not C_FIRST:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
    tl.store(c_ptrs, acc, mask=c_mask)


def gemm_tn_accumulate_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, block_m=128, block_n=256, block_k=64,
                        group_m=8, c_first=True, num_warps=8, num_stages=3) -> torch.Tensor:
    """c += aᵀ · b for a [K, M], b [K, N] (bf16 or fp16, row-major) and c [M, N] fp32 (row-major)."""
    k, m = a.shape
    n = b.shape[1]
    assert b.shape[0] == k and c.shape == (m, n) and c.dtype == torch.float32
    assert a.stride(1) == 1 and b.stride(1) == 1 and c.stride(1) == 1
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    gemm_tn_accumulate_kernel[grid](
        a, b, c, m, n, a.stride(0), b.stride(0), c.stride(0), K=k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, C_FIRST=c_first,
        num_warps=num_warps, num_stages=num_stages,
    )
    return c


@triton.jit
def gemm_tn_accumulate_tma_kernel(
    a_desc, b_desc, c_desc, c_ptr,  # A [K, M], B [K, N] (TMA descriptors), C [M, N] fp32: C += Aᵀ·B
    M, N, stride_cm,
    K: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    C_MODE: tl.constexpr,  # "tma": tile starts from C (TMA load/store); "prefetch": next tile's C loaded during this tile's loop
    WARP_SPECIALIZE: tl.constexpr,
):
    """Persistent: one program per SM walks tiles pid, pid + NUM_PROGRAMS, ... (a constexpr trip count, so Triton's
    interpreter runs it too; a tile past the end is clipped by TMA and masked for C)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    c_next = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if C_MODE == "prefetch":  # the first tile's accumulator
        om, on = _tile_origin(pid, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        ptrs, mask = _c_tile(c_ptr, stride_cm, om, on, M, N, pid < num_tiles, BLOCK_M, BLOCK_N)
        c_next = tl.load(ptrs, mask=mask, other=0.0)
    for i in range(TILES_PER_PROGRAM):
        tile = pid + i * NUM_PROGRAMS
        om, on = _tile_origin(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        c_ptrs, mask = _c_tile(c_ptr, stride_cm, om, on, M, N, tile < num_tiles, BLOCK_M, BLOCK_N)
        if C_MODE == "tma":
            acc = c_desc.load([om, on])
        else:
            c_this = c_next
            nxt = tile + NUM_PROGRAMS
            n_om, n_on = _tile_origin(nxt, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            n_ptrs, n_mask = _c_tile(c_ptr, stride_cm, n_om, n_on, M, N, nxt < num_tiles, BLOCK_M, BLOCK_N)
            c_next = tl.load(n_ptrs, mask=n_mask, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
            a = a_desc.load([k0, om])  # [BLOCK_K, BLOCK_M]
            b = b_desc.load([k0, on])  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a.T, b, acc)
        if C_MODE == "tma":
            c_desc.store([om, on], acc)
        else:
            tl.store(c_ptrs, acc + c_this, mask=mask)


def num_sms(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # Triton's interpreter: a few programs, so the persistent walk is exercised


def gemm_tn_accumulate_tma_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, block_m=128, block_n=128, block_k=64,
                            group_m=8, c_mode="prefetch", warp_specialize=False, num_warps=8,
                            num_stages=4) -> torch.Tensor:
    """c += aᵀ · b like ``gemm_tn_accumulate_``, persistent, with TMA loads of A and B. Row strides must be
    16-byte multiples (TMA)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    k, m = a.shape
    n = b.shape[1]
    assert b.shape[0] == k and c.shape == (m, n) and c.dtype == torch.float32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = min(tiles, num_sms(c.device))
    gemm_tn_accumulate_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_k, block_m]), TensorDescriptor.from_tensor(b, [block_k, block_n]),
        TensorDescriptor.from_tensor(c, [block_m, block_n]), c, m, n, c.stride(0),
        K=k, TILES_PER_PROGRAM=triton.cdiv(tiles, programs), NUM_PROGRAMS=programs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, C_MODE=c_mode,
        WARP_SPECIALIZE=warp_specialize, num_warps=num_warps, num_stages=num_stages,
    )
    return c


def check(device: str, rows=70, vocab=312, hidden=48, tol=1e-5) -> None:
    """Against a float64 reference, with ragged tiles in every dimension. bf16 operands on CUDA; fp16
    in Triton's interpreter on CPU (numpy has no bf16)."""
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    a = torch.randn(rows, vocab, device=device, generator=g).to(dtype)
    b = torch.randn(rows, hidden, device=device, generator=g).to(dtype)
    c0 = torch.randn(vocab, hidden, device=device, generator=g)
    want = c0.double() + a.double().t() @ b.double()
    small = dict(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=2)
    cases = [(f"pointer c_first={c_first}", lambda c, f=c_first: gemm_tn_accumulate_(c, a, b, c_first=f, **small))
             for c_first in (True, False)]
    cases += [(f"tma c_mode={mode}", lambda c, m=mode: gemm_tn_accumulate_tma_(c, a, b, c_mode=m, **small))
              for mode in ("tma", "prefetch")]
    for name, run in cases:
        got = run(c0.clone())
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err <= tol, (name, err)
        print(f"check {name}: relative error {err:.2e}")


def bench(rows: int, vocab: int, hidden: int, reps: int, which: str) -> None:
    from benchmarks.common.cuda_timing import cuda_median_ms

    dev = "cuda"
    a = (torch.randn(rows, vocab, device=dev) * 1e-3).bfloat16()
    b = torch.randn(rows, hidden, device=dev).bfloat16()
    c = torch.zeros(vocab, hidden, device=dev)
    flop = 2 * rows * vocab * hidden

    def report(name, ms):
        print(f"{name:64s} {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s", flush=True)

    def attempt(name, fn):
        try:
            report(name, cuda_median_ms(fn, reps=reps))
        except Exception as e:  # e.g. out of shared memory for this config
            print(f"{name:64s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)

    report("cuBLAS bf16 out (beta = 0, no accumulator)", cuda_median_ms(lambda: a.t() @ b, reps=reps))
    report("cuBLAS into fp32 main_grad (beta = 1)",
           cuda_median_ms(lambda: torch.addmm(c, a.t(), b, out_dtype=torch.float32, out=c), reps=reps))
    want = torch.addmm(torch.zeros_like(c), a.t(), b, out_dtype=torch.float32)
    for name, run in (("pointer", gemm_tn_accumulate_), ("tma", gemm_tn_accumulate_tma_)):
        if which in (name, "all"):
            err = ((run(torch.zeros_like(c), a, b) - want).norm() / want.norm()).item()
            print(f"triton {name} vs cuBLAS at this shape: relative difference {err:.2e}")
    if which in ("pointer", "all"):
        configs = itertools.product([(128, 256, 64), (256, 128, 64), (128, 128, 64)], [3, 4], [True, False])
        for (bm, bn, bk), stages, c_first in configs:
            attempt(f"triton pointer {bm}x{bn}x{bk} stages {stages} {'C first' if c_first else 'C last'}",
                    lambda: gemm_tn_accumulate_(c, a, b, block_m=bm, block_n=bn, block_k=bk, c_first=c_first,
                                                num_warps=8, num_stages=stages))
    if which in ("tma", "all"):
        configs = itertools.product([(128, 128, 64), (256, 128, 64), (128, 256, 64), (128, 128, 128)], [3, 4],
                                    ["prefetch", "tma"], [False, True])
        for (bm, bn, bk), stages, mode, ws in configs:
            attempt(f"triton tma {bm}x{bn}x{bk} stages {stages} C {mode}{' warp-spec' if ws else ''}",
                    lambda: gemm_tn_accumulate_tma_(c, a, b, block_m=bm, block_n=bn, block_k=bk, c_mode=mode,
                                                    warp_specialize=ws, num_warps=8, num_stages=stages))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2752, help="tokens per chunk (K of the GEMM)")
    p.add_argument("--vocab", type=int, default=201088, help="vocabulary rows on this rank")
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--check", action="store_true", help="correctness only, at tiny shapes")
    p.add_argument("--kernels", choices=["pointer", "tma", "all"], default="all", help="which Triton GEMMs to time")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if not args.check:
        bench(args.rows, args.vocab, args.hidden, args.reps, args.kernels)


if __name__ == "__main__":
    main()
