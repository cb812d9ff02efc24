"""Per-chunk elementwise work of the fused top-K KL loss as Triton kernels (the CUDA path).

The torch path (``chunk_torch.py``) makes ~7 passes over each [c, V_local] logits block in fp32.
Here the block stays in the GEMM dtype (bf16 on GPUs: half the bytes, so chunks twice as long in
the same memory) and is read and written once, by one program per row:

``exp_stats_kernel``   gathers the K teacher entries and the label (z_S), then walks the row once:
                       sum-exp at τ (and at 1 for the CE term when τ != 1), and the row written
                       back as E = exp((z - r)/τ) -> the [c, 6] statistics the chunk loop
                       all-gathers across TP ranks. r, the row's reference, is the student's
                       largest logit among the teacher entries and the label (known before the
                       walk), raised by a tile only if that tile's E would pass 2^REF_HEADROOM.
``row_terms_kernel``   the per-row math between the passes, for a block of rows at once: the TP
                       combine of the gathered statistics, the KD / CE losses (written straight
                       into the per-token buffers) and the gradient's per-row coefficients. One
                       launch where the torch functions take ~25 small ones per chunk.
``grad_fixup_kernel``  the gradient is G = α·E + (sparse terms at the teacher entries and the
                       label), so the block becomes X with G = σ·X: σ = α and only the sparse
                       entries are rewritten (as their G / α). The two backward GEMMs take σ as a
                       row scale (of grad_h's rows, of h's rows for grad_W). Rows that need more
                       are rewritten whole, a rare second pass over just those rows: a reference
                       raised mid-row (earlier tiles rescaled), α negligible next to the sparse
                       terms (σ = 1, X = G), and the CE softmax at τ != 1 (σ = 1, X = α·E + β·E^τ).
``scale_rows_kernel``  σ on the rows of the chunk's grad_h (after GEMM 2, in fp32) and of its h
                       (before GEMM 3): [c, h], small next to the block.

divergence="reverse" / "jsd" (``SupportSpec``; the math of ``divergences.py``) take the same
passes: row_terms_kernel also walks each row's K entries (z_S, log P_v) for the per-row sums F and
H and writes two more per-row values (the log-normalizer less this rank's reference, and the
center H or g_rest); grad_fixup_kernel forms each entry's Q_v and g_v from them. Under TP the sums
come first from the same kernel in its partial-sums variant (``support_sums``) and are all-reduced.
Renorm without a CE gradient has no dense part: exp_stats_kernel writes zeros (WRITE_ZEROS) and the
fix-up writes the sparse entries with σ = 1 (SPARSE_ONLY). Forward compiles none of this.

A separate statistics pass, read before the gradient pass, would read every block twice. All
arithmetic is fp32. The sparse entries are *rewritten* (not added to): rewriting lets duplicate ids
in a row and a label that is also a teacher id produce identical stores (no read-modify-write race).
The teacher terms (once per call) stay in ``chunk_torch``, shared by both paths; the combine,
losses and coefficients there (``combine_row_stats``, ``row_losses``, ``grad_coefficients``) are the
plain-torch form of ``row_terms_kernel``. ``stats[:, ROW_MAX]`` holds r here (the torch path's row
max): the combine only needs a common reference for each rank's sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_kd.ops.kl import chunk_torch as chunk_math
from megatron_kd.ops.kl.chunk_torch import (
    NUM_ROW_STATS,
    ROW_LABEL_LOGIT,
    ROW_MAX,
    ROW_REST_SUMEXP,
    ROW_SUPPORT_MAX,
    ROW_SUPPORT_SUMEXP,
    ROW_SUMEXP_1,
    ROW_SUMEXP_T,
    ROW_TARGET_DOT,
    ROW_TEACHER_SUMEXP,
)
from megatron_kd.ops.kl.options import DIVERGENCES, GHOST_REST_FLOOR
from megatron_kd.ops.triton_lse import LOG2E


def _launch_config(vocab_local: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the per-row passes. Swept on an H200 (bench_loss.py --kernel-sweep, a
    3,648 x 201,088 bf16 block): exp_stats_kernel read + write at 3.67 TB/s with 4096 lanes and 4 warps;
    8 warps 3.48, 8192 lanes 3.65, 2048 lanes 3.41."""
    return min(4096, triton.next_power_of_2(vocab_local)), 4


# Warps of grad_fixup_kernel: its common rows touch only their K sparse entries. H200, bench_loss.py
# --kernel-sweep, 3648 x 201,088 / 4096 x 100,544 blocks: 1 warp 0.039 / 0.035 ms, 2 0.034 / 0.056, 4 0.066 / 0.086.
FIXUP_NUM_WARPS = 1

# exp2 headroom of the values kept in the block: E <= 2^64 keeps the row sums (x V), the GEMMs' fp32
# accumulation and the bf16 block far from overflow, and still is 44 nats: a row's reference is
# raised only where the student puts a logit that far above every teacher entry and the label.
REF_HEADROOM = tl.constexpr(64.0)
# A row whose sparse terms exceed 2^40·|α| is written whole (σ = 1) rather than divided by α.
SPARSE_RATIO = tl.constexpr(2.0**40)


@triton.jit
def exp_stats_kernel(
    z_ptr, z_stride,  # in: logits; out (WRITE): E = exp((z - r)/τ) in place
    idx_ptr, owned_ptr, target_ptr, repeat_ptr,  # [c, K] teacher entries (local column, 1/0, B_v·owned,
    # 1/0 at a column an earlier entry names: REST_SUM only)
    label_idx_ptr, label_owned_ptr,  # [c] (unused without labels)
    stats_ptr, zs_ptr, ref_ptr,  # out: [c, NUM_STATS] fp32, [c, K] fp32, [c, NUM_TILES] the r of each tile
    K, scale_t, steep,  # scale_t = log2(e)/τ; steep: the larger of the exp2 scales summed (headroom)
    V: tl.constexpr,  # V_local: one compile per model, and a known trip count
    NUM_TILES: tl.constexpr, NUM_STATS: tl.constexpr,
    I_MAX: tl.constexpr, I_SUM_T: tl.constexpr, I_SUM_1: tl.constexpr,
    I_TDOT: tl.constexpr, I_TSUM: tl.constexpr, I_LABEL: tl.constexpr, I_REST: tl.constexpr,
    I_SMAX: tl.constexpr, I_SSUM: tl.constexpr,
    HAS_LABELS: tl.constexpr, SEPARATE_SUM_1: tl.constexpr, WRITE: tl.constexpr, WRITE_ZEROS: tl.constexpr,
    REST_SUM: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """WRITE_ZEROS: the row is written as 0, not E (a gradient with no dense part: grad_fixup_kernel's
    SPARSE_ONLY), and no references are kept. REST_SUM (ghost tail): the walk skips the teacher
    entries' columns (set to -inf first, so it sums the rest outcome's own terms), whose E the
    fix-up never reads (it rewrites them from z_S); without WRITE they are put back."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    # The teacher entries and the label first: the walk overwrites the row.
    k = tl.arange(0, BLOCK_K)
    kmask = k < K
    idx = tl.load(idx_ptr + row * K + k, mask=kmask, other=0)
    owned = tl.load(owned_ptr + row * K + k, mask=kmask, other=0.0)
    target = tl.load(target_ptr + row * K + k, mask=kmask, other=0.0)
    is_owned = kmask & (owned != 0)
    z_s = tl.load(z_row + idx, mask=is_owned, other=0.0).to(tl.float32)
    tl.store(zs_ptr + row * K + k, z_s, mask=kmask)
    support_max = tl.max(tl.where(is_owned, z_s, float("-inf")), axis=0)
    ref = support_max
    if HAS_LABELS:
        label_idx = tl.load(label_idx_ptr + row)
        label_owned = tl.load(label_owned_ptr + row)
        z_label = tl.load(z_row + label_idx, mask=label_owned != 0, other=0.0).to(tl.float32)
        ref = tl.maximum(ref, tl.where(label_owned != 0, z_label, float("-inf")))
    if REST_SUM:  # every thread's gathers above land before the entries' columns are overwritten
        tl.debug_barrier()
        tl.store(z_row + idx, tl.full([BLOCK_K], float("-inf"), z_ptr.dtype.element_ty), mask=is_owned)
        tl.debug_barrier()

    cols = tl.arange(0, BLOCK_V)
    s_t = tl.zeros([BLOCK_V], tl.float32)
    s_1 = tl.zeros([BLOCK_V], tl.float32)
    for t in range(NUM_TILES):
        offs = t * BLOCK_V + cols
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(z, axis=0)
        if (tile_max - ref) * steep > REF_HEADROOM:  # rare; always on the first tile when r is unknown (-inf)
            s_t *= tl.exp2((ref - tile_max) * scale_t)
            if SEPARATE_SUM_1:
                s_1 *= tl.exp2((ref - tile_max) * LOG2E)
            ref = tile_max
        e = tl.exp2((z - ref) * scale_t)
        s_t += e
        if SEPARATE_SUM_1:
            s_1 += tl.exp2((z - ref) * LOG2E)
        if WRITE:
            if WRITE_ZEROS:
                tl.store(z_row + offs, tl.zeros([BLOCK_V], z_ptr.dtype.element_ty), mask=offs < V)
            else:
                tl.store(z_row + offs, e.to(z_ptr.dtype.element_ty), mask=offs < V)
                tl.store(ref_ptr + row * NUM_TILES + t, ref)
    sum_t = tl.sum(s_t, axis=0)
    if SEPARATE_SUM_1:
        sum_1 = tl.sum(s_1, axis=0)
    t_dot = tl.sum(target * z_s, axis=0)
    e_s = tl.where(is_owned, owned * tl.exp2((z_s - ref) * scale_t), 0.0)
    t_sum = tl.sum(e_s, axis=0)
    out = stats_ptr + row * NUM_STATS
    if REST_SUM:  # sum_t is the rest; the row's sum adds the entries' columns once each
        # (chunk_torch.repeated_entries: an owned entry whose column an earlier one names)
        repeat = is_owned & (tl.load(repeat_ptr + row * K + k, mask=kmask, other=0.0) != 0)
        tl.store(out + I_REST, sum_t - tl.sum(tl.where(repeat, e_s, 0.0), axis=0))
        sum_t += tl.sum(tl.where(repeat, 0.0, e_s), axis=0)
        if SEPARATE_SUM_1:
            sum_1 += tl.sum(tl.where(is_owned & ~repeat, tl.exp2((z_s - ref) * LOG2E), 0.0), axis=0)
        if not WRITE:
            tl.debug_barrier()  # the walk's loads of the row are done
            tl.store(z_row + idx, z_s.to(z_ptr.dtype.element_ty), mask=is_owned)
    else:
        tl.store(out + I_REST, 0.0)

    tl.store(out + I_MAX, ref)
    tl.store(out + I_SUM_T, sum_t)
    tl.store(out + I_TDOT, t_dot)
    tl.store(out + I_TSUM, t_sum)
    # S in its own frame (chunk_torch.ROW_SUPPORT_MAX): -inf and 0 where this rank owns no entry
    support_base = tl.where(support_max > float("-inf"), support_max, 0.0)
    tl.store(out + I_SMAX, support_max)
    support_e = tl.exp2((tl.where(is_owned, z_s, support_base) - support_base) * scale_t)
    tl.store(out + I_SSUM, tl.sum(tl.where(is_owned, support_e, 0.0), axis=0))
    if HAS_LABELS:
        if not SEPARATE_SUM_1:
            sum_1 = sum_t
        tl.store(out + I_SUM_1, sum_1)
        tl.store(out + I_LABEL, z_label * label_owned)
    else:
        tl.store(out + I_SUM_1, 0.0)
        tl.store(out + I_LABEL, 0.0)


# Rows per program of row_terms_kernel (it is a few hundred bytes per row: launch-bound, not tuned).
ROW_TERMS_BLOCK = 256
# Reverse / JSD: the kernel also walks each row's K entries, BLOCK_R x ENTRY_TILE at a time (fewer rows
# per program keep that tile in registers).
ROW_TERMS_SUPPORT_BLOCK = 64
ENTRY_TILE = 32
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny
REST_FLOOR = tl.constexpr(GHOST_REST_FLOOR)
DIVERGENCE_CODES = {name: code for code, name in enumerate(DIVERGENCES)}  # forward 0, reverse 1, jsd 2
# row_terms_kernel's SUMS: none (forward); computed and used (TP = 1); this rank's partial sums stored
# (TP > 1, before their all-reduce); the all-reduced sums loaded and used (TP > 1, after it)
SUMS_NONE, SUMS_INLINE, SUMS_PARTIAL, SUMS_LOADED = (tl.constexpr(i) for i in range(4))


@triton.jit
def _entry_terms(log_q, log_p, jsd_beta, log_beta, log1m_beta, DIVERGENCE: tl.constexpr):
    """(f, g, Q) of divergences.py per entry, from log Q_v and log P_v (natural logs)."""
    q = tl.exp(log_q)
    if DIVERGENCE == 1:  # reverse
        g = log_q - log_p
        f = q * g
    else:  # jsd: log Mx = logaddexp(log β + log P, log(1-β) + log Q)
        a = log_beta + log_p
        b = log1m_beta + log_q
        hi = tl.maximum(a, b)
        log_mix = hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))
        g = (1.0 - jsd_beta) * (log_q - log_mix)
        f = jsd_beta * tl.exp(log_p) * (log_p - log_mix) + q * g
    return f, g, q


@triton.jit
def _support_sums(zs_ptr, owned_ptr, log_target_ptr, r, rmask, K, ref_local, shift, inv_tau,
                  jsd_beta, log_beta, log1m_beta,
                  DIVERGENCE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KT: tl.constexpr, K_TILES: tl.constexpr):
    """F = Σ f_v and H = Σ Q_v g_v over this rank's entries of rows r; log Q_v = (z_v - r_local)/τ - shift."""
    f_sum = tl.zeros([BLOCK_R], tl.float32)
    h_sum = tl.zeros([BLOCK_R], tl.float32)
    kk = tl.arange(0, BLOCK_KT)
    for kt in range(K_TILES):  # a constexpr trip count (Triton's interpreter takes no runtime bound)
        cols = kt * BLOCK_KT + kk
        off = r[:, None] * K + cols[None, :]
        owned = tl.load(owned_ptr + off, mask=rmask[:, None] & (cols < K)[None, :], other=0.0) != 0
        z = tl.load(zs_ptr + off, mask=owned, other=0.0)
        log_p = tl.load(log_target_ptr + off, mask=owned, other=0.0)
        log_q = tl.where(owned, (z - ref_local[:, None]) * inv_tau - shift[:, None], 0.0)
        f, g, q = _entry_terms(log_q, log_p, jsd_beta, log_beta, log1m_beta, DIVERGENCE)
        f_sum += tl.sum(tl.where(owned, f, 0.0), axis=1)
        h_sum += tl.sum(tl.where(owned, q * g, 0.0), axis=1)
    return f_sum, h_sum


@triton.jit
def _ghost_rest(rest_p, student_rest, jsd_beta, DIVERGENCE: tl.constexpr):
    """(f_r, g_r) of the ghost tail's rest outcome (divergences.ghost_rest)."""
    log_rest_p = tl.log(tl.maximum(rest_p, REST_FLOOR))
    rest_q = tl.maximum(student_rest, FP32_TINY)
    log_rest_q = tl.log(rest_q)
    if DIVERGENCE == 1:
        g_r = log_rest_q - log_rest_p
        f_r = rest_q * g_r
    else:
        log_mix = tl.log(tl.maximum(jsd_beta * rest_p + (1.0 - jsd_beta) * rest_q, FP32_TINY))
        g_r = (1.0 - jsd_beta) * (log_rest_q - log_mix)
        f_r = jsd_beta * rest_p * (log_rest_p - log_mix) + rest_q * g_r
    return f_r, g_r


@triton.jit
def _ce_grad(alpha, rho, r, rmask, w_rank_1, sum_1, ce_weight, beta_ptr, label_sparse_ptr, label_owned_ptr,
             SEPARATE_BETA: tl.constexpr):
    """The CE gradient's per-row terms: α (+ its softmax at τ = 1) returned, β and the label's stored."""
    ce_scale = ce_weight * rho
    scale_1 = w_rank_1 / sum_1
    if SEPARATE_BETA:
        tl.store(beta_ptr + r, ce_scale * scale_1, mask=rmask)
    else:
        alpha += ce_scale * scale_1
    tl.store(label_sparse_ptr + r, -ce_scale * tl.load(label_owned_ptr + r, mask=rmask, other=0.0), mask=rmask)
    return alpha


@triton.jit
def row_terms_kernel(
    stats_ptr, rows, rank,  # [TP, rows, NUM_STATS] every rank's local statistics of the chunk
    const_ptr, lse_coef_ptr, mass_ptr, rest_mass_ptr, rho_ptr, label_owned_ptr,  # [rows] teacher terms, ρ, label owner
    kd_ptr, ce_ptr,  # out [rows]: L before kd_weight·τ², and the CE term
    alpha_ptr, beta_ptr, sparse_scale_ptr, ghost_ptr, label_sparse_ptr,  # out [rows]: see RowTerms
    zs_ptr, owned_ptr, log_target_ptr, K,  # reverse / jsd: [rows, K] z_S, owned, log P_v
    sums_ptr, shift_ptr, center_ptr,  # reverse / jsd: [rows, 2] F, H (see SUMS); out [rows]: see RowTerms
    kd_grad_weight, ce_weight, inv_tau,  # kd_weight·τ, ce_weight, 1/τ
    jsd_beta, log_beta, log1m_beta,  # β, log β, log(1 - β) of divergence="jsd"
    TP: tl.constexpr, NUM_STATS: tl.constexpr,
    I_MAX: tl.constexpr, I_SUM_T: tl.constexpr, I_SUM_1: tl.constexpr,
    I_TDOT: tl.constexpr, I_TSUM: tl.constexpr, I_LABEL: tl.constexpr, I_REST: tl.constexpr,
    I_SMAX: tl.constexpr, I_SSUM: tl.constexpr,
    GHOST: tl.constexpr, HAS_LABELS: tl.constexpr, NEED_GRAD: tl.constexpr,
    CE_GRAD: tl.constexpr, SEPARATE_BETA: tl.constexpr,
    DIVERGENCE: tl.constexpr, SUMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KT: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """combine_row_stats + row_losses + grad_coefficients of chunk_torch (forward), or their
    divergences.py counterparts (reverse, jsd), for BLOCK_R rows."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for t in tl.static_range(TP):
        row_max = tl.maximum(row_max, tl.load(stats_ptr + (t * rows + r) * NUM_STATS + I_MAX, mask=rmask, other=0.0))
    sum_t = tl.zeros([BLOCK_R], tl.float32)
    teacher_sum = tl.zeros([BLOCK_R], tl.float32)
    rest_sum = tl.zeros([BLOCK_R], tl.float32)
    target_dot = tl.zeros([BLOCK_R], tl.float32)
    sum_1 = tl.zeros([BLOCK_R], tl.float32)
    label_logit = tl.zeros([BLOCK_R], tl.float32)
    w_rank_t = tl.zeros([BLOCK_R], tl.float32)
    w_rank_1 = tl.zeros([BLOCK_R], tl.float32)
    for t in tl.static_range(TP):
        base = stats_ptr + (t * rows + r) * NUM_STATS
        rank_max = tl.load(base + I_MAX, mask=rmask, other=0.0)
        w_t = tl.exp((rank_max - row_max) * inv_tau)  # this rank's sums rescaled to the global max
        sum_t += tl.load(base + I_SUM_T, mask=rmask, other=1.0) * w_t
        teacher_sum += tl.load(base + I_TSUM, mask=rmask, other=0.0) * w_t
        if GHOST:
            rest_sum += tl.load(base + I_REST, mask=rmask, other=1.0) * w_t
        target_dot += tl.load(base + I_TDOT, mask=rmask, other=0.0)
        w_rank_t = tl.where(rank == t, w_t, w_rank_t)
        if HAS_LABELS:
            w_1 = tl.exp(rank_max - row_max)
            sum_1 += tl.load(base + I_SUM_1, mask=rmask, other=1.0) * w_1
            label_logit += tl.load(base + I_LABEL, mask=rmask, other=0.0)
            w_rank_1 = tl.where(rank == t, w_1, w_rank_1)
    student_mass = teacher_sum / sum_t  # Q
    student_rest = rest_sum / sum_t  # 1 - Q from its own terms (ghost)
    scale_t = w_rank_t / sum_t

    if DIVERGENCE == 0:
        const = tl.load(const_ptr + r, mask=rmask, other=0.0)
        lse_coef = tl.load(lse_coef_ptr + r, mask=rmask, other=0.0)
        kd = const + lse_coef * (row_max * inv_tau + tl.log(sum_t)) - target_dot * inv_tau
        if GHOST:
            mass = tl.load(mass_ptr + r, mask=rmask, other=0.0)
            tail_mass = tl.load(rest_mass_ptr + r, mask=rmask, other=0.0)
            one_minus_q = tl.maximum(student_rest, FP32_TINY)
            kd -= tail_mass * tl.log(one_minus_q)
        tl.store(kd_ptr + r, kd, mask=rmask)
        if HAS_LABELS:
            tl.store(ce_ptr + r, row_max + tl.log(sum_1) - label_logit, mask=rmask)
        if NEED_GRAD:
            rho = tl.load(rho_ptr + r, mask=rmask, other=0.0)
            kd_scale = kd_grad_weight * rho
            if GHOST:
                ghost_ratio = tail_mass / one_minus_q
                alpha = kd_scale * (mass - ghost_ratio * student_mass) * scale_t
                tl.store(ghost_ptr + r, kd_scale * ghost_ratio * scale_t, mask=rmask)
            else:
                alpha = kd_scale * lse_coef * scale_t
            if CE_GRAD:
                alpha = _ce_grad(alpha, rho, r, rmask, w_rank_1, sum_1, ce_weight, beta_ptr, label_sparse_ptr,
                                 label_owned_ptr, SEPARATE_BETA)
            tl.store(alpha_ptr + r, alpha, mask=rmask)
            tl.store(sparse_scale_ptr + r, -kd_scale, mask=rmask)
    else:
        # log Q_v = (z_v - r_local)/τ - shift, the form grad_fixup_kernel evaluates too. ghost: r_local
        # is this rank's row max, shift the global logsumexp less it. renorm: Q = q_S / Q_S in S's own
        # frame (exact, and precise, however far S lies below the row max, where Q_S underflows):
        # r_local is this rank's largest entry, shift logsumexp_S(z/τ) less it
        if GHOST:
            ref_local = tl.load(stats_ptr + (rank * rows + r) * NUM_STATS + I_MAX, mask=rmask, other=0.0)
            shift = (row_max - ref_local) * inv_tau + tl.log(sum_t)
        else:
            ref_local = tl.load(stats_ptr + (rank * rows + r) * NUM_STATS + I_SMAX, mask=rmask, other=0.0)
            ref_local = tl.where(ref_local > float("-inf"), ref_local, 0.0)
            support_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
            for t in tl.static_range(TP):
                rank_support_max = tl.load(stats_ptr + (t * rows + r) * NUM_STATS + I_SMAX, mask=rmask, other=0.0)
                support_max = tl.maximum(support_max, rank_support_max)
            support_max = tl.where(support_max > float("-inf"), support_max, row_max)
            support_sum = tl.zeros([BLOCK_R], tl.float32)
            for t in tl.static_range(TP):
                base = stats_ptr + (t * rows + r) * NUM_STATS
                rank_support_max = tl.load(base + I_SMAX, mask=rmask, other=0.0)
                w_s = tl.where(rank_support_max > float("-inf"),
                               tl.exp((rank_support_max - support_max) * inv_tau), 0.0)
                support_sum += tl.load(base + I_SSUM, mask=rmask, other=0.0) * w_s
            shift = (support_max - ref_local) * inv_tau + tl.log(tl.maximum(support_sum, FP32_TINY))
        if SUMS == SUMS_LOADED:
            f_sum = tl.load(sums_ptr + r * 2, mask=rmask, other=0.0)
            h_sum = tl.load(sums_ptr + r * 2 + 1, mask=rmask, other=0.0)
        else:
            f_sum, h_sum = _support_sums(zs_ptr, owned_ptr, log_target_ptr, r, rmask, K, ref_local, shift, inv_tau,
                                         jsd_beta, log_beta, log1m_beta, DIVERGENCE, BLOCK_R, BLOCK_KT, K_TILES)
        if SUMS == SUMS_PARTIAL:
            tl.store(sums_ptr + r * 2, f_sum, mask=rmask)
            tl.store(sums_ptr + r * 2 + 1, h_sum, mask=rmask)
        else:
            if GHOST:
                rest_p = tl.load(rest_mass_ptr + r, mask=rmask, other=0.0)
                f_r, g_r = _ghost_rest(rest_p, student_rest, jsd_beta, DIVERGENCE)
                kd = f_sum + f_r
                dense = student_mass * g_r - h_sum
                center = g_r
            else:
                kd = f_sum
                dense = tl.zeros([BLOCK_R], tl.float32)
                center = h_sum
            tl.store(kd_ptr + r, kd, mask=rmask)
            if HAS_LABELS:
                tl.store(ce_ptr + r, row_max + tl.log(sum_1) - label_logit, mask=rmask)
            if NEED_GRAD:
                rho = tl.load(rho_ptr + r, mask=rmask, other=0.0)
                kd_scale = kd_grad_weight * rho
                alpha = kd_scale * dense * scale_t
                if CE_GRAD:
                    alpha = _ce_grad(alpha, rho, r, rmask, w_rank_1, sum_1, ce_weight, beta_ptr, label_sparse_ptr,
                                     label_owned_ptr, SEPARATE_BETA)
                tl.store(alpha_ptr + r, alpha, mask=rmask)
                tl.store(sparse_scale_ptr + r, -kd_scale, mask=rmask)
                tl.store(shift_ptr + r, shift, mask=rmask)
                tl.store(center_ptr + r, center, mask=rmask)


@triton.jit
def _dense_grad(z, m, alpha, beta, scale_t, HAS_BETA: tl.constexpr):
    g = alpha * tl.exp2((z - m) * scale_t)
    if HAS_BETA:
        g += beta * tl.exp2((z - m) * LOG2E)
    return g


@triton.jit
def grad_fixup_kernel(
    x_ptr, x_stride,  # in: E from exp_stats_kernel; out: X, with dLoss/dz = σ·X
    stats_ptr, zs_ptr, ref_ptr,  # [c, NUM_STATS], [c, K] z_S and [c, NUM_TILES] from exp_stats_kernel
    alpha_ptr, beta_ptr, sparse_scale_ptr, ghost_ptr,  # [c] from row_terms_kernel
    idx_ptr, owned_ptr, target_ptr,  # [c, K]
    label_idx_ptr, label_owned_ptr, label_sparse_ptr,  # [c]
    sigma_ptr,  # out: [c] σ
    log_target_ptr, shift_ptr, center_ptr,  # reverse / jsd: [c, K] log P_v, [c] from row_terms_kernel
    K, scale_t, tau, inv_tau, jsd_beta, log_beta, log1m_beta,
    V: tl.constexpr, NUM_TILES: tl.constexpr, NUM_STATS: tl.constexpr, I_MAX: tl.constexpr, I_LABEL: tl.constexpr,
    HAS_BETA: tl.constexpr, GHOST: tl.constexpr, HAS_LABELS: tl.constexpr,
    DIVERGENCE: tl.constexpr, SPARSE_ONLY: tl.constexpr, SUPPORT_FRAME: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """SPARSE_ONLY: the gradient has no dense part (renorm reverse / jsd without a CE gradient), the
    block holds zeros (exp_stats_kernel's WRITE_ZEROS) and only the sparse entries are written, σ = 1.
    SUPPORT_FRAME (renorm reverse / jsd): log Q_v is taken from this rank's largest entry, not its row
    max (row_terms_kernel's shift is relative to it)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    ref = tl.load(stats_ptr + row * NUM_STATS + I_MAX)
    alpha = tl.load(alpha_ptr + row)
    beta = 0.0
    if HAS_BETA:
        beta = tl.load(beta_ptr + row)

    k = tl.arange(0, BLOCK_K)
    kmask = k < K
    idx = tl.load(idx_ptr + row * K + k, mask=kmask, other=-1).to(tl.int32)  # V_local < 2^31; half the registers
    owned = tl.load(owned_ptr + row * K + k, mask=kmask, other=0.0) != 0
    z_s = tl.load(zs_ptr + row * K + k, mask=kmask, other=0.0)
    if DIVERGENCE == 0:
        # The teacher entries' own term: -kd_scale·B_v (+ the ghost tail's r·q_v, q_v from the local reference).
        sparse = tl.load(sparse_scale_ptr + row) * tl.load(target_ptr + row * K + k, mask=kmask, other=0.0)
        if GHOST:
            q_local = tl.exp2((tl.where(owned, z_s, ref) - ref) * scale_t)
            sparse += tl.where(owned, tl.load(ghost_ptr + row) * q_local, 0.0)
    else:  # kd_scale·Q_v·(g_v - center), log Q_v in the form row_terms_kernel summed it
        log_p = tl.load(log_target_ptr + row * K + k, mask=kmask & owned, other=0.0)
        base = ref
        if SUPPORT_FRAME:
            base = tl.max(tl.where(owned, z_s, float("-inf")), axis=0)
            base = tl.where(base > float("-inf"), base, 0.0)
        log_q = tl.where(owned, (z_s - base) * inv_tau - tl.load(shift_ptr + row), 0.0)
        _f, g, q = _entry_terms(log_q, log_p, jsd_beta, log_beta, log1m_beta, DIVERGENCE)
        sparse = tl.where(owned, tl.load(sparse_scale_ptr + row) * q * (tl.load(center_ptr + row) - g), 0.0)
    # Total sparse term at each entry's column, summed over duplicates of that column. (A genuine
    # top-K has none, but the cache format allows them. This K x K comparison costs ~6% of the
    # old gradient pass at K = 100; summing duplicates once per call instead measured no cheaper: a
    # per-row sort of [T, K] took 0.4 ms, the same comparison as its own pass 1.5 ms per 32K tokens.)
    same = (idx[:, None] == idx[None, :]) & owned[None, :]
    g_s = tl.sum(tl.where(same, sparse[None, :], 0.0), axis=1)
    if not SPARSE_ONLY:
        g_s += _dense_grad(z_s, ref, alpha, beta, scale_t, HAS_BETA)
    if HAS_LABELS:
        label_idx = tl.load(label_idx_ptr + row)
        label_owned = tl.load(label_owned_ptr + row) != 0
        label_sparse = tl.load(label_sparse_ptr + row)
        g_s += tl.where(idx == label_idx, label_sparse, 0.0)
        z_label = tl.load(stats_ptr + row * NUM_STATS + I_LABEL)
        g_label = (_dense_grad(z_label, ref, alpha, beta, scale_t, HAS_BETA) + label_sparse
                   + tl.sum(tl.where(owned & (idx == label_idx), sparse, 0.0), axis=0))
    largest = tl.max(tl.where(owned, tl.abs(g_s), 0.0), axis=0)  # the sparse entries' final values
    if HAS_LABELS:
        largest = tl.maximum(largest, tl.where(label_owned, tl.abs(g_label), 0.0))
    if SPARSE_ONLY:
        whole = False
        sigma = alpha * 0.0 + 1.0
        raised = False
    else:
        whole = (largest > SPARSE_RATIO * tl.abs(alpha)) | (beta != 0.0)
        sigma = tl.where(whole, 1.0, alpha)
        raised = tl.load(ref_ptr + row * NUM_TILES) < ref  # references only rise along the row
    if whole | raised:
        cols = tl.arange(0, BLOCK_V)
        for t in range(NUM_TILES):
            offs = t * BLOCK_V + cols
            e = tl.load(x_row + offs, mask=offs < V, other=0.0).to(tl.float32)
            e *= tl.exp2((tl.load(ref_ptr + row * NUM_TILES + t) - ref) * scale_t)  # to the row's final r
            x = tl.where(whole, alpha * e, e)
            if HAS_BETA:
                x += beta * tl.exp2(tl.log2(e) * tau)  # exp(z - r) = E^τ
            tl.store(x_row + offs, x.to(x_ptr.dtype.element_ty), mask=offs < V)
        # The sparse stores below must land after every thread's dense stores to the same columns.
        tl.debug_barrier()
    inv_sigma = tl.where(sigma != 0.0, 1.0 / tl.where(sigma != 0.0, sigma, 1.0), 0.0)  # σ = α = 0: all terms 0
    if HAS_LABELS:
        tl.store(x_row + label_idx, (g_label * inv_sigma).to(x_ptr.dtype.element_ty), mask=label_owned)
    tl.store(x_row + idx, (g_s * inv_sigma).to(x_ptr.dtype.element_ty), mask=kmask & owned)
    tl.store(sigma_ptr + row, sigma)


@triton.jit
def scale_rows_kernel(src_ptr, src_stride, scale_ptr, dst_ptr, dst_stride, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """dst[r] = scale[r]·src[r] in dst's dtype ([rows, N], unit column stride); one program per row."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        v = tl.load(src_ptr + row * src_stride + offs, mask=offs < N, other=0.0).to(tl.float32) * scale
        tl.store(dst_ptr + row * dst_stride + offs, v.to(dst_ptr.dtype.element_ty), mask=offs < N)


def scale_rows(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = scale[:, None]·src, computed in fp32 and stored in out's dtype: the row scale σ of
    ``grad_fixup_`` on the chunk's grad_h and h ([c, h]; one read and one write, where torch's
    broadcast multiply with a dtype cast ran at a third of HBM speed)."""
    src = src if src.stride(1) == 1 else src.contiguous()
    assert out.stride(1) == 1 and src.shape == out.shape
    rows, n = src.shape
    scale_rows_kernel[(rows,)](src, src.stride(0), scale, out, out.stride(0), N=n,
                               BLOCK_N=min(1024, triton.next_power_of_2(n)), num_warps=4)
    return out


def exp_row_stats_(
    block: torch.Tensor,
    teacher: chunk_math.ChunkTeacher,
    label_idx: torch.Tensor | None,
    label_owned: torch.Tensor | None,
    temperature: float,
    *,
    write: bool,
    zeros: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The contract of ``chunk_torch.local_row_stats_`` (stats, z_S), and with ``write`` the block
    overwritten by E and the reference each tile used ([c, tiles], for ``grad_fixup_``); without it
    the block is left intact and no references are returned. ``zeros`` (with ``write``): the block is
    overwritten by 0 instead, for a gradient without a dense part (``RowTerms.sparse_only``)."""
    rows, vocab_local = block.shape
    k = teacher.local_idx.shape[1]
    stats = torch.empty(rows, NUM_ROW_STATS, dtype=torch.float32, device=block.device)
    z_s = torch.empty(rows, k, dtype=torch.float32, device=block.device)
    block_v, warps = _launch_config(vocab_local)
    tiles = triton.cdiv(vocab_local, block_v)
    keep_refs = write and not zeros
    refs = torch.empty(rows, tiles, dtype=torch.float32, device=block.device) if keep_refs else None
    has_labels = label_idx is not None
    separate_sum_1 = has_labels and temperature != 1.0
    scale_t = LOG2E.value / temperature
    exp_stats_kernel[(rows,)](
        block, block.stride(0),
        teacher.local_idx, teacher.owned, teacher.target_owned,
        teacher.repeat if teacher.rest_mass is not None else teacher.owned,
        label_idx if has_labels else stats, label_owned if has_labels else stats,
        stats, z_s, refs if keep_refs else stats,
        k, scale_t, max(scale_t, LOG2E.value) if separate_sum_1 else scale_t,
        V=vocab_local, NUM_TILES=tiles,
        NUM_STATS=NUM_ROW_STATS, I_MAX=ROW_MAX, I_SUM_T=ROW_SUMEXP_T, I_SUM_1=ROW_SUMEXP_1,
        I_TDOT=ROW_TARGET_DOT, I_TSUM=ROW_TEACHER_SUMEXP, I_LABEL=ROW_LABEL_LOGIT, I_REST=ROW_REST_SUMEXP,
        I_SMAX=ROW_SUPPORT_MAX, I_SSUM=ROW_SUPPORT_SUMEXP,
        HAS_LABELS=has_labels, SEPARATE_SUM_1=separate_sum_1, WRITE=write, WRITE_ZEROS=write and zeros,
        REST_SUM=teacher.rest_mass is not None,
        BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(max(k, 1)), num_warps=warps,
    )
    return stats, z_s, refs


@dataclass(frozen=True)
class SupportSpec:
    """A divergence other than "forward" over the cached support, as the kernels take it."""

    divergence: str  # "reverse" | "jsd"
    jsd_beta: float
    tail: str  # "renorm" | "ghost"

    @property
    def code(self) -> int:
        return DIVERGENCE_CODES[self.divergence]

    def beta_args(self) -> tuple[float, float, float]:
        """(β, log β, log(1 - β)) as the kernels take them (unused by reverse)."""
        return self.jsd_beta, math.log(self.jsd_beta), math.log1p(-self.jsd_beta)

    def sparse_only(self, ce_grad: bool) -> bool:
        """renorm's Q depends on z only at the teacher entries: without a CE gradient no dense part."""
        return self.tail == "renorm" and not ce_grad


@dataclass
class RowTerms:
    """Per-row coefficients of dLoss/dz on this rank's block (the GradCoefs of chunk_torch with
    the [c, K] sparse term left as sparse_scale·B_v + ghost·exp((z_v - m_r)/τ), formed in the kernel;
    reverse / jsd: sparse_scale·Q_v·(center - g_v), log Q_v = (z_v - r)/τ - log_q_shift)."""

    alpha: torch.Tensor  # [c]
    beta: torch.Tensor | None  # [c], CE softmax at τ != 1
    sparse_scale: torch.Tensor  # [c] -kd_weight·τ·ρ
    ghost: torch.Tensor | None  # [c] kd_weight·τ·ρ·r·scale_t (ghost tail, forward)
    label_sparse: torch.Tensor | None  # [c] -ce_weight·ρ where this rank owns the label
    support: SupportSpec | None = None  # reverse / jsd
    log_q_shift: torch.Tensor | None = None  # [c] reverse / jsd
    center: torch.Tensor | None = None  # [c] reverse / jsd: H (renorm) or g_rest (ghost)
    sparse_only: bool = False  # no dense part: the block holds zeros, σ = 1


def _launch_row_terms(all_stats, rank, teacher, rho, label_owned, kd_out, ce_out, z_s, sums, outs: dict, *,
                      kd_weight, ce_weight, temperature, tail, need_grad, support: SupportSpec | None, sums_mode):
    tp, rows, _ = all_stats.shape
    has_labels = ce_out is not None
    ce_grad = has_labels and ce_weight != 0
    ptr = lambda t: kd_out if t is None else t  # noqa: E731 (a pointer for what this variant never touches)
    beta, log_beta, log1m_beta = support.beta_args() if support is not None else (0.5, 0.0, 0.0)
    block_r = ROW_TERMS_BLOCK if support is None else ROW_TERMS_SUPPORT_BLOCK
    k = teacher.local_idx.shape[1]
    block_kt = min(ENTRY_TILE, triton.next_power_of_2(max(k, 1)))
    row_terms_kernel[(triton.cdiv(rows, block_r),)](
        all_stats.contiguous(), rows, rank,
        teacher.const, teacher.lse_coef, teacher.mass, ptr(teacher.rest_mass), rho,
        ptr(label_owned if has_labels else None),
        kd_out, ptr(ce_out),
        *(ptr(outs.get(n)) for n in ("alpha", "beta", "sparse_scale", "ghost", "label_sparse")),
        ptr(z_s if support is not None else None), teacher.owned, ptr(teacher.log_target), k,
        ptr(sums), ptr(outs.get("log_q_shift")), ptr(outs.get("center")),
        kd_weight * temperature, ce_weight, 1.0 / temperature, beta, log_beta, log1m_beta,
        TP=tp, NUM_STATS=NUM_ROW_STATS, I_MAX=ROW_MAX, I_SUM_T=ROW_SUMEXP_T, I_SUM_1=ROW_SUMEXP_1,
        I_TDOT=ROW_TARGET_DOT, I_TSUM=ROW_TEACHER_SUMEXP, I_LABEL=ROW_LABEL_LOGIT, I_REST=ROW_REST_SUMEXP,
        I_SMAX=ROW_SUPPORT_MAX, I_SSUM=ROW_SUPPORT_SUMEXP,
        GHOST=tail == "ghost", HAS_LABELS=has_labels, NEED_GRAD=need_grad, CE_GRAD=ce_grad,
        SEPARATE_BETA=ce_grad and temperature != 1.0,
        DIVERGENCE=0 if support is None else support.code, SUMS=sums_mode.value,
        BLOCK_R=block_r, BLOCK_KT=block_kt, K_TILES=triton.cdiv(k, block_kt) if support is not None else 0,
    )


def support_sums(
    all_stats: torch.Tensor,
    rank: int,
    teacher: chunk_math.ChunkTeacher,
    z_s: torch.Tensor,
    *,
    temperature: float,
    support: SupportSpec,
) -> torch.Tensor:
    """[c, 2] this rank's partial F, H (divergences.py) over its own teacher entries, for an
    all-reduce over the TP group before ``row_terms(..., sums=...)`` (TP > 1 only: at TP = 1
    ``row_terms`` sums them itself)."""
    rows = all_stats.shape[1]
    sums = torch.empty(rows, 2, dtype=torch.float32, device=all_stats.device)
    scratch = torch.empty(rows, dtype=torch.float32, device=all_stats.device)
    _launch_row_terms(all_stats, rank, teacher, scratch, None, scratch, None, z_s, sums, {},
                      kd_weight=0.0, ce_weight=0.0, temperature=temperature, tail=support.tail, need_grad=False,
                      support=support, sums_mode=SUMS_PARTIAL)
    return sums


def row_terms(
    all_stats: torch.Tensor,
    rank: int,
    teacher: chunk_math.ChunkTeacher,
    rho: torch.Tensor,
    label_owned: torch.Tensor | None,
    kd_out: torch.Tensor,
    ce_out: torch.Tensor | None,
    *,
    kd_weight: float,
    ce_weight: float,
    temperature: float,
    tail: str,
    need_grad: bool,
    support: SupportSpec | None = None,
    z_s: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
) -> RowTerms | None:
    """[tp, c, NUM_ROW_STATS] from every rank -> per-token KD (and CE) into ``kd_out`` (``ce_out``),
    and the gradient's per-row terms when ``need_grad``. ``support`` (reverse / jsd) needs ``z_s``
    and, under TP, the all-reduced ``support_sums`` as ``sums``."""
    rows = all_stats.shape[1]
    has_labels = ce_out is not None
    ce_grad = has_labels and ce_weight != 0
    separate_beta = ce_grad and temperature != 1.0

    def grad_out(wanted: bool) -> torch.Tensor | None:
        return torch.empty(rows, dtype=torch.float32, device=all_stats.device) if need_grad and wanted else None

    outs = dict(alpha=grad_out(True), sparse_scale=grad_out(True), beta=grad_out(separate_beta),
                ghost=grad_out(tail == "ghost" and support is None), label_sparse=grad_out(ce_grad),
                log_q_shift=grad_out(support is not None), center=grad_out(support is not None))
    if support is None:
        mode = SUMS_NONE
    else:
        assert z_s is not None and (sums is not None or all_stats.shape[0] == 1), "reverse / jsd at TP > 1: sums"
        mode = SUMS_INLINE if sums is None else SUMS_LOADED
    _launch_row_terms(all_stats, rank, teacher, rho, label_owned, kd_out, ce_out, z_s, sums, outs,
                      kd_weight=kd_weight, ce_weight=ce_weight, temperature=temperature, tail=tail,
                      need_grad=need_grad, support=support, sums_mode=mode)
    if not need_grad:
        return None
    return RowTerms(**{n: outs[n] for n in ("alpha", "beta", "sparse_scale", "ghost", "label_sparse")},
                    support=support, log_q_shift=outs["log_q_shift"], center=outs["center"],
                    sparse_only=support is not None and support.sparse_only(ce_grad))


def grad_fixup_(
    block: torch.Tensor,
    local_stats: torch.Tensor,
    z_s: torch.Tensor,
    refs: torch.Tensor | None,
    terms: RowTerms,
    teacher: chunk_math.ChunkTeacher,
    label_idx: torch.Tensor | None,
    label_owned: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """E (``exp_row_stats_(write=True)``; zeros with ``terms.sparse_only``) -> (X, σ) in place,
    dLoss/dz = σ[:, None]·X (see ``RowTerms``)."""
    rows, vocab_local = block.shape
    k = teacher.local_idx.shape[1]
    has_labels = terms.label_sparse is not None
    alpha = terms.alpha
    sigma = torch.empty(rows, dtype=torch.float32, device=block.device)
    block_v, _ = _launch_config(vocab_local)
    support = terms.support
    assert not (terms.sparse_only and (has_labels or terms.beta is not None))  # no CE gradient there
    beta, log_beta, log1m_beta = support.beta_args() if support is not None else (0.5, 0.0, 0.0)
    warps = FIXUP_NUM_WARPS
    grad_fixup_kernel[(rows,)](
        block, block.stride(0),
        local_stats, z_s, refs if refs is not None else alpha,
        alpha, terms.beta if terms.beta is not None else alpha, terms.sparse_scale,
        terms.ghost if terms.ghost is not None else alpha,
        teacher.local_idx, teacher.owned, teacher.target_owned,
        label_idx if has_labels else alpha, label_owned if has_labels else alpha,
        terms.label_sparse if has_labels else alpha,
        sigma,
        teacher.log_target if support is not None else alpha,
        terms.log_q_shift if support is not None else alpha, terms.center if support is not None else alpha,
        k, LOG2E.value / temperature, float(temperature), 1.0 / temperature, beta, log_beta, log1m_beta,
        V=vocab_local, NUM_TILES=triton.cdiv(vocab_local, block_v), NUM_STATS=NUM_ROW_STATS, I_MAX=ROW_MAX,
        I_LABEL=ROW_LABEL_LOGIT,
        HAS_BETA=terms.beta is not None, GHOST=terms.ghost is not None, HAS_LABELS=has_labels,
        DIVERGENCE=0 if support is None else support.code, SPARSE_ONLY=terms.sparse_only,
        SUPPORT_FRAME=support is not None and support.tail == "renorm",
        BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(max(k, 1)), num_warps=warps,
    )
    return block, sigma
