"""Baseline top-K KL losses for ``bench_loss.py``: tail="none", τ = 1, sum over tokens, one device.

Both compute  L = Σ_t Σ_k p_tk (log p_tk − log q_t[id_tk]),  q_t = softmax(h_t · Wᵀ),  p = exp(logprobs)
from hidden [T, h], weight [V, h], teacher ids [T, K] (int64, no padding) and logprobs [T, K].

forward_chunked_kl  keeps the logits z = h·Wᵀ [T, V] in the input dtype (autograd's graph of one
                    matmul) and evaluates the loss per token chunk under activation checkpointing,
                    so only one fp32 [chunk, V] block is alive at a time.
recompute_fused_kl  never keeps [T, V] (the published "three projection" design): forward pass 1
                    computes each token's logsumexp, pass 2 recomputes the logits for the loss,
                    backward recomputes them a third time and projects dL/dz = M·softmax(z) − p
                    (p scattered at the teacher ids, M = Σ p) to grad_hidden and grad_weight.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

BLOCK_BYTES = 256 * 2**20  # default budget for one fp32 [chunk, V] logits block


def default_chunk(vocab: int) -> int:
    """Tokens per chunk for an fp32 [chunk, V] block of at most BLOCK_BYTES (whole 64-row tiles)."""
    chunk = max(1, BLOCK_BYTES // (vocab * 4))
    return chunk - chunk % 64 if chunk >= 128 else chunk


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def _logits(h_c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h_c · Wᵀ in the accumulation dtype: one bf16 GEMM with fp32 output on CUDA; CPU GEMMs have
    no out_dtype, so there the operands are upcast."""
    acc = _acc(h_c)
    if h_c.dtype == acc:
        return h_c @ w.t()
    if h_c.is_cuda:
        return torch.mm(h_c, w.t(), out_dtype=acc)
    return h_c.to(acc) @ w.to(acc).t()


def _addmm_acc_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b with out in the accumulation dtype and a, b possibly low precision."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def _chunk_kl(z: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor) -> torch.Tensor:
    log_q = torch.log_softmax(z.to(_acc(z)), dim=-1).gather(1, ids)
    lps = lps.to(log_q.dtype)
    return (lps.exp() * (lps - log_q)).sum()


def forward_chunked_kl(hidden, weight, ids, lps, chunk_size: int | None = None) -> torch.Tensor:
    z = hidden @ weight.t()
    chunk = chunk_size or default_chunk(weight.shape[0])
    # split (not slicing): its backward concatenates the chunk gradients once, where slices would
    # each add a zero-padded [T, V] gradient.
    parts = [
        checkpoint(_chunk_kl, z_c, ids_c, lps_c, use_reentrant=False)
        for z_c, ids_c, lps_c in zip(z.split(chunk), ids.split(chunk), lps.split(chunk))
    ]
    return torch.stack(parts).sum()


class RecomputeFusedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, lps, chunk):
        acc, num_tokens = _acc(hidden), hidden.shape[0]
        lse = torch.empty(num_tokens, dtype=acc, device=hidden.device)
        for s in range(0, num_tokens, chunk):  # projection 1: row logsumexp
            lse[s:s + chunk] = torch.logsumexp(_logits(hidden[s:s + chunk], weight), dim=-1)
        lps = lps.to(acc)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, num_tokens, chunk):  # projection 2: log q at the teacher ids
            log_q = _logits(hidden[s:s + chunk], weight).gather(1, ids[s:s + chunk]) - lse[s:s + chunk, None]
            loss += (lps[s:s + chunk].exp() * (lps[s:s + chunk] - log_q)).sum()
        ctx.save_for_backward(hidden, weight, ids, lps, lse)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, ids, lps, lse = ctx.saved_tensors
        chunk = ctx.chunk
        p = lps.exp()
        mass = p.sum(-1, keepdim=True)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        for s in range(0, hidden.shape[0], chunk):  # projection 3: dL/dz, then both gradient GEMMs
            h_c = hidden[s:s + chunk]
            g = _logits(h_c, weight).sub_(lse[s:s + chunk, None]).exp_().mul_(mass[s:s + chunk])
            g = g.scatter_add_(1, ids[s:s + chunk], -p[s:s + chunk]).mul_(grad_loss).to(hidden.dtype)
            grad_hidden[s:s + chunk] = g @ weight
            _addmm_acc_(grad_weight, g.t(), h_c)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def recompute_fused_kl(hidden, weight, ids, lps, chunk_size: int | None = None) -> torch.Tensor:
    return RecomputeFusedKL.apply(hidden, weight, ids, lps, chunk_size or default_chunk(weight.shape[0]))
