"""Teacher top-K of a logits block in one read of each row (the CUDA path of ``vocab_parallel_topk``).

torch.topk over a [c, V] fp32 block is a multi-pass radix select, and the logsumexp is another
three passes; together they cost ~2x the projection GEMM at V = 201K (benchmarks/RESULTS.md).
``topk_candidates_kernel`` reads each row once (one program per row, BLOCK_V lanes):

* every lane keeps a running max and sum-exp (-> row max and Σ exp(z - max)), its two largest
  values with their columns, and the largest value it dropped;
* the lanes are folded into GROUPS = 2·K (power of two) groups; the K-th largest group maximum is
  a threshold t: those K groups each hold an element >= t, so the row's K largest are all >= t;
* the kept values >= t (~1.3·K for LM-like rows) are compacted into a [CAP] candidate list.

torch.topk over the [c, CAP] candidates gives the exact local top-K. Two kinds of row need more,
and the program does it itself, so the host never reads a flag back (a read would synchronize the
teacher pass with the GPU once per chunk): a row where some lane dropped a value >= t (it held 3+
of the row's largest values: ~2% of random rows at V = 201K) is read once more and every value
>= t compacted; a row with more than CAP values >= t (a flat top, ties) finds its exact K-th
largest value by bisection over the floats' order (one read per step, ~30 steps) and keeps the
values above it, then ties with it up to K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_kd.ops.triton_lse import LOG2E, lanes_sumexp, online_sumexp


@triton.jit
def topk_candidates_kernel(
    z_ptr, z_stride,
    max_ptr, sumexp_ptr,  # out [c] fp32
    cand_val_ptr, cand_col_ptr,  # out [c, CAP] fp32 (pre-filled with -inf), int32
    V: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, CAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    v1 = tl.full([BLOCK_V], neg_inf, tl.float32)  # lane max
    v2 = tl.full([BLOCK_V], neg_inf, tl.float32)  # lane second largest
    v3 = tl.full([BLOCK_V], neg_inf, tl.float32)  # largest value the lane dropped
    c1 = tl.zeros([BLOCK_V], tl.int32)
    c2 = tl.zeros([BLOCK_V], tl.int32)
    s = tl.zeros([BLOCK_V], tl.float32)  # Σ exp(z - v1) over the lane
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        z = tl.load(z_row + offs, mask=offs < V, other=neg_inf)
        above1 = z > v1
        above2 = z > v2
        v3 = tl.maximum(v3, tl.where(above2, v2, z))
        v2 = tl.where(above1, v1, tl.where(above2, z, v2))
        c2 = tl.where(above1, c1, tl.where(above2, offs, c2))
        m_new = tl.maximum(v1, z)
        s = online_sumexp(s, v1, m_new, z, LOG2E)
        c1 = tl.where(above1, offs, c1)
        v1 = m_new
    row_max = tl.max(v1, axis=0)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, lanes_sumexp(s, v1, row_max, LOG2E))

    group_max = tl.max(tl.reshape(v1, [GROUPS, BLOCK_V // GROUPS]), axis=1)
    top_groups = tl.topk(group_max, GROUPS)  # a full descending sort of GROUPS values
    threshold = tl.max(tl.where(tl.arange(0, GROUPS) == K - 1, top_groups, neg_inf), axis=0)

    keep1 = v1 >= threshold
    keep2 = v2 >= threshold
    n1 = tl.sum(keep1.to(tl.int32), axis=0)
    count = n1 + tl.sum(keep2.to(tl.int32), axis=0)
    lost = tl.max((v3 >= threshold).to(tl.int32), axis=0)  # a lane dropped a possible top-K value
    out_val = cand_val_ptr + row * CAP
    out_col = cand_col_ptr + row * CAP
    if (lost > 0) | (count > CAP):  # the lanes' candidates miss some, or overflow: from the row itself
        cut = _order_key(threshold).to(tl.int64)
        if _count_at_least(z_row, cut, V, BLOCK_V) > CAP:
            # the largest key with >= K values at or above it: the row's K-th largest value
            lo, hi = cut, _order_key(row_max).to(tl.int64) + 1  # count(>= lo) >= K > count(>= hi)
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                if _count_at_least(z_row, mid, V, BLOCK_V) >= K:
                    lo = mid
                else:
                    hi = mid
            cut = lo
            n_above = _compact(z_row, cut + 1, 2**32, 0, CAP, out_val, out_col, V, BLOCK_V)  # < K of them
            _compact(z_row, cut, cut, n_above, K, out_val, out_col, V, BLOCK_V)  # ties with it, up to K
        else:
            _compact(z_row, cut, 2**32, 0, CAP, out_val, out_col, V, BLOCK_V)
    else:
        pos1 = tl.cumsum(keep1.to(tl.int32), axis=0) - 1
        pos2 = n1 + tl.cumsum(keep2.to(tl.int32), axis=0) - 1
        tl.store(out_val + pos1, v1, mask=keep1)
        tl.store(out_col + pos1, c1, mask=keep1)
        tl.store(out_val + pos2, v2, mask=keep2)
        tl.store(out_col + pos2, c2, mask=keep2)


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the floats' order (NaN aside)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_at_least(z_row, key, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """How many of the row's V values have an order key >= ``key``."""
    n = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf"))
        n += ((_order_key(z).to(tl.int64) >= key) & (offs < V)).to(tl.int32)
    return tl.sum(n, axis=0)


@triton.jit
def _compact(z_row, lo, hi, first, limit, out_val, out_col, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Stores the row's values whose order key is in [lo, hi] at positions first, first + 1, ...
    (column order) below ``limit``; returns the position after the last value found."""
    pos = first
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf"))
        key = _order_key(z).to(tl.int64)
        keep = (key >= lo) & (key <= hi) & (offs < V)
        at = pos + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_val + at, z, mask=keep & (at < limit))
        tl.store(out_col + at, offs, mask=keep & (at < limit))
        pos += tl.sum(keep.to(tl.int32), axis=0)
    return pos


def local_topk_max_sumexp(z: torch.Tensor, k: int):
    """Of an fp32 block z [c, V_local]: (top-k values [c, k] descending, their columns [c, k] int64,
    row max [c], Σ exp(z - max) [c]). ``z`` is left intact; nothing is read back to the host."""
    rows, vocab_local = z.shape
    groups = 2 * triton.next_power_of_2(k)
    cap = 4 * max(groups, 128)
    block_v = max(min(4096, triton.next_power_of_2(vocab_local)), groups)
    row_max = torch.empty(rows, dtype=torch.float32, device=z.device)
    sumexp = torch.empty_like(row_max)
    cand_val = torch.full((rows, cap), float("-inf"), dtype=torch.float32, device=z.device)
    cand_col = torch.zeros((rows, cap), dtype=torch.int32, device=z.device)
    topk_candidates_kernel[(rows,)](
        z, z.stride(0), row_max, sumexp, cand_val, cand_col,
        V=vocab_local, K=k, GROUPS=groups, CAP=cap, BLOCK_V=block_v, num_warps=16,
    )
    vals, pos = cand_val.topk(k, dim=-1)
    return vals, cand_col.gather(1, pos).long(), row_max, sumexp
