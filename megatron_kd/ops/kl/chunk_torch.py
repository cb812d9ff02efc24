"""Per-chunk math of the fused top-K KL loss in plain torch (the CPU path, and the GPU reference path).

One chunk of c tokens goes through three steps; the chunk loop (``function.py``) runs the
GEMMs and the tensor-parallel all-gather between them:

1. ``teacher_terms``      [T, K] cached entries -> tempered targets, masses, constants (once for
                          all tokens, then sliced per chunk: O(T·K), like the cache inputs).
2. ``local_row_stats_``   logits block [c, V_local] -> this rank's row statistics [c, 6];
                          the block is overwritten by e = exp((z - m_r) / τ) (no second block).
3. ``combine_row_stats``  [tp, c, 6] from all ranks -> global logsumexp, sparse sums, softmax
                          scale factors; ``row_losses`` -> per-token KD / CE values;
   ``grad_coefficients``  per-row coefficients of dLoss/dz (shared with the Triton path);
   ``logit_grad_``        e -> dLoss/dz in place, ready for grad_h = G·W and grad_W += Gᵀ·h.

Notation (docs/DESIGN.md §1): u = z/τ, q = softmax(u) over the full vocabulary, S the valid cached
entries, p the (tempered) teacher probabilities on S with mass M, Q = Σ_S q.
Every tail's loss is  L = C - Σ_S B_v u_v + A·lse(u)  (+ the ghost term), with
    none:   B = p,     A = M,                   C = Σ p log p
    renorm: B = p/M,   A = 1 (0 if S is empty), C = Σ (p/M) log(p/M)
    ghost:  B = p,     A = M,                   C = Σ p log p + (1-M) log(1-M),  - (1-M) log(1-Q)
and dL/du_v = A' q_v - B_v [v∈S] (+ r q_v [v∈S] for ghost), A' = A, or M - rQ for ghost,
r = (1-M)/(1-Q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Statistics exchanged across tensor-parallel ranks, one row per token. ROW_REST_SUMEXP (ghost tail
# only, 0 otherwise) is the sum of exp((z - m)/τ) outside the teacher entries, summed from its own
# terms: 1 - Q_S formed as Σ_V - Σ_S would be off by eps·Q_S/(1 - Q_S) where the student puts nearly
# all its mass on S. (With an id listed twice, each listing is an outcome: the repeats are
# subtracted, as 1 - Σ_S q_v does.)
# ROW_SUPPORT_MAX / ROW_SUPPORT_SUMEXP are the teacher entries' own max logit and Σ_S exp((z - m_S)/τ)
# (-inf / 0 on a rank that owns none): the renorm tail's Q_v = q_v / Q_S of reverse / jsd in S's own
# frame, exact however far S lies below the row max (there Q_S itself underflows: 87 nats in fp32).
(ROW_MAX, ROW_SUMEXP_T, ROW_SUMEXP_1, ROW_TARGET_DOT, ROW_TEACHER_SUMEXP, ROW_LABEL_LOGIT,
 ROW_REST_SUMEXP, ROW_SUPPORT_MAX, ROW_SUPPORT_SUMEXP) = range(9)
NUM_ROW_STATS = 9


@dataclass
class ChunkTeacher:
    """Teacher side of one chunk; everything here is independent of the student."""

    local_idx: torch.Tensor  # [c, K] int64 column in this rank's shard (0 where not owned)
    owned: torch.Tensor  # [c, K] 1.0 where the entry is valid and its id lives on this rank
    target_owned: torch.Tensor  # [c, K] B_v on owned entries, else 0
    const: torch.Tensor  # [c] C
    lse_coef: torch.Tensor  # [c] A
    mass: torch.Tensor  # [c] M (top-K mass of the tempered teacher, = cached mass)
    # [c] the ghost tail's teacher rest P_r = max(1 - M, 0), formed in float64 (None for other tails)
    rest_mass: torch.Tensor | None
    # [c, K] log P_v on owned entries, 0 elsewhere (renorm: log(p/M), ghost: log p); divergences other
    # than "forward" only (divergences.py), None otherwise
    log_target: torch.Tensor | None = None
    # [c, K] 1.0 at an owned entry whose column an earlier owned entry of its row names (ghost tail
    # only: the rest sum counts each column once), else 0; None for other tails
    repeat: torch.Tensor | None = None

    def rows(self, start: int, end: int) -> "ChunkTeacher":
        """Rows [start, end) as views (the terms are built once for all tokens, then walked in chunks)."""
        return ChunkTeacher(**{f: None if (t := getattr(self, f)) is None else t[start:end]
                               for f in self.__dataclass_fields__})


def teacher_terms(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    *,
    tail: str,
    temperature: float,
    vocab_start: int,
    vocab_local: int,
    dtype: torch.dtype,
    divergence: str = "forward",
) -> ChunkTeacher:
    neg_inf = float("-inf")
    rest_mass = None
    lp = logprobs.to(dtype)
    valid = (ids >= 0) & (lp > neg_inf)
    lp = lp.masked_fill(~valid, neg_inf)
    # M (and 1 - M) in float64 from the cached log-probs: where the entries hold nearly all the
    # mass, 1 - M is a difference of nearly equal numbers, and each p_v rounded in fp32 would leave
    # it eps32/(1 - M) wrong (rows with 1 - M ~ 1e-7 are common at K = 100). Once per call, [T, K];
    # tempering keeps M, so it is the untempered sum, as in the reference.
    mass64 = logprobs.to(torch.float64, copy=True).masked_fill_(~valid, neg_inf).exp_().sum(-1)  # not in place
    mass = mass64.to(dtype)
    if temperature != 1.0:
        # Temper the shape inside S, keep its mass: lp/τ - lse_S(lp/τ) + log M.
        log_mass = torch.logsumexp(lp, dim=-1, keepdim=True)
        lp_t = lp / temperature
        lp = (lp_t - torch.logsumexp(lp_t, dim=-1, keepdim=True) + log_mass).masked_fill(~valid, neg_inf)
    p = lp.exp()  # 0 on padding
    p_log_p = torch.where(valid, p * lp, 0.0).sum(-1)

    if tail == "renorm":
        nonempty = mass > 0
        inv_mass = torch.where(nonempty, 1.0 / mass.clamp_min(torch.finfo(dtype).tiny), 0.0)
        target = p * inv_mass.unsqueeze(-1)
        # Σ (p/M) log(p/M) = (Σ p log p)/M - log M
        const = torch.where(nonempty, p_log_p * inv_mass - mass.clamp_min(torch.finfo(dtype).tiny).log(), 0.0)
        lse_coef = nonempty.to(dtype)
    else:
        target = p
        const = p_log_p
        lse_coef = mass
        if tail == "ghost":
            rest_mass = (1.0 - mass64).clamp_min_(0.0).to(dtype)  # cached masses may lie a hair above 1
            const = const + torch.xlogy(rest_mass, rest_mass)

    local = ids.long() - vocab_start
    owned = valid & (local >= 0) & (local < vocab_local)
    owned_f = owned.to(dtype)
    log_target = None
    if divergence != "forward":  # log P_v in log space: p itself underflows far below e^-87 (fp32)
        if tail == "renorm":
            lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)  # log(p/M); -inf on padding (masked below)
        log_target = torch.where(owned, lp, 0.0)
    local_idx = torch.where(owned, local, 0)
    return ChunkTeacher(
        local_idx=local_idx,
        owned=owned_f,
        target_owned=target * owned_f,
        const=const,
        lse_coef=lse_coef,
        mass=mass,
        rest_mass=rest_mass,
        log_target=log_target,
        repeat=repeated_entries(local_idx, owned).to(dtype) if tail == "ghost" else None,
    )


def local_labels(labels: torch.Tensor, *, vocab_start: int, vocab_local: int, dtype: torch.dtype):
    """Global label ids -> (column in this shard or 0, 1.0 where this rank owns the label)."""
    local = labels.long() - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return torch.where(owned, local, 0), owned.to(dtype)


def local_row_stats_(
    logits: torch.Tensor,
    teacher: ChunkTeacher,
    label_idx: torch.Tensor | None,
    label_owned: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row statistics of this rank's logits block; overwrites ``logits`` with exp((z - m_r)/τ).

    Returns (stats [c, NUM_ROW_STATS], z_S [c, K] raw logits at the owned teacher entries).
    """
    row_max = logits.amax(dim=-1)
    z_s = logits.gather(1, teacher.local_idx)
    stats = logits.new_zeros(logits.shape[0], NUM_ROW_STATS)
    stats[:, ROW_MAX] = row_max
    if label_idx is not None:
        stats[:, ROW_LABEL_LOGIT] = logits.gather(1, label_idx.unsqueeze(1)).squeeze(1) * label_owned

    e = logits.sub_(row_max.unsqueeze(1))
    if temperature != 1.0:
        e.mul_(1.0 / temperature)
    e.exp_()
    e_s = e.gather(1, teacher.local_idx) * teacher.owned  # the block's own values at the entries
    if teacher.rest_mass is None:
        stats[:, ROW_SUMEXP_T] = e.sum(-1)
    else:  # ghost: the sum outside S (S's columns zeroed, summed, put back), then the whole row
        e.scatter_reduce_(1, teacher.local_idx, 1.0 - teacher.owned, "prod")
        rest = e.sum(-1)
        e.scatter_reduce_(1, teacher.local_idx, e_s, "amax")  # e >= 0: the unowned entries' 0 change nothing
        repeat = teacher.repeat != 0
        repeats = torch.where(repeat, e_s, 0.0).sum(-1)
        stats[:, ROW_SUMEXP_T] = rest + torch.where(repeat, 0.0, e_s).sum(-1)
        stats[:, ROW_REST_SUMEXP] = rest - repeats
    if label_idx is not None:
        # exp(z - m) = e^τ; the τ = 1 sum is the one above.
        stats[:, ROW_SUMEXP_1] = e.pow(temperature).sum(-1) if temperature != 1.0 else stats[:, ROW_SUMEXP_T]
    stats[:, ROW_TARGET_DOT] = (teacher.target_owned * z_s).sum(-1)
    stats[:, ROW_TEACHER_SUMEXP] = e_s.sum(-1)
    owned = teacher.owned != 0
    support_max = torch.where(owned, z_s, float("-inf")).amax(-1)
    stats[:, ROW_SUPPORT_MAX] = support_max
    shifted = (z_s - torch.where(owned.any(-1), support_max, 0.0).unsqueeze(1)) / temperature
    stats[:, ROW_SUPPORT_SUMEXP] = torch.where(owned, shifted.exp(), 0.0).sum(-1)
    return stats, z_s


def repeated_entries(local_idx: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """[c, K] True at an owned entry whose column an earlier owned entry of its row already names.

    A stable sort of each row's columns (unowned entries as -1) puts the repeats of a column right
    after its first listing: O(c·K log K) once per call, where comparing all pairs would hold
    [c, K, K] (328 MB at 32K tokens, K = 100) or cost K² per row inside the kernel's walk."""
    owned = owned != 0
    columns, order = torch.where(owned, local_idx, -1).sort(dim=1, stable=True)
    later = (columns[:, 1:] == columns[:, :-1]) & (columns[:, 1:] >= 0)
    return torch.zeros_like(owned).scatter_(1, order[:, 1:], later)


@dataclass
class RowStats:
    """Global (all-rank) per-token quantities of one chunk."""

    row_max: torch.Tensor  # [c] m = max_v z_v
    sumexp_t: torch.Tensor  # [c] Σ_v exp((z_v - m)/τ)
    lse_t: torch.Tensor  # [c] logsumexp(z/τ)
    lse_1: torch.Tensor | None  # [c] logsumexp(z), when labels are given
    target_dot: torch.Tensor  # [c] Σ_S B_v z_v
    student_mass: torch.Tensor  # [c] Q = Σ_S q_v
    student_rest: torch.Tensor  # [c] 1 - Q from its own terms (ROW_REST_SUMEXP; ghost tail only, else 0)
    support_max: torch.Tensor  # [c] m_S = max_S z_v over every rank's entries (row_max where S is empty)
    support_log_sumexp: torch.Tensor  # [c] log Σ_S exp((z_v - m_S)/τ) (log tiny where S is empty)
    label_logit: torch.Tensor | None  # [c] z_label
    scale_t: torch.Tensor  # [c] e·scale_t = q (softmax(z/τ)) for this rank's block
    scale_1: torch.Tensor | None  # [c] e^τ·scale_1 = softmax(z)


def combine_row_stats(all_stats: torch.Tensor, rank: int, temperature: float, has_labels: bool) -> RowStats:
    """[tp, c, NUM_ROW_STATS] from every rank -> global row quantities (each rank's max rescaled)."""
    rank_max = all_stats[..., ROW_MAX]
    row_max = rank_max.amax(0)
    w_t = ((rank_max - row_max) / temperature).exp()
    sumexp_t = (all_stats[..., ROW_SUMEXP_T] * w_t).sum(0)
    lse_t = row_max / temperature + sumexp_t.log()
    out = RowStats(
        row_max=row_max,
        sumexp_t=sumexp_t,
        lse_t=lse_t,
        lse_1=None,
        target_dot=all_stats[..., ROW_TARGET_DOT].sum(0),
        student_mass=(all_stats[..., ROW_TEACHER_SUMEXP] * w_t).sum(0) / sumexp_t,
        student_rest=(all_stats[..., ROW_REST_SUMEXP] * w_t).sum(0) / sumexp_t,
        **_combine_support(all_stats, row_max, temperature),
        label_logit=None,
        scale_t=w_t[rank] / sumexp_t,
        scale_1=None,
    )
    if has_labels:
        w_1 = (rank_max - row_max).exp()
        sumexp_1 = (all_stats[..., ROW_SUMEXP_1] * w_1).sum(0)
        out.lse_1 = row_max + sumexp_1.log()
        out.label_logit = all_stats[..., ROW_LABEL_LOGIT].sum(0)
        out.scale_1 = w_1[rank] / sumexp_1
    return out


def _combine_support(all_stats: torch.Tensor, row_max: torch.Tensor, temperature: float) -> dict:
    """m_S and log Σ_S exp((z - m_S)/τ) over every rank's entries (RowStats.support_*)."""
    rank_max = all_stats[..., ROW_SUPPORT_MAX]
    support_max = rank_max.amax(0)
    support_max = torch.where(torch.isfinite(support_max), support_max, row_max)
    w = torch.where(torch.isfinite(rank_max), ((rank_max - support_max) / temperature).exp(), 0.0)
    sumexp = (all_stats[..., ROW_SUPPORT_SUMEXP] * w).sum(0)
    return dict(support_max=support_max, support_log_sumexp=sumexp.clamp_min(torch.finfo(sumexp.dtype).tiny).log())


def _ghost_one_minus_q(rs: RowStats) -> torch.Tensor:
    # 1 - Q underflows when the student puts (almost) all its mass on S; keep it positive.
    return rs.student_rest.clamp_min(torch.finfo(rs.student_rest.dtype).tiny)


def row_losses(teacher: ChunkTeacher, rs: RowStats, temperature: float, tail: str):
    """Per-token KD term L (before kd_weight·τ²) and CE term (None without labels)."""
    kd = teacher.const + teacher.lse_coef * rs.lse_t - rs.target_dot / temperature
    if tail == "ghost":
        kd = kd - teacher.rest_mass * _ghost_one_minus_q(rs).log()
    ce = rs.lse_1 - rs.label_logit if rs.lse_1 is not None else None
    return kd, ce


@dataclass
class GradCoefs:
    """dLoss/dz of one chunk on this rank's block, as per-row coefficients:

        G[r, v] = alpha[r]·exp((z - m_r)/τ) + beta[r]·exp(z - m_r)      (dense part, m_r local max)
                + sparse[r, k]  at v = local_idx[r, k] where owned       (teacher entries)
                + label_sparse[r] at v = label_idx[r] where label_owned  (hard label)

    beta is None when the CE softmax folds into alpha (τ = 1 or no CE term).
    """

    alpha: torch.Tensor  # [c]
    beta: torch.Tensor | None  # [c]
    sparse: torch.Tensor  # [c, K], 0 on entries this rank does not own
    label_sparse: torch.Tensor | None  # [c], 0 where this rank does not own the label


def grad_coefficients(
    z_s: torch.Tensor,
    teacher: ChunkTeacher,
    rs: RowStats,
    kd_row_scale: torch.Tensor,
    ce_row_scale: torch.Tensor | None,
    label_owned: torch.Tensor | None,
    temperature: float,
    tail: str,
) -> GradCoefs:
    """kd_row_scale = kd_weight·τ·ρ (τ²·L differentiated through u = z/τ), ce_row_scale = ce_weight·ρ,
    ρ = loss_mask (/ Σ loss_mask for "mean"). None for ce_row_scale drops the CE gradient.
    """
    if tail == "ghost":
        # d/du of -(1-M) log(1-Q) is r·(q_v [v∈S] - q_v Q) with r = (1-M)/(1-Q); 1-M is clamped at 0
        # exactly as in the loss (cached masses can lie above 1). For M <= 1 the dense
        # coefficient is (M-Q)/(1-Q) and the S entries get q_v - p_v, as in docs/DESIGN.md §1.
        ghost_ratio = teacher.rest_mass / _ghost_one_minus_q(rs)
        dense_coef = teacher.mass - ghost_ratio * rs.student_mass
    else:
        dense_coef = teacher.lse_coef
    sparse = -kd_row_scale.unsqueeze(1) * teacher.target_owned
    if tail == "ghost":
        q_s = ((z_s - rs.row_max.unsqueeze(1)) / temperature).exp() / rs.sumexp_t.unsqueeze(1)
        sparse = sparse + (kd_row_scale * ghost_ratio).unsqueeze(1) * q_s * teacher.owned
    return with_ce_coefficients(kd_row_scale * dense_coef * rs.scale_t, sparse, rs, ce_row_scale, label_owned,
                                temperature)


def with_ce_coefficients(
    alpha: torch.Tensor,
    sparse: torch.Tensor,
    rs: RowStats,
    ce_row_scale: torch.Tensor | None,
    label_owned: torch.Tensor | None,
    temperature: float,
) -> GradCoefs:
    """The KD term's dense coefficient α (of exp((z - m_r)/τ)) and [c, K] sparse terms, plus the CE
    gradient softmax(z) - onehot(label) (None for ce_row_scale: no CE gradient)."""
    beta = label_sparse = None
    if ce_row_scale is not None:
        if temperature == 1.0:
            alpha = alpha + ce_row_scale * rs.scale_1
        else:
            beta = ce_row_scale * rs.scale_1
        label_sparse = -ce_row_scale * label_owned
    return GradCoefs(alpha=alpha, beta=beta, sparse=sparse, label_sparse=label_sparse)


def logit_grad_(
    e: torch.Tensor,
    coefs: GradCoefs,
    teacher: ChunkTeacher,
    label_idx: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Overwrite e = exp((z - m_r)/τ) (from ``local_row_stats_``) with dLoss/dz and return it."""
    if coefs.beta is None:
        e.mul_(coefs.alpha.unsqueeze(1))
    else:
        softmax_1 = e.pow(temperature).mul_(coefs.beta.unsqueeze(1))  # e^τ = exp(z - m_r)
        e.mul_(coefs.alpha.unsqueeze(1)).add_(softmax_1)
        del softmax_1
    e.scatter_add_(1, teacher.local_idx, coefs.sparse)
    if coefs.label_sparse is not None:
        e.scatter_add_(1, label_idx.unsqueeze(1), coefs.label_sparse.unsqueeze(1))
    return e
