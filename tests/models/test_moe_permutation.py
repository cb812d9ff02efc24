"""The MoE permutation without atomics (megatron_kd/models/moe_permutation.py) against megatron-core's.

1. ``gather_sum``: the Triton kernel (on CUDA, or Triton's interpreter on the CPU) and the torch ops
   equal the float64 sum of each token's rows, rounded once, for any number of rows per token
2. permute → experts → unpermute through ``_Spread`` / ``_Combine`` gives megatron-core's outputs and
   gradients (tokens, probabilities) for top-k routing, bf16 within the rounding of its atomics
3. the cases it takes and the ones it hands to megatron-core; the rows grouped by token
"""

import os

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute as megatron_permute
from megatron.core.transformer.moe.moe_utils import unpermute as megatron_unpermute

from megatron_kd.models.moe_permutation import _Combine, _Spread, covered, gather_sum, rows_by_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS, EXPERTS, TOPK, HIDDEN = 37, 6, 3, 1100  # hidden over more than one kernel block


def _routing(gen):
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    top = logits.topk(TOPK, dim=1)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(TOKENS, EXPERTS).scatter(1, top.indices, top.values.softmax(-1))
    return routing_map.to(DEVICE), probs.to(DEVICE)


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_gather_sum_is_the_sum_rounded_once(seed, use_triton):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(TOKENS * TOPK, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    # 0 to 2·TOPK rows per token, in any order (an all-gather dispatcher's local rows vary per token)
    token_of_row = torch.randint(0, TOKENS, (TOKENS * TOPK,), generator=gen)
    token_of_row[token_of_row == 5] = 6  # token 5 has no row: its sum is 0
    out = gather_sum(rows, token_of_row.to(DEVICE), TOKENS, use_triton=use_triton)
    exact = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64).index_add_(0, token_of_row, rows.double().cpu()).to(DEVICE)
    assert out.dtype == torch.bfloat16 and (out[5] == 0).all()
    # one rounding to nearest (the interpreter casts to bf16 toward zero: one unit in the last place)
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_combine_equal_megatron_core(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    routing_map, probs = _routing(gen)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(TOKENS * TOPK, 1, generator=gen).to(DEVICE, dtype)  # "experts": a row-wise scale
    grad = torch.randn(TOKENS, HIDDEN, generator=gen).to(DEVICE, dtype)
    results = []
    for ours in (False, True):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        rows, permuted_probs, token_of_row, _, _ = megatron_permute(xi.detach()[:, :0] if ours else xi, routing_map,
                                                                  probs=pi, num_out_tokens=TOKENS * TOPK)
        if ours:
            rows = _Spread.apply(xi, token_of_row)
        expert_out = rows * weight * permuted_probs.unsqueeze(-1).to(dtype)
        out = (_Combine.apply(expert_out, token_of_row, TOKENS) if ours else
               megatron_unpermute(expert_out, token_of_row, x.shape, routing_map=routing_map))
        out.backward(grad)
        results.append((out.detach(), xi.grad, pi.grad))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -6)
    for theirs, mine in zip(*results):
        torch.testing.assert_close(mine.float(), theirs.float(), **tol)


def test_what_it_takes_and_the_rows_by_token():
    assert covered(True, fused=False, drop_and_pad=False)
    assert not covered(False, fused=False, drop_and_pad=False)  # CPU: megatron-core's
    assert not covered(True, fused=True, drop_and_pad=False)  # TE's fused permute
    assert not covered(True, fused=False, drop_and_pad=True)  # capacity padding
    order, offsets = rows_by_token(torch.tensor([3, 0, 1, 1, 0, 3]), 4)
    assert order.tolist() == [1, 4, 2, 3, 0, 5] and offsets.tolist() == [0, 2, 4, 4, 6]  # token 2: no rows
