"""Reverse KL and Jensen-Shannon over the cached support, per chunk, in plain torch.

The torch path's form of what the Triton kernels' divergence branches compute (docs/DESIGN.md §1,
the gradient tables); "forward" never comes here. Per token, with the tail's outcomes (renorm: S;
ghost: S and "the rest") and the distributions P (teacher) and Q (student) on them:

    reverse  L = Σ_o Q_o (log Q_o - log P_o)                  g_o = log Q_o - log P_o
    jsd      L = Σ_o β P_o log(P_o/Mx_o) + (1-β) Q_o log(Q_o/Mx_o),  Mx = βP + (1-β)Q
                                                              g_o = (1-β)(log Q_o - log Mx_o)

g_o is ∂L/∂Q_o less a constant that cancels (reverse: the +1). The student enters Q only through
q_v = softmax(z/τ)_v at the K entries (and, for ghost, 1 - Q_S), so

    dL/du_w = kd·(dense·q_w + [w∈S] Q_w (g_w - center)),   u = z/τ
    renorm:  dense = 0,               center = H = Σ_S Q_v g_v
    ghost:   dense = -(H - Q_S g_r),  center = g_r (the rest outcome's g)

Two per-row sums over S carry everything that is not per entry: F = Σ_S f_v (the loss's S part) and
H. Per entry they need q_v = exp((z_v - m)/τ - log Σ exp((z - m)/τ)), i.e. the global logsumexp,
which the chunk loop has after the row-statistics combine; under tensor parallelism each rank sums
its own entries and the [c, 2] partial sums are all-reduced (``function.py``).

Shapes: z_S, owned, log_target [c, K]; row quantities [c]; sums [c, NUM_SUPPORT_SUMS].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_kd.ops.kl.chunk_torch import ChunkTeacher, GradCoefs, RowStats, with_ce_coefficients
from megatron_kd.ops.kl.options import GHOST_REST_FLOOR

SUM_DIVERGENCE, SUM_GRADIENT = range(2)  # columns of the per-row sums: F and H
NUM_SUPPORT_SUMS = 2


@dataclass
class SupportTerms:
    """Per-entry terms of one chunk on this rank's owned entries (0 elsewhere), and their row sums."""

    big_q: torch.Tensor  # [c, K] Q_v
    g: torch.Tensor  # [c, K] g_v
    sums: torch.Tensor  # [c, NUM_SUPPORT_SUMS] F and H over this rank's entries (all-reduce under TP)


def _tiny(t: torch.Tensor) -> float:
    return torch.finfo(t.dtype).tiny


def support_terms(z_s: torch.Tensor, teacher: ChunkTeacher, rs: RowStats, temperature: float, tail: str,
                  divergence: str, beta: float) -> SupportTerms:
    owned = teacher.owned != 0
    if tail == "renorm":  # log(q_v/Q_S) in S's own frame: exact even where Q_S underflows
        log_q = (z_s - rs.support_max.unsqueeze(1)) / temperature - rs.support_log_sumexp.unsqueeze(1)
    else:  # log q_v
        log_q = (z_s - rs.row_max.unsqueeze(1)) / temperature - rs.sumexp_t.log().unsqueeze(1)
    log_q = torch.where(owned, log_q, 0.0)
    big_q = torch.where(owned, log_q.exp(), 0.0)
    log_p = teacher.log_target
    if divergence == "reverse":
        g = log_q - log_p
        f = big_q * g
    else:
        log_mix = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
        g = (1.0 - beta) * (log_q - log_mix)
        f = beta * log_p.exp() * (log_p - log_mix) + big_q * g
    g = torch.where(owned, g, 0.0)
    f = torch.where(owned, f, 0.0)
    sums = torch.stack([f.sum(-1), (big_q * g).sum(-1)], dim=1)
    return SupportTerms(big_q=big_q, g=g, sums=sums)


def ghost_rest(rest_p: torch.Tensor, student_rest: torch.Tensor, divergence: str, beta: float):
    """(f_r, g_r) of the ghost tail's rest outcome: P_r = max(1 - M, 0) (``ChunkTeacher.rest_mass``,
    floored inside logarithms at GHOST_REST_FLOOR), Q_r = 1 - Q_S (``RowStats.student_rest``, at least
    the dtype's tiny). Both come summed from their own terms, not as 1 minus a sum over S."""
    log_rest_p = rest_p.clamp_min(GHOST_REST_FLOOR).log()
    rest_q = student_rest.clamp_min(_tiny(student_rest))
    log_rest_q = rest_q.log()
    if divergence == "reverse":
        g_r = log_rest_q - log_rest_p
        return rest_q * g_r, g_r
    log_mix = (beta * rest_p + (1.0 - beta) * rest_q).clamp_min(_tiny(rest_q)).log()
    g_r = (1.0 - beta) * (log_rest_q - log_mix)
    return beta * rest_p * (log_rest_p - log_mix) + rest_q * g_r, g_r


def support_losses(sums: torch.Tensor, teacher: ChunkTeacher, rs: RowStats, tail: str,
                   divergence: str, beta: float):
    """Per-token L (before kd_weight·τ²) and the gradient's (dense, center) of the module docstring,
    from the all-rank ``sums``."""
    total_f, total_h = sums[:, SUM_DIVERGENCE], sums[:, SUM_GRADIENT]
    if tail == "renorm":
        return total_f, torch.zeros_like(total_f), total_h
    f_r, g_r = ghost_rest(teacher.rest_mass, rs.student_rest, divergence, beta)
    return total_f + f_r, -(total_h - rs.student_mass * g_r), g_r


def support_grad_coefficients(terms: SupportTerms, dense: torch.Tensor, center: torch.Tensor, rs: RowStats,
                              kd_row_scale: torch.Tensor, ce_row_scale: torch.Tensor | None,
                              label_owned: torch.Tensor | None, temperature: float) -> GradCoefs:
    """GradCoefs of ``chunk_torch`` for these divergences (kd_row_scale = kd_weight·τ·ρ)."""
    sparse = kd_row_scale.unsqueeze(1) * terms.big_q * (terms.g - center.unsqueeze(1))
    return with_ce_coefficients(kd_row_scale * dense * rs.scale_t, sparse, rs, ce_row_scale, label_owned,
                                temperature)
