"""fused_topk_kl on CUDA: the mixed-precision GEMM path (bf16 operands, fp32 logits and grad_W).

Skipped without a GPU (CI is CPU-only); run on the device machine with the same command.
"""

import pytest
import torch

from kd_inputs import loss_and_grads, make_inputs, rel_err
from megatron_kd.ops import TAILS, fused_topk_kl, topk_kl_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("temperature, ce_weight", [(1.0, 0.0), (2.0, 0.5)])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_cuda_matches_float64_reference(seed, tail, temperature, ce_weight, dtype, tol):
    x = make_inputs(s=300, b=2, h=128, vocab=1031, k=32)
    h, w = x.hidden.to(dtype), x.weight.to(dtype)
    kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=ce_weight, temperature=temperature, tail=tail)
    ref = loss_and_grads(topk_kl_reference, x, hidden=h.double(), weight=w.double(), **kw)
    cuda = x.to("cuda")
    got = loss_and_grads(fused_topk_kl, cuda, hidden=h.cuda(), weight=w.cuda(), chunk_size=128, grad_scale=1.0,
                         **{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert torch.isfinite(a).all()
        assert rel_err(a.cpu(), b) <= tol
    for key in ref[1]:
        assert rel_err(got[1][key].cpu(), ref[1][key]) <= tol, key


def test_cuda_gradient_accumulation_fusion_fp32_main_grad(seed):
    x = make_inputs(s=200, b=2, h=64, vocab=515, k=16).to("cuda")
    _, _, _, gw_ref = loss_and_grads(topk_kl_reference, x, tail="ghost")
    weight = torch.nn.Parameter(x.weight.bfloat16())
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device="cuda")
    weight.grad_added_to_main_grad = False
    hidden = x.hidden.bfloat16().requires_grad_()
    loss, _ = fused_topk_kl(hidden, weight, x.topk_ids, x.topk_logprobs, tail="ghost",
                            gradient_accumulation_fusion=True, chunk_size=64)
    loss.backward()
    assert weight.grad_added_to_main_grad
    assert rel_err(weight.main_grad, gw_ref) <= 1e-2


def test_cuda_memory_is_bounded_by_the_chunk(seed):
    """Peak memory above inputs + gradients stays near one chunk's blocks, not tokens x vocab."""
    tokens, hid, vocab, k = 8192, 512, 32768, 64
    dev = torch.device("cuda")
    hidden = torch.randn(tokens, hid, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, hid, device=dev) / hid**0.5).bfloat16().requires_grad_()
    ids = torch.randint(0, vocab, (tokens, k), device=dev)
    lps = torch.log_softmax(torch.randn(tokens, k, device=dev), -1) - 0.1
    chunk = 512
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, _ = fused_topk_kl(hidden, weight, ids, lps, chunk_size=chunk)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = hidden.numel() * 2 + weight.numel() * 2
    # one fp32 block + its bf16 copy + the fp32 grad_W accumulator (no main_grad here) + slack
    allowed = grads + chunk * vocab * 6 + weight.numel() * 4 + 64 * 2**20
    assert extra <= allowed, (extra / 2**20, allowed / 2**20)
    assert extra < tokens * vocab * 4  # far below one full fp32 logits tensor
