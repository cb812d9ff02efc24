"""Teacher top-K of a logits block in two reads of each row (the CUDA path of ``vocab_parallel_topk``).

torch.topk over a [c, V] fp32 block is a multi-pass radix select, and the logsumexp is another
three passes; together they cost ~2x the projection GEMM at V = 201K (benchmarks/RESULTS.md).
``topk_candidates_kernel`` runs one program per row:

pass 1  per-lane running max and sum-exp (-> row max and Σ exp(z - max)). The lanes are folded
        into GROUPS = 2·K (rounded up to a power of two) groups; the K-th largest group maximum
        is a threshold t: those K groups each hold an element >= t, so the row's K largest
        elements are all >= t (and for LM-like rows only ~1.3·K elements are).
pass 2  the elements >= t (usually a few hundred at most) are compacted, in column order, into a
        [CAP] candidate list with their columns.

torch.topk over the [c, CAP] candidates then gives the exact local top-K. A row with more than
CAP elements >= t (many ties or an adversarial row) is reported and redone with torch.topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def topk_candidates_kernel(
    z_ptr, z_stride,
    max_ptr, sumexp_ptr, count_ptr,  # out [c] fp32, fp32, int32
    cand_val_ptr, cand_col_ptr,  # out [c, CAP] fp32 (pre-filled with -inf), int32
    V: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, CAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf"))
        m_new = tl.maximum(m, z)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes with no finite value yet
        s = s * tl.exp2((m - m_ref) * 1.4426950408889634) + tl.exp2((z - m_ref) * 1.4426950408889634)
        m = m_new
    row_max = tl.max(m, axis=0)
    lane_ref = tl.where(m == float("-inf"), row_max, m)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, tl.sum(s * tl.exp2((lane_ref - row_max) * 1.4426950408889634), axis=0))

    group_max = tl.max(tl.reshape(m, [GROUPS, BLOCK_V // GROUPS]), axis=1)
    top_groups = tl.topk(group_max, GROUPS)  # a full descending sort of GROUPS values
    threshold = tl.max(tl.where(tl.arange(0, GROUPS) == K - 1, top_groups, float("-inf")), axis=0)

    count = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf"))
        keep = (z >= threshold) & (offs < V)
        pos = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        store = keep & (pos < CAP)
        tl.store(cand_val_ptr + row * CAP + pos, z, mask=store)
        tl.store(cand_col_ptr + row * CAP + pos, offs.to(tl.int32), mask=store)
        count += tl.sum(keep.to(tl.int32), axis=0)
    tl.store(count_ptr + row, count)


def local_topk_max_sumexp(z: torch.Tensor, k: int):
    """Of an fp32 block z [c, V_local]: (top-k values [c, k] descending, their columns [c, k] int64,
    row max [c], Σ exp(z - max) [c]). ``z`` is left intact."""
    rows, vocab_local = z.shape
    groups = 2 * triton.next_power_of_2(k)
    cap = 4 * max(groups, 128)
    block_v = max(min(4096, triton.next_power_of_2(vocab_local)), groups)
    row_max = torch.empty(rows, dtype=torch.float32, device=z.device)
    sumexp = torch.empty_like(row_max)
    count = torch.empty(rows, dtype=torch.int32, device=z.device)
    cand_val = torch.full((rows, cap), float("-inf"), dtype=torch.float32, device=z.device)
    cand_col = torch.zeros((rows, cap), dtype=torch.int32, device=z.device)
    topk_candidates_kernel[(rows,)](
        z, z.stride(0), row_max, sumexp, count, cand_val, cand_col,
        V=vocab_local, K=k, GROUPS=groups, CAP=cap, BLOCK_V=block_v, num_warps=8,
    )
    vals, pos = cand_val.topk(k, dim=-1)
    cols = cand_col.gather(1, pos).long()
    overflow = (count > cap).nonzero().squeeze(1)
    if overflow.numel():  # rare: redo those rows exactly
        vals[overflow], cols[overflow] = z[overflow].topk(k, dim=-1)
    return vals, cols, row_max, sumexp
