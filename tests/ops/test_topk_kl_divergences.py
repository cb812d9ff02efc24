"""divergence="reverse" and "jsd" of fused_topk_kl against topk_kl_reference (CPU; CUDA cases live in
test_topk_kl_cuda.py, tensor parallelism in test_topk_kl_parallel.py).

1. the reference's definitions: 0 where the student equals the teacher on the outcomes, > 0 elsewhere,
   JSD_β bounded by the entropy of (β, 1 - β)
2. every divergence x tail (renorm, ghost) x temperature x ce_weight x mask x reduction: loss, stats
   and both gradients, float64 torch (<= 1e-9), float32 torch and Triton kernels (interpreter, <= 1e-4)
3. gradcheck of the torch path in float64; bf16 inputs against the float64 reference
4. the Triton kernels' special rows: rows longer than one tile, a reference raised mid-row, the
   sparse-only gradient (renorm without CE: the block is zeroed), duplicate ids and labels among them
5. edge rows: a fully padded token gives 0 loss and 0 gradient, teacher mass 1 (ghost rest floored),
   all-masked input
6. bad divergence / jsd_beta / tail combinations raise one ValueError naming the argument
"""

import itertools
import math
import os

import pytest
import torch

from megatron_kd.ops import DIVERGENCES, fused_topk_kl, topk_kl_reference
from tests.fixtures.kd_inputs import loss_and_grads, make_inputs, rel_err

SUPPORT_DIVERGENCES = tuple(d for d in DIVERGENCES if d != "forward")
SUPPORT_TAILS = ("renorm", "ghost")
CASES = list(itertools.product(SUPPORT_DIVERGENCES, SUPPORT_TAILS, [1.0, 2.0], [0.0, 0.5], [False, True],
                               ["sum", "mean"]))
IMPL_DTYPES = [("torch", torch.float64, 1e-9), ("torch", torch.float32, 1e-4), ("triton", torch.float32, 1e-4)]


def _skip_unless_cpu_triton(impl):
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (no-GPU machines)")


def _check(fused, ref, tol):
    (l1, s1, gh1, gw1), (l2, s2, gh2, gw2) = fused, ref
    assert torch.isfinite(l1) and torch.isfinite(gh1).all() and torch.isfinite(gw1).all()
    assert rel_err(l1, l2) <= tol, (l1.item(), l2.item())
    assert rel_err(gh1, gh2) <= tol, rel_err(gh1, gh2)
    assert rel_err(gw1, gw2) <= tol, rel_err(gw1, gw2)
    assert s1.keys() == s2.keys()
    for key in s1:
        assert rel_err(s1[key], s2[key]) <= tol, key


def _self_teacher(x, k):
    """Teacher log-probs = the student's own top-K log-softmax (τ = 1), in float64."""
    logits = (x.hidden.double() @ x.weight.double().t())
    lps, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return ids, lps


@pytest.mark.parametrize("tail", SUPPORT_TAILS)
@pytest.mark.parametrize("divergence", SUPPORT_DIVERGENCES)
def test_reference_definitions(seed, divergence, tail):
    x = make_inputs(s=6, b=2, h=16, vocab=61, k=7, pad=False)
    beta = 0.3
    ids, lps = _self_teacher(x, 7)
    same, _ = topk_kl_reference(x.hidden, x.weight, ids, lps, tail=tail, divergence=divergence, jsd_beta=beta,
                                reduction="mean")
    assert abs(same.item()) < 1e-12
    ids2, lps2 = ids.clone(), lps.clone()
    ids2[..., 0], ids2[..., 1] = ids[..., 1], ids[..., 0]  # the teacher's two largest entries swapped
    kw = dict(tail=tail, divergence=divergence, jsd_beta=beta, reduction="sum")
    per_token = [topk_kl_reference(x.hidden[i:i + 1], x.weight, ids2[i:i + 1], lps2[i:i + 1], **kw)[0].item()
                 for i in range(x.hidden.shape[0])]
    assert min(per_token) > 0
    if divergence == "jsd":
        entropy = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert max(per_token) <= entropy * x.hidden.shape[1]


@pytest.mark.parametrize("impl, dtype, tol", IMPL_DTYPES, ids=["torch-fp64", "torch-fp32", "triton-fp32"])
@pytest.mark.parametrize("divergence, tail, temperature, ce_weight, masked, reduction", CASES)
def test_matches_reference(seed, impl, dtype, tol, divergence, tail, temperature, ce_weight, masked, reduction):
    _skip_unless_cpu_triton(impl)
    x = make_inputs(s=5, b=2, h=16, vocab=67, k=7)  # 10 tokens in chunks of 4: a ragged last chunk
    kw = dict(loss_mask=x.loss_mask if masked else None, labels=x.labels, ce_weight=ce_weight,
              temperature=temperature, tail=tail, reduction=reduction, kd_weight=0.7, divergence=divergence,
              jsd_beta=0.3)
    ref = loss_and_grads(topk_kl_reference, x, grad_scale=1.3, **kw)  # float64 ground truth
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.to(dtype), weight=x.weight.to(dtype), grad_scale=1.3,
                           chunk_size=4, impl=impl, **kw)
    _check(fused, ref, tol)


@pytest.mark.parametrize("divergence, tail, temperature, ce_weight, beta",
                         [("reverse", "renorm", 2.0, 0.5, 0.5), ("reverse", "ghost", 1.0, 0.0, 0.5),
                          ("jsd", "renorm", 1.0, 0.0, 0.2), ("jsd", "ghost", 2.0, 0.5, 0.9)])
def test_gradcheck(seed, divergence, tail, temperature, ce_weight, beta):
    x = make_inputs(s=5, b=1, h=4, vocab=11, k=3)
    h = x.hidden.clone().requires_grad_()
    w = x.weight.clone().requires_grad_()

    def f(h, w):
        return fused_topk_kl(h, w, x.topk_ids, x.topk_logprobs, loss_mask=x.loss_mask, labels=x.labels,
                             ce_weight=ce_weight, temperature=temperature, tail=tail, divergence=divergence,
                             jsd_beta=beta, chunk_size=2, impl="torch")[0]

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("divergence, tail", itertools.product(SUPPORT_DIVERGENCES, SUPPORT_TAILS))
def test_bf16_matches_float64_reference(seed, divergence, tail):
    x = make_inputs(s=20, b=2, h=64, vocab=257, k=16)
    h16, w16 = x.hidden.bfloat16(), x.weight.bfloat16()
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=0.5, temperature=2.0, tail=tail,
              divergence=divergence)
    ref = loss_and_grads(topk_kl_reference, x, hidden=h16.double(), weight=w16.double(), **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=h16, weight=w16, impl="torch", **kw)
    assert fused[2].dtype == torch.bfloat16 and fused[3].dtype == torch.bfloat16
    _check(fused, ref, 1e-2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("divergence, tail, ce_weight", [("reverse", "ghost", 0.5), ("jsd", "renorm", 0.0)])
def test_label_among_teacher_ids_and_duplicate_ids(seed, impl, divergence, tail, ce_weight):
    """A label that is also a teacher id and teacher ids listed twice: each occurrence is an outcome
    of its own (as in the reference), and the Triton kernel writes those columns once."""
    _skip_unless_cpu_triton(impl)
    x = make_inputs(s=6, b=2, h=16, vocab=61, k=6)
    x.labels[:3] = x.topk_ids[:3, :, 0].clamp_min(0)
    x.topk_ids[1:5, :, 1] = x.topk_ids[1:5, :, 2]
    x.topk_ids[2:4, :, 3] = x.topk_ids[2:4, :, 0]  # row 2: the label's column listed twice
    kw = dict(labels=x.labels, ce_weight=ce_weight, temperature=1.5, tail=tail, divergence=divergence)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), chunk_size=5,
                           impl=impl, **kw)
    _check(fused, ref, 1e-4)


@pytest.mark.parametrize("divergence, tail, temperature, ce_weight",
                         [("reverse", "renorm", 1.0, 0.0), ("jsd", "ghost", 2.0, 0.5)])
def test_triton_rows_longer_than_one_tile(seed, divergence, tail, temperature, ce_weight):
    """V_local = 9000: three 4096-lane tiles, the last ragged; renorm without CE zeroes the block
    (sparse-only gradient) instead of exponentiating it. K = 40: row_terms_kernel walks the entries in
    two tiles, the last ragged."""
    _skip_unless_cpu_triton("triton")
    x = make_inputs(s=4, b=1, h=16, vocab=9000, k=40)
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail=tail,
              divergence=divergence)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), chunk_size=3,
                           impl="triton", **kw)
    _check(fused, ref, 1e-4)


@pytest.mark.parametrize("divergence, tail, ce_weight", [("reverse", "ghost", 0.5), ("jsd", "renorm", 0.5)])
def test_triton_rows_far_above_their_teacher_entries(seed, divergence, tail, ce_weight):
    """One logit 60 nats above the rest, in the last tile, away from the teacher entries and the
    label: the reference is raised mid-row and α vanishes next to the sparse terms."""
    _skip_unless_cpu_triton("triton")
    x = make_inputs(s=4, b=1, h=16, vocab=9000, k=12)
    hot, rows = 8500, [(0, 0), (2, 0)]
    for s_, b_ in rows:
        w = x.weight[hot]
        x.hidden[s_, b_] = w * (60.0 / w.dot(w))
        x.topk_ids[s_, b_][x.topk_ids[s_, b_] == hot] = 0
        x.labels[s_, b_] = 1
    kw = dict(labels=x.labels, ce_weight=ce_weight, tail=tail, divergence=divergence)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), chunk_size=3,
                           impl="triton", **kw)
    _check(fused, ref, 1e-4)
    for s_, b_ in rows:
        assert rel_err(fused[2][s_, b_], ref[2][s_, b_]) <= 1e-4, (s_, b_)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("divergence", SUPPORT_DIVERGENCES)
def test_renorm_support_far_below_the_row_max(seed, impl, divergence):
    """The renorm tail's Q = q_S / Q_S depends only on the logits within S: with every teacher entry
    about 200 nats below the row's max, Q_S underflows fp32 (87 nats) but Q, the loss and its gradient
    do not (S's own max and sum, combined over ranks like the row's). The entries' logits lie about a
    nat apart (Q far from one-hot, so the gradient is not a near-cancellation that fp32 rounding of
    150-nat logits would dominate). One row holds a single entry (P = Q = 1: loss 0), one several."""
    _skip_unless_cpu_triton(impl)
    x = make_inputs(s=4, b=1, h=16, vocab=300, k=6)
    hot = 250
    for row, entries, first in ((0, 6, 0), (2, 1, 10)):
        w = x.weight[hot]
        x.hidden[row, 0] = w * (150.0 / w.dot(w))  # z_hot = 150
        ids = torch.arange(first, first + entries)
        x.weight[ids] = -0.4 * w + 0.01 * torch.randn(entries, w.shape[0], dtype=w.dtype)  # z ~ -60 +- 1
        z = x.weight @ x.hidden[row, 0]
        assert float(z.max() - z[ids].max()) > 150.0
        x.topk_ids[row, 0] = -1
        x.topk_ids[row, 0, :entries] = ids
        x.topk_logprobs[row, 0] = float("-inf")
        x.topk_logprobs[row, 0, :entries] = torch.log_softmax(torch.randn(entries), 0) + math.log(0.9)
    kw = dict(tail="renorm", divergence=divergence, reduction="sum", loss_mask=None)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), chunk_size=3,
                           impl=impl, **kw)
    _check(fused, ref, 1e-4)
    entries = x.topk_ids[0, 0]  # their weight rows' gradient: dL/dz_v · hidden, a real gradient
    assert rel_err(fused[3][entries], ref[3][entries]) <= 1e-4 and ref[3][entries].norm() > 1e-2
    alone = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), impl=impl,
                           **{**kw, "loss_mask": (torch.arange(4) == 2).view(4, 1).double()})
    assert abs(alone[0].item()) < 1e-6  # the single entry: P = Q = 1


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("divergence, tail", itertools.product(SUPPORT_DIVERGENCES, SUPPORT_TAILS))
def test_padded_token_and_full_teacher_mass(seed, impl, divergence, tail):
    """A fully padded token (S empty) contributes 0 loss and 0 gradient; a teacher whose entries
    hold all its mass (M = 1: the ghost rest is floored at 1e-8 inside logarithms) stays finite."""
    _skip_unless_cpu_triton(impl)
    x = make_inputs(s=4, b=2, h=16, vocab=61, k=7)  # token (3, 0) is fully padded
    # M = 1 at s = 0, exactly in every dtype: one entry of log-probability 0 (a sum of several entries
    # lands within fp32 rounding of 1, where log(1 - M) is anyone's guess above the floor)
    x.topk_ids[0, :, 1:] = -1
    x.topk_logprobs[0, :, 0] = 0.0
    kw = dict(tail=tail, divergence=divergence, temperature=2.0)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), chunk_size=3,
                           impl=impl, **kw)
    _check(fused, ref, 1e-4)
    assert torch.count_nonzero(fused[2][3, 0]) == 0
    alone = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), impl=impl,
                           loss_mask=(torch.arange(8) == 6).view(4, 2).double(), **kw)  # only the padded token
    assert alone[0].item() == 0.0 and torch.count_nonzero(alone[2]) == 0 and torch.count_nonzero(alone[3]) == 0


@pytest.mark.parametrize("divergence, tail", itertools.product(SUPPORT_DIVERGENCES, SUPPORT_TAILS))
def test_all_masked_gives_zero(seed, divergence, tail):
    x = make_inputs(s=4, b=2)
    for fn in (fused_topk_kl, topk_kl_reference):
        loss, stats, gh, gw = loss_and_grads(fn, x, loss_mask=torch.zeros_like(x.loss_mask), labels=x.labels,
                                             ce_weight=0.5, tail=tail, divergence=divergence, reduction="mean")
        assert loss.item() == 0.0
        assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
        assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("fn", [fused_topk_kl, topk_kl_reference])
def test_bad_divergence_arguments_raise(seed, fn):
    x = make_inputs(s=4, b=1)
    args = (x.hidden, x.weight, x.topk_ids, x.topk_logprobs)
    for match, kw in [
        ("divergence must be one of", dict(divergence="kl", tail="renorm")),
        ("jsd_beta must be a number in", dict(divergence="jsd", jsd_beta=0.0, tail="renorm")),
        ("jsd_beta must be a number in", dict(divergence="jsd", jsd_beta=1.0, tail="ghost")),
        ("jsd_beta must be a number in", dict(divergence="jsd", jsd_beta=float("nan"), tail="ghost")),
        ("jsd_beta must be a number in", dict(jsd_beta="0.5")),
        (r"divergence='reverse' needs tail 'renorm' or 'ghost'", dict(divergence="reverse", tail="none")),
        (r"divergence='jsd' needs tail 'renorm' or 'ghost'", dict(divergence="jsd")),
    ]:
        with pytest.raises(ValueError, match=match):
            fn(*args, **kw)


@pytest.mark.parametrize("impl", ["fused", "dense"])
def test_megatron_output_processor_passes_the_divergence(seed, impl):
    """``--kd-divergence`` / ``--kd-jsd-beta`` reach the op: megatron/loss.py's output processor gives
    the reference's jsd loss (the output layer here is the processor's own interface: weight, TP group
    and sequence parallelism)."""
    from types import SimpleNamespace

    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.loss import KDContext, kd_output_processor

    x = make_inputs(s=5, b=2, h=16, vocab=61, k=7)
    cfg = KDConfig(tail="ghost", divergence="jsd", jsd_beta=0.2, ce_weight=0.3, impl=impl, op_impl="torch")
    layer = SimpleNamespace(weight=x.weight, tp_group=None, sequence_parallel=False, config=SimpleNamespace())
    context = KDContext(cfg, x.topk_ids.transpose(0, 1), x.topk_logprobs.transpose(0, 1))
    loss, stats = kd_output_processor(x.hidden, layer, None, x.labels.t(), x.loss_mask.t(), context)
    want, want_stats = topk_kl_reference(x.hidden, x.weight, x.topk_ids, x.topk_logprobs, loss_mask=x.loss_mask,
                                         labels=x.labels, ce_weight=0.3, tail="ghost", divergence="jsd", jsd_beta=0.2)
    assert rel_err(loss, want) <= 1e-9
    assert rel_err(stats[0], want_stats["kd"]) <= 1e-6
