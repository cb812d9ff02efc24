"""The ghost tail's rest outcomes where they are tiny: the teacher's 1 - M and the student's 1 - Q_S.

Both are differences of nearly equal numbers when formed as 1 minus a sum over the K entries, so in
fp32 they come out eps32/(1 - M) and eps32·Q_S/(1 - Q_S) wrong (at 1 - M ~ 1e-7: all of it), and
reverse KL, whose rest term is Q_r (log Q_r - log P_r) and whose gradient carries g_r = log Q_r -
log P_r on every entry, inherits that. The op forms both from their own terms (the teacher's in
float64 once per call, the student's as the sum outside S), so fp32 meets the float64 reference to
fp32 accuracy (1e-4, the bound of every fp32 test here) in that regime too.

1. rows built so that 1 - M and 1 - Q_S lie in [1e-8, 1e-4]: reverse and jsd, torch and the Triton
   kernels (interpreter), loss and both gradients, every such row's own gradient
2. the inputs of test_topk_kl_cuda.py's reverse / jsd case (V = 20,000, K = 100, Student-t teachers,
   whose heaviest rows have 1 - M down to ~1e-8), torch fp32 on CPU
"""

import os

import pytest
import torch

from megatron_kd.ops import fused_topk_kl, topk_kl_reference
from tests.fixtures.kd_inputs import loss_and_grads, make_inputs, rel_err

FP32_TOL = 1e-4


def _skip_unless_cpu_triton(impl):
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (no-GPU machines)")


def _peaked_rows(s=6, b=2, h=64, vocab=4099, k=16):
    """A student that puts 1 - 1e-4 .. 1 - 1e-8 of its mass on its own top K (hidden rows scaled up),
    and a teacher on those ids that is sharper still (the student's log-softmax x 1.5, renormalized
    to hold all but 1e-5 .. 3e-8 of the mass). Returns the inputs and both rest masses (float64)."""
    x = make_inputs(s=s, b=b, h=h, vocab=vocab, k=k, pad=False)
    rows = s * b
    logits = x.hidden.reshape(rows, h) @ x.weight.t()
    want = torch.logspace(-4.5, -8, rows, dtype=torch.float64)  # 1 - Q_S per row
    lo, hi = torch.ones(rows, dtype=torch.float64), torch.full((rows,), 64.0, dtype=torch.float64)
    for _ in range(60):  # bisect each row's scale: the student's top-K rest falls as its logits grow
        mid = (lo + hi) / 2
        rest = -torch.expm1(torch.logsumexp(torch.log_softmax(mid[:, None] * logits, -1).topk(k, -1)[0], -1))
        lo, hi = torch.where(rest > want, mid, lo), torch.where(rest > want, hi, mid)
    x.hidden = (x.hidden.reshape(rows, h) * hi[:, None]).reshape(s, b, h)
    log_q = torch.log_softmax(x.hidden.reshape(rows, h) @ x.weight.t(), -1)
    top, ids = log_q.topk(k, -1)
    teacher_rest = torch.logspace(-5, -7.5, rows, dtype=torch.float64)
    lp = torch.log_softmax(1.5 * top, -1) + torch.log1p(-teacher_rest)[:, None]
    x.topk_ids = ids.reshape(s, b, k)
    x.topk_logprobs = lp.float().reshape(s, b, k)
    student_rest = -torch.expm1(torch.logsumexp(top, -1))
    mass = x.topk_logprobs.double().exp().sum(-1).reshape(-1)
    return x, student_rest, 1.0 - mass


def _fp32_logit_sensitivity(x, kw, draws: int = 4) -> torch.Tensor:
    """Per row, how far the float64 reference's hidden gradient moves when every logit moves by one
    fp32 unit of its dot product, eps32·Σ_i |h_i||w_i| (random signs; the largest of ``draws``)."""
    rows, h = x.hidden.shape[0] * x.hidden.shape[1], x.hidden.shape[-1]
    hidden, weight = x.hidden.reshape(rows, h).double(), x.weight.double()
    logits = hidden @ weight.t()
    eye = torch.eye(logits.shape[1], dtype=torch.float64)  # the reference on the logits themselves

    def hidden_grad(z):
        z = z.detach().reshape(*x.hidden.shape[:2], -1).requires_grad_()
        loss, _ = topk_kl_reference(z, eye, x.topk_ids, x.topk_logprobs, **kw)
        loss.backward()
        return z.grad.reshape(rows, -1) @ weight

    exact, unit = hidden_grad(logits), (hidden.abs() @ weight.abs().t()) * torch.finfo(torch.float32).eps / 2
    gen, moved = torch.Generator().manual_seed(0), torch.zeros(rows, dtype=torch.float64)
    for _ in range(draws):
        signs = torch.randint(0, 2, logits.shape, generator=gen).double() * 2 - 1
        moved = torch.maximum(moved, (hidden_grad(logits + unit * signs) - exact).norm(dim=-1))
    return moved


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("divergence, temperature, ce_weight", [("reverse", 1.0, 0.0), ("reverse", 2.0, 0.5),
                                                                 ("jsd", 1.0, 0.1)])
def test_tiny_rest_masses_match_float64_reference(seed, impl, divergence, temperature, ce_weight):
    _skip_unless_cpu_triton(impl)
    x, student_rest, teacher_rest = _peaked_rows()
    # the regime this test is about (the construction's own check)
    assert student_rest.max() < 1e-4 and student_rest.min() > 1e-9, student_rest
    assert teacher_rest.max() < 2e-5 and teacher_rest.min() > 1e-9, teacher_rest
    kw = dict(labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail="ghost", divergence=divergence,
              jsd_beta=0.3)
    ref = loss_and_grads(topk_kl_reference, x, **kw)
    got = loss_and_grads(fused_topk_kl, x, hidden=x.hidden.float(), weight=x.weight.float(), chunk_size=5,
                         impl=impl, **kw)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got[:1] + got[2:], ref[:1] + ref[2:]):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) <= FP32_TOL, (name, rel_err(a, b))
    for key in ref[1]:
        assert rel_err(got[1][key], ref[1][key]) <= FP32_TOL, key
    # Each row's own gradient. Where a row's student all but equals its teacher, its exact gradient is
    # ill-conditioned in the logits: dL/du_w = q_w (Q_S g_r - H) + [w∈S] q_w (g_w - g_r) is a sum of
    # O(|g_r|) terms that cancel to far less, and the fp32 GEMM that makes the logits (each one
    # eps32·Σ|h||w| off) moves it by more than FP32_TOL of the row, whatever the op does after. So a
    # row's bound is the larger of FP32_TOL of its scale (the typical row's) and 8x how far the float64
    # reference itself moves under that rounding of every logit (random signs, 4 draws): the op must be
    # as exact as fp32 logits allow. (Over 30 seeds, 2026-12-03: at most 0.34 of this bound.)
    got_rows, ref_rows = got[2].reshape(-1, x.hidden.shape[-1]).double(), ref[2].reshape(-1, x.hidden.shape[-1])
    scale = ref_rows.norm(dim=-1).clamp_min(ref_rows.norm(dim=-1).median())
    per_row = (got_rows - ref_rows).norm(dim=-1)
    row_tol = torch.maximum(FP32_TOL * scale, 8 * _fp32_logit_sensitivity(x, kw))
    assert (per_row <= row_tol).all(), (per_row, row_tol)


@pytest.mark.parametrize("divergence, temperature, ce_weight", [("reverse", 2.0, 0.5), ("reverse", 1.0, 0.1),
                                                                 ("jsd", 1.0, 0.0)])
def test_cuda_case_inputs_torch_fp32(seed, divergence, temperature, ce_weight):
    """test_topk_kl_cuda.py::test_cuda_reverse_and_jsd_match_float64_reference's inputs and bound
    (fp32: 1e-4) on CPU, impl="torch" (the same per-row formulas; only reduction orders differ from
    CUDA). Random Student-t teachers have rows with 1 - M down to ~1e-8 on some seeds only, so four
    rows get such a teacher here on every seed."""
    x = make_inputs(s=150, b=2, h=128, vocab=20_000, k=100)
    lp = x.topk_logprobs[10:12].double()
    lp = torch.log_softmax(4.0 * torch.where(torch.isfinite(lp), lp, -torch.inf), -1)
    x.topk_logprobs[10:12] = (lp + torch.log1p(-torch.tensor([[3e-8], [1e-7]], dtype=torch.float64))
                              .unsqueeze(1)).float()
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail="ghost",
              divergence=divergence, jsd_beta=0.3)
    x.loss_mask[10:12] = 1.0
    h, w = x.hidden.float(), x.weight.float()
    ref = loss_and_grads(topk_kl_reference, x, hidden=h.double(), weight=w.double(), **kw)
    got = loss_and_grads(fused_topk_kl, x, hidden=h, weight=w, chunk_size=128, impl="torch", **kw)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got[:1] + got[2:], ref[:1] + ref[2:]):
        assert rel_err(a, b) <= FP32_TOL, (name, rel_err(a, b))
    for key in ref[1]:
        assert rel_err(got[1][key], ref[1][key]) <= FP32_TOL, key
