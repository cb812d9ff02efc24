"""Random inputs for the loss tests: teacher-like top-K caches, not uniform noise.

Teacher log-probs are the top-K of a log-softmax over heavy-tailed (Student-t) logits, so the K
entries carry most but not all of the mass, as a real LM's do. Some entries are padding (id -1 or
logprob -inf) and one row is fully padded, as at the end of a document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossInputs:
    hidden: torch.Tensor  # [s, b, h]
    weight: torch.Tensor  # [V, h] (full vocabulary)
    topk_ids: torch.Tensor  # [s, b, K] int64
    topk_logprobs: torch.Tensor  # [s, b, K] float32
    loss_mask: torch.Tensor  # [s, b] float
    labels: torch.Tensor  # [s, b] int64

    def to(self, device) -> "LossInputs":
        return LossInputs(**{k: v.to(device) for k, v in vars(self).items()})


def _teacher_logits(num_tokens: int, vocab: int, zipf: float, generator: torch.Generator | None) -> torch.Tensor:
    """Student-t (ν = 10) logits scaled by 2, less zipf·log(1 + id). torch samples Student-t only from
    the global generator: with ``generator`` it is seeded from that one and restored afterwards."""
    def sample():
        return torch.distributions.StudentT(torch.tensor(10.0)).sample((num_tokens, vocab)) * 2.0

    if generator is None:
        logits = sample()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(1 << 62, (1,), generator=generator)))
            logits = sample()
    if zipf:
        logits -= zipf * torch.log1p(torch.arange(vocab, dtype=torch.float32))
    return logits


def teacher_topk(num_tokens: int, vocab: int, k: int, *, zipf: float = 0.0, generator: torch.Generator | None = None):
    """(ids [n, K] int64, logprobs [n, K] float32): top-K of a language-model-like teacher.

    Logits are Student-t (ν = 10) noise scaled by 2, which gives a mean top-1 probability of about
    0.5 and a top-100 mass of about 0.9 at V = 201,088 (what LM teachers show); ``zipf`` > 0 adds
    -zipf·log(1 + id), the unigram prior that makes low (frequent, in BPE vocabularies) ids likelier.
    """
    logprobs, ids = torch.log_softmax(_teacher_logits(num_tokens, vocab, zipf, generator).double(), -1).topk(k, dim=-1)
    return ids, logprobs.float()


def sampled_rows(num_tokens: int, vocab: int, draws: int, *, zipf: float = 0.0,
                 generator: torch.Generator | None = None):
    """(ids [n, draws] int64, logprobs [n, draws] float32): ``draws`` draws per token from the
    teacher-like distribution of ``teacher_topk``, as a sampled teacher pass hands them over: the
    distinct ids ascending with log(count / draws), then padding (id -1, log-prob -inf)."""
    logits = _teacher_logits(num_tokens, vocab, zipf, generator)
    picks = torch.multinomial(logits.softmax(-1), draws, replacement=True, generator=generator).sort(-1).values
    # slot of each draw among its token's distinct ids: a running count of where the id changes
    slot = torch.cat([torch.zeros(num_tokens, 1, dtype=torch.int64), (picks[:, 1:] != picks[:, :-1]).long()], 1)
    slot = slot.cumsum(1)
    counts = torch.zeros(num_tokens, draws, dtype=torch.float64).scatter_add_(1, slot, torch.ones_like(picks,
                                                                                                      dtype=torch.float64))
    ids = torch.full((num_tokens, draws), -1, dtype=torch.int64).scatter_(1, slot, picks)
    lps = torch.where(counts > 0, torch.log(counts / draws), float("-inf")).float()
    return ids, lps


def make_inputs(s=23, b=2, h=16, vocab=102, k=7, *, dtype=torch.float64, pad=True) -> LossInputs:
    hidden = torch.randn(s, b, h, dtype=torch.float64)
    weight = torch.randn(vocab, h, dtype=torch.float64) / h**0.5 * 2
    ids, lps = teacher_topk(s * b, vocab, k)
    ids, lps = ids.view(s, b, k).clone(), lps.view(s, b, k).clone()
    if pad:
        ids[1, 0, k // 2:] = -1  # padding by id
        lps[2, b - 1, 1:] = float("-inf")  # padding by logprob
        ids[3, 0, :] = -1  # a fully padded token
        lps[3, 0, :] = float("-inf")
    mask = (torch.rand(s, b) > 0.25).double()
    # token (0, 0) always counts: it holds all K entries, so no draw of the mask leaves only the
    # padded tokens and single-entry supports, whose renorm divergences are exactly 0 (a relative
    # check of a loss of 1e-17 against fp32's 1e-7 then fails on rounding alone)
    mask[0, 0] = 1.0
    labels = torch.randint(0, vocab, (s, b))
    return LossInputs(hidden.to(dtype), weight.to(dtype), ids, lps, mask, labels)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ in float64 (absolute when b is zero)."""
    a, b = a.double(), b.double()
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def loss_and_grads(fn, x: LossInputs, *, weight=None, hidden=None, grad_scale: float = 1.0, **kw):
    """Run ``fn`` (fused_topk_kl or topk_kl_reference); return (loss, stats, grad_hidden, grad_weight)."""
    hidden = (x.hidden if hidden is None else hidden).detach().clone().requires_grad_()
    weight = (x.weight if weight is None else weight).detach().clone().requires_grad_()
    loss, stats = fn(hidden, weight, x.topk_ids, x.topk_logprobs, **kw)
    (loss * grad_scale).backward()
    return loss.detach(), stats, hidden.grad, weight.grad


def encode_topk_v1(ids, logprobs, vocab_size: int):
    """(id deltas uint32, codes uint16) of the topk-v1 encoding, checked, as the cache writer makes them."""
    from megatron_kd.cache.encodings import TOPK_V1, encode_rows

    return encode_rows(TOPK_V1, ids, logprobs, vocab_size=vocab_size, draws=0).result()
