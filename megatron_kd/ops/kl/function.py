"""Chunk loop and autograd.Function of ``fused_topk_kl``.

Once per call: the teacher terms of all T tokens ([T, K], as big as the cached inputs themselves)
and the labels' shard columns. Per chunk of c tokens (three GEMMs in all, the floor):

    z   = h_c · W_localᵀ                      GEMM 1                      [c, V_local]
    local row stats                            torch: local_row_stats_; Triton: exp_row_stats_
                                               (which also turns z into E = exp((z - r)/τ) in place)
    all-gather [c, 6] across the TP group      one small collective
    combine, losses, gradient coefficients     torch ops, or one Triton kernel (row_terms)
    -> G = dLoss/dz in place                   torch: logit_grad_; Triton: grad_fixup_ (G = σ·X)
    grad_h[c]  = G · W_local                   GEMM 2 (Triton: σ scales the product's rows)
    grad_W    += Gᵀ · h_c                      GEMM 3, fp32 accumulation (Triton: of Xᵀ·(σ·h_c))
Per-token losses land in [T] buffers, summed once after the loop. divergence="reverse" / "jsd" add,
after the combine, two per-row sums over the teacher entries (divergences.py; Triton:
row_terms_kernel), all-reduced across the TP group as [c, 2] when tp > 1.

impl "torch": the block is fp32 (fp64 for fp64 inputs) and plain torch ops walk it; on CUDA with
bf16/fp16 inputs G is cast to a low-precision copy for GEMMs 2-3.
impl "triton" (CUDA): the block is in the input dtype, read and written once per chunk
(chunk_triton.py), and handed to GEMMs 2-3 as it is. Only one block is alive at a time.
Gradients are complete when forward returns; backward multiplies them by the incoming gradient.
Under TP, grad_h is a partial sum over vocabulary shards: all-reduced at the end, or
reduce-scattered back to the sequence shard under sequence parallelism.
"""

from __future__ import annotations

import torch

from megatron_kd.ops.comm import (
    all_gather_stack,
    all_reduce_sum_,
    gather_first_dim,
    group_rank,
    reduce_scatter_first_dim,
)
from megatron_kd.ops.common import accumulation_dtype, auto_chunk_size, chunk_logits, mixed_gemms
from megatron_kd.ops.kl import chunk_torch as chunk_math
from megatron_kd.ops.kl.options import TopKKLOptions
from megatron_kd.ops.kl.value_checks import HostCopy, PendingValueChecks

_MiB = 1 << 20
# Triton path: the block (in the GEMM dtype, no copy) may be as large as one weight gradient in that
# dtype plus _TRITON_BLOCK_ALLOWANCE, less what the call holds besides it. Why: the weight-gradient
# GEMM read-modify-writes the fp32 accumulator (main_grad) once per chunk, so fewer, longer chunks
# are faster; and the backward holds a weight-sized gradient tensor anyway (the bf16 gradient, or
# the stand-in Megatron's DDP protocol asks for), which the block, freed before it, costs no extra
# peak. So the op stays within the allowance above its inputs, gradients and that tensor. Measured
# on an H200 at T = 32K, h = 2880, V = 201,088 (benchmarks/RESULTS.md): 1280-token chunks 207 ms,
# 2048 194 ms, 2752 (12 chunks) 185-187 ms, 4096 (8) 182.9 ms, 8192 (4) 178.0 ms.
_TRITON_BLOCK_ALLOWANCE = 512 * _MiB
# ... but never fewer rows than this, however much the call holds: that read-modify-write (8·V·h
# bytes) against the chunk's three GEMMs (6·c·V·h FLOPs) costs ~210/c of the GEMM time on an H200
# (~700 TFLOP/s over ~4.3 TB/s), ~5% at 4,096 rows. Long inputs hold the most besides the block
# ([T, K] teacher terms): at T = 256K, h = 3072, V = 128,256 the allowance alone left 2,048-row
# chunks, 1.123x the GEMM floor where 32K ran at 1.071x (benchmarks/RESULTS.md, 2026-12-02).
_TRITON_MIN_CHUNK_ROWS = 4096
# What the call holds besides the block and its per-row buffers: per teacher entry ([T, K] ids,
# masks and targets, and the teacher terms' temporaries) and per token (losses, weights, labels).
# Measured on an H200 at T = 32K, K = 100: 90 MB besides the block, 27 bytes per entry.
_HELD_BYTES_PER_ENTRY = 28
_HELD_BYTES_PER_TOKEN = 64


def triton_row_bytes(vocab_local: int, hidden: int, k: int, *, itemsize: int) -> int:
    """Bytes of one row of the Triton path's chunk: its logits / gradient row in the input dtype,
    its fp32 grad_h row (then its σ-scaled h), and its per-row statistics over the K entries."""
    return vocab_local * itemsize + 4 * hidden + 4 * k


def triton_block_budget(gradient: int, num_tokens: int, k: int, *, row_bytes: int, divergence: str = "forward") -> int:
    """Bytes for the CUDA (Triton) path's block and per-row buffers, given the bytes of one weight
    gradient in the weight's dtype and of one block row with its buffers (also ``megatron-kd
    plan``'s model of the loss). Reverse / jsd hold one more fp32 [T, K] teacher tensor (log P_v)."""
    per_entry = _HELD_BYTES_PER_ENTRY + (4 if divergence != "forward" else 0)
    held = num_tokens * (k * per_entry + _HELD_BYTES_PER_TOKEN)
    return max(_TRITON_MIN_CHUNK_ROWS * row_bytes, gradient + _TRITON_BLOCK_ALLOWANCE - held)


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b, where out may be fp32 with low-precision operands (one mixed GEMM on CUDA)."""
    if a.dtype != out.dtype:
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return torch.mm(a, b, out=out)


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with low-precision operands and an fp32 accumulator (CUDA)."""
    torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)


def topk_kl_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    opts: TopKKLOptions,
    value_checks: PendingValueChecks,
    need_grad_hidden: bool,
    need_grad_weight: bool,
):
    """Loss, stats [4] and the gradients (grad_hidden, grad_weight or None for each).

    ``value_checks`` (from ``check_inputs``) is launched behind the first logits GEMM and read once
    the first chunk's passes are queued, before its gradient GEMMs: before the weight gradient goes
    into ``main_grad``, the first write outside the op's own buffers.
    """
    group = opts.tp_group
    rank = group_rank(group)
    tau = float(opts.temperature)
    acc = accumulation_dtype(hidden.dtype)
    use_triton = opts.impl == "triton"
    if use_triton:
        from megatron_kd.ops.kl import chunk_triton
    mixed = mixed_gemms(hidden)
    has_labels = labels is not None
    fuse_main_grad = need_grad_weight and opts.gradient_accumulation_fusion

    full_hidden = gather_first_dim(hidden, group) if opts.sequence_parallel else hidden
    h2d = full_hidden.reshape(-1, full_hidden.shape[-1])
    num_tokens, vocab_local = h2d.shape[0], weight.shape[0]
    vocab_start = rank * vocab_local
    ids2d = topk_ids.reshape(num_tokens, -1)
    lps2d = topk_logprobs.reshape(num_tokens, -1)
    labels1d = labels.reshape(num_tokens) if has_labels else None
    need_grad = need_grad_hidden or need_grad_weight
    # reverse / jsd over the cached support: the Triton kernels' spec, or the torch path's module
    support = support_math = None
    sparse_only = False  # Triton: a gradient without a dense part (the block is zeroed, not exponentiated)
    if opts.divergence != "forward":
        if use_triton:
            support = chunk_triton.SupportSpec(opts.divergence, float(opts.jsd_beta), opts.tail)
            sparse_only = need_grad and support.sparse_only(has_labels and opts.ce_weight != 0)
        else:
            from megatron_kd.ops.kl import divergences as support_math
    # Triton: logits and their gradient share one block in the input dtype. Torch: an fp32 block,
    # plus a low-precision copy of G for mixed-precision GEMMs.
    block_dtype = hidden.dtype if use_triton else acc
    gemm_dtype = hidden.dtype if (mixed or use_triton) else acc
    # Triton: besides the block's row, a chunk's fp32 grad_h (then its σ-scaled h) and per-row statistics
    row_bytes = triton_row_bytes(vocab_local, h2d.shape[1], ids2d.shape[1], itemsize=block_dtype.itemsize)
    chunk = opts.chunk_size or auto_chunk_size(
        num_tokens, vocab_local, device=hidden.device, block_dtype=block_dtype, gemm_dtype=gemm_dtype,
        extra_block=has_labels and tau != 1.0 and not use_triton,
        budget_bytes=triton_block_budget(weight.numel() * weight.element_size(), num_tokens, ids2d.shape[1],
                                         row_bytes=row_bytes, divergence=opts.divergence) if use_triton else None,
        row_extra_bytes=row_bytes - vocab_local * block_dtype.itemsize if use_triton else 0,
    )
    # CPU with bf16/fp16 inputs: one upcast copy of the shard (no mixed-precision GEMMs there).
    w_gemm = weight if gemm_dtype == weight.dtype else weight.to(acc)
    block_buf = first_block = None
    if use_triton:  # reused by every chunk: logits in, gradient out
        block_buf = torch.empty(min(chunk, num_tokens), vocab_local, dtype=block_dtype, device=hidden.device)
        # The first chunk's logits are queued before the per-call work below, so the GPU computes
        # them while the host launches that.
        first_block = torch.mm(h2d[: len(block_buf)], w_gemm.t(), out=block_buf)
    value_checks.launch()

    mask = loss_mask.reshape(num_tokens).to(acc) if loss_mask is not None else h2d.new_ones(num_tokens, dtype=acc)
    tokens = mask.sum()
    if opts.reduction == "mean":
        inv_tokens = torch.where(tokens > 0, 1.0 / tokens.clamp_min(1e-30), 0.0)
        row_weight = mask * inv_tokens  # ρ
    else:
        inv_tokens = None
        row_weight = mask

    # Teacher terms and label columns once for all tokens ([T, K]: the size of the cache inputs),
    # per-token losses into [T] buffers summed after the loop: per chunk, only the work that needs
    # its logits is launched. (triton_block_budget counts them and their temporaries.)
    teacher_all = chunk_math.teacher_terms(
        ids2d, lps2d, tail=opts.tail, temperature=tau, vocab_start=vocab_start, vocab_local=vocab_local, dtype=acc,
        divergence=opts.divergence,
    )
    label_idx_all = label_owned_all = None
    if has_labels:
        label_idx_all, label_owned_all = chunk_math.local_labels(
            labels1d, vocab_start=vocab_start, vocab_local=vocab_local, dtype=acc
        )
    kd_rows = torch.empty(num_tokens, dtype=acc, device=hidden.device)
    ce_rows = torch.empty(num_tokens, dtype=acc, device=hidden.device) if has_labels else None

    grad_h2d = torch.empty_like(h2d) if need_grad_hidden else None
    grad_w_acc = None
    if need_grad_weight:
        if fuse_main_grad:
            grad_w_acc = weight.main_grad
        else:
            grad_w_acc = torch.zeros(weight.shape, dtype=acc, device=weight.device)

    row_buf = None
    if use_triton and need_grad:  # per chunk: grad_h's fp32 product, then σ·h_c for GEMM 3 (grad_fixup_'s σ)
        row_buf = torch.empty(len(block_buf), h2d.shape[1], dtype=acc, device=hidden.device)

    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        h_c = h2d[start:end]
        h_c_gemm = h_c if gemm_dtype == h_c.dtype else h_c.to(acc)
        if use_triton:
            block = first_block if start == 0 else torch.mm(h_c_gemm, w_gemm.t(), out=block_buf[: end - start])
        else:
            block = chunk_logits(h_c_gemm, w_gemm, acc)

        teacher = teacher_all.rows(start, end)
        rho = row_weight[start:end]
        label_idx = label_owned = None
        if has_labels:
            label_idx, label_owned = label_idx_all[start:end], label_owned_all[start:end]
        row_scale = None  # G = row_scale[:, None]·g where the Triton path leaves a row scale
        if use_triton:
            local, z_s, refs = chunk_triton.exp_row_stats_(block, teacher, label_idx, label_owned, tau,
                                                            write=need_grad, zeros=sparse_only)
            all_stats = all_gather_stack(local, group)
            sums = None
            if support is not None and all_stats.shape[0] > 1:  # reverse / jsd under TP: sums over S of all ranks
                sums = all_reduce_sum_(chunk_triton.support_sums(all_stats, rank, teacher, z_s, temperature=tau,
                                                                   support=support), group)
            terms = chunk_triton.row_terms(
                all_stats, rank, teacher, rho, label_owned,
                kd_rows[start:end], ce_rows[start:end] if has_labels else None,
                kd_weight=opts.kd_weight, ce_weight=opts.ce_weight, temperature=tau, tail=opts.tail,
                need_grad=need_grad, support=support, z_s=z_s, sums=sums,
            )
            if need_grad:
                g, row_scale = chunk_triton.grad_fixup_(
                    block, local, z_s, refs, terms, teacher, label_idx, label_owned, tau
                )
        else:
            local, z_s = chunk_math.local_row_stats_(block, teacher, label_idx, label_owned, tau)
            rs = chunk_math.combine_row_stats(all_gather_stack(local, group), rank, tau, has_labels)
            kd_rows[start:end], ce = chunk_math.row_losses(teacher, rs, tau, opts.tail)
            if has_labels:
                ce_rows[start:end] = ce
            if support_math is not None:  # reverse / jsd: the per-row sums over S, summed over ranks
                sterms = support_math.support_terms(z_s, teacher, rs, tau, opts.tail, opts.divergence, opts.jsd_beta)
                kd_rows[start:end], dense, center = support_math.support_losses(
                    all_reduce_sum_(sterms.sums, group), teacher, rs, opts.tail, opts.divergence,
                    opts.jsd_beta)
            if need_grad:
                ce_scale = opts.ce_weight * rho if (has_labels and opts.ce_weight != 0) else None
                if support_math is None:
                    coefs = chunk_math.grad_coefficients(
                        z_s, teacher, rs, (opts.kd_weight * tau) * rho, ce_scale, label_owned, tau, opts.tail
                    )
                else:
                    coefs = support_math.support_grad_coefficients(
                        sterms, dense, center, rs, (opts.kd_weight * tau) * rho, ce_scale, label_owned, tau)
                g = chunk_math.logit_grad_(block, coefs, teacher, label_idx, tau)
                g = g.to(gemm_dtype)  # no copy unless mixed-precision GEMMs follow

        if start == 0:  # before any write outside the op's buffers; the GPU has work queued meanwhile
            value_checks.raise_if_bad()
            _check_previous_grad_loss(weight)
        if need_grad:
            rows = end - start
            if need_grad_hidden:
                if row_scale is not None:  # fp32 product, scaled and cast into place
                    chunk_triton.scale_rows(_mm_into(g, w_gemm, row_buf[:rows]), row_scale, grad_h2d[start:end])
                elif g.dtype == grad_h2d.dtype:
                    torch.mm(g, w_gemm, out=grad_h2d[start:end])
                else:  # CPU with bf16/fp16 inputs: GEMM in fp32, cast on store
                    grad_h2d[start:end] = g @ w_gemm
            if need_grad_weight:
                h_w = h_c_gemm
                if row_scale is not None:  # Gᵀ·h = Xᵀ·(σ·h)
                    hs = row_buf.view(h_c_gemm.dtype)[:rows, : h_c.shape[1]]  # grad_h's product is used up
                    h_w = chunk_triton.scale_rows(h_c_gemm, row_scale, hs)
                if g.dtype != grad_w_acc.dtype:
                    _addmm_fp32_(grad_w_acc, g.t(), h_w)
                else:
                    grad_w_acc.addmm_(g.t(), h_w)
            del g
        del block

    row_loss = (opts.kd_weight * tau * tau) * kd_rows
    if has_labels and opts.ce_weight != 0:
        row_loss = row_loss + opts.ce_weight * ce_rows
    loss = torch.dot(row_weight, row_loss)
    per_row = torch.stack([kd_rows, ce_rows if has_labels else torch.zeros_like(kd_rows), teacher_all.mass])
    sums = per_row @ mask  # Σρ'·kd, Σρ'·ce, Σρ'·M
    stats = torch.cat([sums * inv_tokens if inv_tokens is not None else sums, tokens.reshape(1)])

    grad_hidden = None
    if need_grad_hidden:
        grad_full = grad_h2d.view(full_hidden.shape)
        if opts.sequence_parallel:
            grad_hidden = reduce_scatter_first_dim(grad_full, group)
        else:
            grad_hidden = all_reduce_sum_(grad_full, group)
    grad_weight = None
    if need_grad_weight and not fuse_main_grad:
        grad_weight = grad_w_acc if grad_w_acc.dtype == weight.dtype else grad_w_acc.to(weight.dtype)
    return loss, stats, grad_hidden, grad_weight


# With main_grad fusion the weight gradient is added in forward, for an incoming gradient of 1.
# Reading grad_loss in backward would stall the host until the forward's GEMMs finish (and every
# backward kernel behind them), so backward leaves a HostCopy of it on the weight and the op's next
# call on that weight checks it, where it waits for its own value checks anyway.
_GRAD_LOSS_ATTR = "_fused_topk_kl_grad_loss"


def _check_previous_grad_loss(weight: torch.Tensor) -> None:
    pending = weight.__dict__.pop(_GRAD_LOSS_ATTR, None)
    if pending is not None and (got := pending.get().item()) != 1.0:
        raise RuntimeError(
            "fused_topk_kl(gradient_accumulation_fusion=True) adds the weight gradient to main_grad "
            f"in forward, so the loss must be backpropagated with gradient 1; the previous backward "
            f"passed {got}, and main_grad holds that step's gradient unscaled: train in bf16 with "
            "per-token loss (no loss scaling)"
        )


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """Stand-in weight gradient once the real one went into main_grad, as Megatron's own linear
    layers return: DDP's backward hook needs a .grad to fire (and then drops it without adding it,
    seeing grad_added_to_main_grad); zeros where Megatron asks for them (zero_out_wgrad)."""
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


class FusedTopKKLFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts: TopKKLOptions,
                value_checks: PendingValueChecks):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, stats, grad_hidden, grad_weight = topk_kl_forward(
            hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts, value_checks, need_h, need_w
        )
        # Saved (not ctx attributes) so autograd frees them right after backward and AccumulateGrad
        # can adopt grad_weight as .grad without a copy.
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.fused_weight = weight if (need_w and opts.gradient_accumulation_fusion) else None
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        grad_hidden, grad_weight = ctx.saved_tensors
        # No host sync here: scaling by grad_loss (1 in training: per-token loss) costs less than
        # reading it, and the fused case checks it at its next call. Out of place: a retained graph
        # may be backpropagated again.
        if ctx.fused_weight is None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
            grad_weight = grad_weight * grad_loss.to(grad_weight.dtype) if grad_weight is not None else None
        else:
            weight = ctx.fused_weight
            setattr(weight, _GRAD_LOSS_ATTR, HostCopy(grad_loss.detach()))
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                grad_weight = _dummy_wgrad(weight)
        return grad_hidden, grad_weight, None, None, None, None, None, None
