"""fused_topk_kl against topk_kl_reference on one process (CPU; CUDA tests live in test_topk_kl_cuda.py).

1. every tail x temperature x ce_weight x mask x reduction, float64 (<= 1e-9) and float32 (<= 1e-4),
   for the torch path and (float32) the Triton kernels, run by Triton's interpreter on CPU
2. bf16 inputs against the float64 reference (<= 1e-2)
3. chunking does not change the result; the automatic chunk size respects its budget
4. all-masked input: loss 0, zero gradients, finite stats
5. gradcheck on a tiny float64 case
6. backward scales the precomputed gradients; no-grad mode computes none
7. gradient accumulation into Megatron's main_grad
8. every bad input raises one ValueError naming the argument
"""

import itertools
import os

import pytest
import torch

from megatron_kd.ops import TAILS, fused_topk_kl, topk_kl_reference
from megatron_kd.ops.common import auto_chunk_size
from tests.fixtures.kd_inputs import loss_and_grads, make_inputs, rel_err

CASES = list(itertools.product(TAILS, [1.0, 2.0], [0.0, 0.5], [False, True], ["sum", "mean"]))


def _check(fused, ref, tol):
    (l1, s1, gh1, gw1), (l2, s2, gh2, gw2) = fused, ref
    assert torch.isfinite(l1) and torch.isfinite(gh1).all() and torch.isfinite(gw1).all()
    assert rel_err(l1, l2) <= tol, (l1.item(), l2.item())
    assert rel_err(gh1, gh2) <= tol
    assert rel_err(gw1, gw2) <= tol
    assert s1.keys() == s2.keys()
    for key in s1:
        assert rel_err(s1[key], s2[key]) <= tol, key


IMPL_DTYPES = [("torch", torch.float64, 1e-9), ("torch", torch.float32, 1e-4), ("triton", torch.float32, 1e-4)]


def _skip_unless_cpu_triton(impl):
    # On CPU tensors the Triton kernels run only in the interpreter (set by conftest without a GPU);
    # on a GPU machine test_topk_kl_cuda.py runs them for real.
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (no-GPU machines)")


@pytest.mark.parametrize("impl, dtype, tol", IMPL_DTYPES, ids=["torch-fp64", "torch-fp32", "triton-fp32"])
@pytest.mark.parametrize("tail, temperature, ce_weight, masked, reduction", CASES)
def test_matches_reference(seed, impl, dtype, tol, tail, temperature, ce_weight, masked, reduction):
    _skip_unless_cpu_triton(impl)
    x = make_inputs(s=29, b=2, h=24, vocab=131, k=9)
    kw = dict(
        loss_mask=x.loss_mask if masked else None, labels=x.labels, ce_weight=ce_weight,
        temperature=temperature, tail=tail, reduction=reduction, kd_weight=0.7,
    )
    ref = loss_and_grads(topk_kl_reference, x, grad_scale=1.3, **kw)  # float64 ground truth
    fused = loss_and_grads(
        fused_topk_kl, x, hidden=x.hidden.to(dtype), weight=x.weight.to(dtype), grad_scale=1.3,
        chunk_size=13, impl=impl, **kw,
    )
    assert fused[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _check(fused, ref, tol)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("temperature, ce_weight", [(1.0, 0.0), (2.0, 0.5)])
def test_bf16_matches_float64_reference(seed, tail, temperature, ce_weight):
    x = make_inputs(s=40, b=2, h=64, vocab=257, k=16)
    h16, w16 = x.hidden.bfloat16(), x.weight.bfloat16()
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail=tail)
    ref = loss_and_grads(topk_kl_reference, x, hidden=h16.double(), weight=w16.double(), **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=h16, weight=w16, **kw)
    assert fused[2].dtype == torch.bfloat16 and fused[3].dtype == torch.bfloat16
    _check(fused, ref, 1e-2)


@pytest.mark.parametrize("tail", ["none", "renorm"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_label_among_teacher_ids_and_duplicate_ids(seed, impl, tail):
    """A label that is also a teacher id, a teacher id listed twice, and both at once get every term
    once per occurrence (the Triton kernel rewrites those columns instead of adding to them).

    Not with tail "ghost": its student rest 1 − Q_S counts a listed-twice outcome twice and goes
    below 0 when such outcomes hold over half the student's mass (test seed 893789761, token (8, 0):
    ids 45 and 8 each twice, KD 48.0 in the reference, which floors the rest, and 6.5 in the fused
    op, which sums the rest from the terms outside S). A cache never lists an id twice per token
    (top-K rows and sampled-counts id sets hold each id once), so ghost has no duplicate to define."""
    _skip_unless_cpu_triton(impl)
    x = make_inputs(s=16, b=2, h=16, vocab=61, k=6)
    x.labels[:8] = x.topk_ids[:8, :, 0].clamp_min(0)
    x.topk_ids[4:12, :, 1] = x.topk_ids[4:12, :, 2]
    x.topk_ids[6:10, :, 3] = x.topk_ids[6:10, :, 0]  # rows 6-7: the label's column listed twice
    kw = dict(labels=x.labels, ce_weight=0.5, temperature=1.5, tail=tail)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(),
                           chunk_size=5, impl=impl, **kw)
    _check(fused, ref, 1e-4)


@pytest.mark.parametrize("tail, temperature, ce_weight", [("ghost", 1.0, 0.5), ("renorm", 2.0, 0.5)])
def test_triton_rows_longer_than_one_tile(seed, tail, temperature, ce_weight):
    """V_local = 9000 spans three 4096-lane tiles (the last one ragged), as every real vocabulary
    does: the kernels' running max / sum-exp across tiles and the in-place gradient of each tile."""
    _skip_unless_cpu_triton("triton")
    x = make_inputs(s=4, b=2, h=16, vocab=9000, k=12)
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail=tail)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(),
                           chunk_size=4, impl="triton", **kw)
    _check(fused, ref, 1e-4)


@pytest.mark.parametrize("tail, temperature, ce_weight", [("none", 1.0, 0.5), ("ghost", 1.0, 0.0), ("renorm", 2.0, 0.5)])
@pytest.mark.parametrize("far", [30.0, 60.0])
def test_triton_rows_far_above_their_teacher_entries(seed, tail, temperature, ce_weight, far):
    """Rows whose student puts one logit `far` nats above the rest, in the last tile, away from the
    teacher entries and the label. At 60 the Triton pass raises the row's reference mid-row (the
    earlier tiles are rescaled) and α vanishes next to the sparse terms (the row is written whole);
    at 30 neither happens. Every row of grad_h is checked on its own."""
    _skip_unless_cpu_triton("triton")
    x = make_inputs(s=6, b=2, h=16, vocab=9000, k=12)
    hot = 8500
    rows = [(0, 0), (2, 1), (5, 0)]
    for s_, b_ in rows:
        w = x.weight[hot]
        x.hidden[s_, b_] = w * (far / w.dot(w))
        x.topk_ids[s_, b_][x.topk_ids[s_, b_] == hot] = 0
        x.labels[s_, b_] = 1
    kw = dict(labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail=tail)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    fused = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(),
                           chunk_size=5, impl="triton", **kw)
    _check(fused, ref, 1e-4)
    for s_, b_ in rows:
        assert rel_err(fused[2][s_, b_], ref[2][s_, b_]) <= 1e-4, (s_, b_)


def test_triton_impl_refuses_what_it_cannot_run(seed, monkeypatch):
    x = make_inputs(s=4, b=1)
    with pytest.raises(ValueError, match="impl='triton' needs bf16/fp16/fp32"):
        fused_topk_kl(x.hidden, x.weight, x.topk_ids, x.topk_logprobs, impl="triton")  # float64
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA tensors"):
        fused_topk_kl(x.hidden.float(), x.weight.float(), x.topk_ids, x.topk_logprobs, impl="triton")


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
def test_chunking_does_not_change_result(seed, chunk_size):
    x = make_inputs(s=31, b=2, vocab=97)
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=0.3, temperature=1.5, tail="ghost")
    whole = loss_and_grads(fused_topk_kl, x, chunk_size=10_000, **kw)
    _check(loss_and_grads(fused_topk_kl, x, chunk_size=chunk_size, **kw), whole, 1e-12)


def test_auto_chunk_size_respects_budget():
    cpu = torch.device("cpu")
    for vocab, tokens in [(201_088, 32_768), (65_536, 8192), (1000, 10), (50, 100_000), (4096, 10**6), (4096, 5000)]:
        c = auto_chunk_size(tokens, vocab, device=cpu, block_dtype=torch.float32,
                            gemm_dtype=torch.float32, extra_block=False)
        assert 1 <= c <= tokens
        assert c == 1 or c * vocab * 4 <= 32 * 2**20
        n = -(-tokens // c)  # no short last chunk: its GEMMs would run far below the others' rate
        assert n == 1 or c < 128 or tokens - (n - 1) * c >= c // 2, (vocab, tokens, c)
    # one extra block halves the chunk
    a = auto_chunk_size(10**6, 4096, device=cpu, block_dtype=torch.float32, gemm_dtype=torch.float32, extra_block=False)
    b = auto_chunk_size(10**6, 4096, device=cpu, block_dtype=torch.float32, gemm_dtype=torch.float32, extra_block=True)
    assert b <= a // 2 + 64


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_masked_gives_zero(seed, tail, reduction):
    x = make_inputs()
    for fn in (fused_topk_kl, topk_kl_reference):
        loss, stats, gh, gw = loss_and_grads(
            fn, x, loss_mask=torch.zeros_like(x.loss_mask), labels=x.labels, ce_weight=0.5,
            temperature=2.0, tail=tail, reduction=reduction,
        )
        assert loss.item() == 0.0
        assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
        assert all(torch.isfinite(v) for v in stats.values())
        assert stats["tokens"].item() == 0


@pytest.mark.parametrize("tail", TAILS)
def test_gradcheck(seed, tail):
    x = make_inputs(s=5, b=1, h=4, vocab=11, k=3)
    h = x.hidden.clone().requires_grad_()
    w = x.weight.clone().requires_grad_()

    def f(h, w):
        return fused_topk_kl(h, w, x.topk_ids, x.topk_logprobs, loss_mask=x.loss_mask, labels=x.labels,
                             ce_weight=0.5, temperature=2.0, tail=tail, chunk_size=2)[0]

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_backward_scales_and_no_grad_mode(seed):
    x = make_inputs()
    _, _, gh1, gw1 = loss_and_grads(fused_topk_kl, x, tail="renorm")
    _, _, gh3, gw3 = loss_and_grads(fused_topk_kl, x, tail="renorm", grad_scale=-3.0)
    assert rel_err(gh3, -3 * gh1) < 1e-12 and rel_err(gw3, -3 * gw1) < 1e-12
    with torch.no_grad():
        loss, _ = fused_topk_kl(x.hidden, x.weight, x.topk_ids, x.topk_logprobs, tail="renorm")
    assert not loss.requires_grad
    ref, _ = topk_kl_reference(x.hidden, x.weight, x.topk_ids, x.topk_logprobs, tail="renorm")
    assert rel_err(loss, ref) < 1e-12


def test_stats_meaning(seed):
    x = make_inputs()
    _, stats = fused_topk_kl(x.hidden, x.weight, x.topk_ids, x.topk_logprobs, loss_mask=x.loss_mask,
                             reduction="mean")
    assert "ce" not in stats  # no labels, no CE
    mass = torch.where(x.topk_ids >= 0, x.topk_logprobs.double().exp(), 0.0).sum(-1)
    assert stats["tokens"].item() == x.loss_mask.sum().item()
    assert rel_err(stats["teacher_mass"], (mass * x.loss_mask).sum() / x.loss_mask.sum()) < 1e-12


def test_gradient_accumulation_fusion_into_main_grad(seed):
    x = make_inputs()
    _, _, gh_ref, gw_ref = loss_and_grads(topk_kl_reference, x, tail="ghost")
    hidden = x.hidden.clone().requires_grad_()
    weight = torch.nn.Parameter(x.weight.clone())
    before = torch.randn_like(weight)
    weight.main_grad = before.clone()
    weight.grad_added_to_main_grad = False
    loss, _ = fused_topk_kl(hidden, weight, x.topk_ids, x.topk_logprobs, tail="ghost",
                            gradient_accumulation_fusion=True)
    assert rel_err(weight.main_grad - before, gw_ref) < 1e-12  # added during forward
    loss.backward()
    assert weight.grad_added_to_main_grad
    assert rel_err(hidden.grad, gh_ref) < 1e-12
    assert rel_err(weight.main_grad - before, gw_ref) < 1e-12  # and not again in backward

    # A scaled loss cannot be honoured (main_grad was written in forward). Backward does not read
    # the incoming gradient (a host sync); the op's next call on this weight raises.
    loss, _ = fused_topk_kl(hidden, weight, x.topk_ids, x.topk_logprobs, gradient_accumulation_fusion=True)
    (2 * loss).backward()
    with pytest.raises(RuntimeError, match="gradient 1; the previous backward passed 2.0"):
        fused_topk_kl(hidden, weight, x.topk_ids, x.topk_logprobs, gradient_accumulation_fusion=True)
    fused_topk_kl(hidden, weight, x.topk_ids, x.topk_logprobs, gradient_accumulation_fusion=True)  # reported once


def _bad_inputs():
    x = make_inputs(vocab=50, k=5)
    ok = dict(hidden=x.hidden, weight=x.weight, topk_ids=x.topk_ids, topk_logprobs=x.topk_logprobs)
    ids_big = x.topk_ids.clone()
    ids_big[0, 0, 0] = 50
    ids_neg = x.topk_ids.clone()
    ids_neg[0, 0, 0] = -2
    lp_nan = x.topk_logprobs.clone()
    lp_nan[1, 1, 1] = float("nan")
    lp_inf = x.topk_logprobs.clone()
    lp_inf[1, 1, 1] = float("inf")
    labels_big = x.labels.clone()
    labels_big[0, 0] = 50
    labels_neg = x.labels.clone()
    labels_neg[1, 0] = -3
    return [
        ("hidden", dict(ok, hidden=x.hidden[..., :-1]), {}),
        ("weight", dict(ok, weight=x.weight[0]), {}),
        ("dtype", dict(ok, hidden=x.hidden.float()), {}),
        ("same shape", dict(ok, topk_logprobs=x.topk_logprobs[..., :-1]), {}),  # K mismatch
        ("topk_ids must be", dict(ok, topk_ids=x.topk_ids[:-1], topk_logprobs=x.topk_logprobs[:-1]), {}),
        ("topk_ids must be int", dict(ok, topk_ids=x.topk_ids.float()), {}),
        ("id 50", dict(ok, topk_ids=ids_big), {}),
        ("id -2", dict(ok, topk_ids=ids_neg), {}),
        ("NaN", dict(ok, topk_logprobs=lp_nan), {}),
        (r"\+inf", dict(ok, topk_logprobs=lp_inf), {}),
        ("labels are required", ok, dict(ce_weight=0.5)),
        ("labels holds id 50", ok, dict(labels=labels_big)),
        ("labels holds id -3", ok, dict(labels=labels_neg)),
        ("labels must have shape", ok, dict(labels=x.labels[:-1])),
        ("loss_mask must have shape", ok, dict(loss_mask=x.loss_mask[:, :1])),
        ("tail", ok, dict(tail="full")),
        ("reduction", ok, dict(reduction="avg")),
        ("temperature", ok, dict(temperature=0.0)),
        ("chunk_size", ok, dict(chunk_size=0)),
        ("main_grad", ok, dict(gradient_accumulation_fusion=True)),
    ]


@pytest.mark.parametrize("fn", [fused_topk_kl, topk_kl_reference])
def test_bad_inputs_raise(seed, fn):
    for match, tensors, kw in _bad_inputs():
        if match == "main_grad" and fn is topk_kl_reference:
            continue  # the reference accepts and ignores gradient_accumulation_fusion
        with pytest.raises(ValueError, match=match):
            fn(**tensors, **kw)
    x = make_inputs()
    with pytest.raises(ValueError, match="impl"):
        fused_topk_kl(x.hidden, x.weight, x.topk_ids, x.topk_logprobs, impl="cuda")


@pytest.mark.parametrize("excess", [1e-6, 0.0, -1e-9])
def test_ghost_mass_rounding_near_one(seed, excess):
    """Cached top-K masses can round a hair above 1; ghost clamps 1 - M at 0 in loss and gradient."""
    x = make_inputs(pad=False)
    lp = x.topk_logprobs.double()
    lp = lp - torch.logsumexp(lp, -1, keepdim=True) + torch.log1p(torch.tensor(excess, dtype=torch.float64))
    x.topk_logprobs = lp
    kw = dict(tail="ghost", loss_mask=x.loss_mask)
    _check(loss_and_grads(fused_topk_kl, x, **kw), loss_and_grads(topk_kl_reference, x, **kw), 1e-12)


def test_repeated_entries_are_the_later_listings_of_an_owned_column(seed):
    """The sort-based mask against its definition, pair by pair: True at an owned entry whose column
    an earlier owned entry of the row names (the first listing stays False; unowned never count)."""
    from megatron_kd.ops.kl.chunk_torch import repeated_entries

    local_idx = torch.randint(0, 6, (64, 9))
    owned = (torch.rand(64, 9) < 0.8).float()
    local_idx = torch.where(owned != 0, local_idx, 0)  # as teacher_terms leaves unowned entries
    got = repeated_entries(local_idx, owned)
    own = owned != 0
    want = torch.zeros_like(own)
    for r in range(64):
        for j in range(9):
            want[r, j] = bool(own[r, j] and any(own[r, i] and local_idx[r, i] == local_idx[r, j] for i in range(j)))
    assert want.any() and (~want & own).any()
    assert torch.equal(got, want)
