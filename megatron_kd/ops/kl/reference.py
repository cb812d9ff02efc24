"""``topk_kl_reference``: the ground truth for ``fused_topk_kl``, and the dense baseline.

Materializes the full [tokens, V] logits, writes every tail and divergence straight from the
definitions of docs/DESIGN.md §1 (the teacher and student distributions P, Q over the tail's outcomes,
then KL(P‖Q), KL(Q‖P) or the β-skewed Jensen-Shannon divergence of them) and lets autograd
differentiate them, so it shares no gradient algebra with the fused op. Computes in float32 for bf16/fp16/fp32 inputs and in float64 for float64 inputs. Under tensor
parallelism the logits are gathered with Megatron-Core's own autograd mappings.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_kd.ops.comm import group_size
from megatron_kd.ops.kl.options import (
    GHOST_REST_FLOOR,
    LossResult,
    TopKKLOptions,
    check_inputs,
    loss_entry_point,
    unpack_stats,
)


def _full_vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, opts: TopKKLOptions) -> torch.Tensor:
    group = opts.tp_group
    if group_size(group) == 1:
        return hidden @ weight.t()
    from megatron.core.tensor_parallel import mappings

    if opts.sequence_parallel:
        hidden = mappings.gather_from_sequence_parallel_region(hidden, group=group)
    else:
        hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=group)
    return mappings.gather_from_tensor_model_parallel_region(hidden @ weight.t(), group=group)


@loss_entry_point
def topk_kl_reference(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts: TopKKLOptions) -> LossResult:
    """Same signature and results as ``fused_topk_kl``; ``chunk_size``, ``impl`` and
    ``gradient_accumulation_fusion`` are accepted for drop-in use and ignored (all at once)."""
    opts = dataclasses.replace(opts, gradient_accumulation_fusion=False)
    checks = check_inputs(hidden, weight, topk_ids, topk_logprobs, loss_mask, labels, opts)
    checks.raise_if_bad()
    vocab = checks.vocab
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    tau = float(opts.temperature)

    logits = _full_vocab_logits(hidden, weight, opts).to(dtype).reshape(-1, vocab)
    ids = topk_ids.reshape(logits.shape[0], -1).long()
    # the teacher side is [n, K]: float64 always, so M and 1 - M (near 0 when the K entries hold
    # nearly all the mass: the ghost tail's rest outcome) are exact whatever the student's dtype
    lp = topk_logprobs.reshape(logits.shape[0], -1).double()
    mask = (
        loss_mask.reshape(-1).to(dtype) if loss_mask is not None else logits.new_ones(logits.shape[0])
    )

    # Teacher on S (valid entries), tempered inside S with its mass kept.
    valid = (ids >= 0) & torch.isfinite(lp)
    lp = torch.where(valid, lp, float("-inf"))
    mass = torch.where(valid, lp.exp(), 0.0).sum(-1)
    if tau != 1.0:
        lp = lp / tau - torch.logsumexp(lp / tau, -1, keepdim=True) + mass.log().unsqueeze(-1)
    rest_mass = (1.0 - mass).clamp_min(0.0).to(dtype)  # cached masses may lie a hair above 1
    p = torch.where(valid, lp.exp(), 0.0).to(dtype)
    log_p = torch.where(valid, lp, 0.0).to(dtype)
    mass = mass.to(dtype)

    log_q = torch.log_softmax(logits / tau, dim=-1)
    log_q_s = torch.where(valid, log_q.gather(1, torch.where(valid, ids, 0)), 0.0)

    if opts.divergence != "forward":
        kd = _support_divergence(p, log_p, log_q_s, valid, mass, rest_mass, opts.tail, opts.divergence,
                                 opts.jsd_beta)
    elif opts.tail == "none":
        kd = (p * (log_p - log_q_s)).sum(-1)
    elif opts.tail == "renorm":
        p_hat = p / mass.clamp_min(torch.finfo(dtype).tiny).unsqueeze(-1)
        log_p_hat = torch.where(valid, log_p - mass.clamp_min(torch.finfo(dtype).tiny).log().unsqueeze(-1), 0.0)
        kd = (p_hat * (log_p_hat - log_q_s)).sum(-1)
    else:  # ghost: KL over the K entries plus one "everything else" outcome
        q_s = torch.where(valid, log_q_s.exp(), 0.0).sum(-1)
        tail_q = (1.0 - q_s).clamp_min(torch.finfo(dtype).tiny)
        kd = (p * (log_p - log_q_s)).sum(-1) + torch.xlogy(rest_mass, rest_mass) - rest_mass * tail_q.log()

    total = opts.kd_weight * tau * tau * (mask * kd).sum()
    stats = [(mask * kd).sum(), logits.new_zeros(()), (mask * mass).sum()]
    if labels is not None:
        ce = -torch.log_softmax(logits, dim=-1).gather(1, labels.reshape(-1, 1).long()).squeeze(1)
        total = total + opts.ce_weight * (mask * ce).sum()
        stats[1] = (mask * ce).sum()
    tokens = mask.sum()
    if opts.reduction == "mean":
        inv = torch.where(tokens > 0, 1.0 / tokens.clamp_min(1e-30), 0.0)
        total = total * inv
        stats = [s * inv for s in stats]
    return total, unpack_stats(torch.stack([*stats, tokens]), has_labels=labels is not None)


def _support_divergence(p, log_p, log_q_s, valid, mass, rest_mass, tail, divergence, beta):
    """Per-token KL(Q‖P) or JSD_β(P, Q) over the outcomes of ``tail``: [n, K(+1)] distributions
    built from their definitions (docs/DESIGN.md §1), then the divergence summed over outcomes."""
    tiny = torch.finfo(p.dtype).tiny
    q_s = torch.where(valid, log_q_s.exp(), 0.0)  # q_v, v in S
    if tail == "renorm":  # outcomes S: P = p/M, Q = q_S/Q_S (a softmax over S: exact where Q_S underflows)
        big_p = p / mass.clamp_min(tiny).unsqueeze(-1)
        log_q_on_s = torch.where(valid, log_q_s, float("-inf"))
        log_q_on_s = torch.where(valid.any(-1, keepdim=True), log_q_on_s, 0.0)  # S empty: no -inf - -inf
        big_q = torch.where(valid, torch.softmax(log_q_on_s, -1), 0.0)
        log_big_p = torch.where(valid, log_p - mass.clamp_min(tiny).log().unsqueeze(-1), 0.0)
        keep = valid
    else:  # ghost: outcomes S and "the rest", P = (p_S, 1 - M), Q = (q_S, 1 - Q_S)
        rest_p = rest_mass
        rest_q = (1.0 - q_s.sum(-1)).clamp_min(tiny)
        big_p = torch.cat([p, rest_p.unsqueeze(-1)], -1)
        big_q = torch.cat([q_s, rest_q.unsqueeze(-1)], -1)
        log_big_p = torch.cat([log_p, rest_p.clamp_min(GHOST_REST_FLOOR).log().unsqueeze(-1)], -1)
        keep = torch.cat([valid, torch.ones_like(valid[:, :1])], -1)
    log_big_q = torch.where(keep, big_q.clamp_min(tiny).log(), 0.0)
    if divergence == "reverse":  # KL(Q‖P) = Σ Q (log Q - log P)
        terms = big_q * (log_big_q - log_big_p)
    else:  # β KL(P‖Mx) + (1-β) KL(Q‖Mx), Mx = βP + (1-β)Q
        mix = beta * big_p + (1.0 - beta) * big_q
        log_mix = torch.where(keep, mix.clamp_min(tiny).log(), 0.0)
        terms = beta * big_p * (log_big_p - log_mix) + (1.0 - beta) * big_q * (log_big_q - log_mix)
    return torch.where(keep, terms, 0.0).sum(-1)
