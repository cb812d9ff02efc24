"""GPT-OSS's clamped GLU kernels (models/expert_activation.py) against experts.py's plain-torch
activation in float64: fc2's input with and without the bias column, and the gradients of fc1's
output and of the routing probabilities, on rows whose gate and linear halves cross the clamp.

On CPU the kernels run in Triton's interpreter (conftest sets it without a GPU); on a GPU machine
the same tests run them compiled (`pytest -m cuda`), also in bf16.
"""

import pytest
import torch

from megatron_kd.models.expert_activation import clamped_glu, is_quick_gelu
from megatron_kd.models.experts import _scaled_activation_with_bias_column, bias_column_width
from megatron.core.activations import quick_gelu
from tests.fixtures.triton_device import DEVICE, TRITON_DEVICE_MARKS

pytestmark = TRITON_DEVICE_MARKS  # compiled on a GPU (`pytest -m cuda`), else Triton's interpreter
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative (Frobenius), to the float64 result


def _reference(h, probs, width, clamp):
    return _scaled_activation_with_bias_column(h, probs, width, True, clamp, 1.0, quick_gelu)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inner, bias_column, clamp", [
    (37, 300, True, 7.0),  # ragged row and column blocks, the p column and padding
    (16, 256, False, 7.0),  # fc2 without bias: I columns exactly
    (5, 40, True, None),  # no clamp
    (0, 64, True, 7.0),  # an expert with no routed rows
])
def test_clamped_glu_matches_the_torch_activation(seed, dtype, rows, inner, bias_column, clamp):
    h = (torch.randn(rows, 2 * inner, device=DEVICE) * 6).to(dtype)  # |x| > 7 on ~25% of entries
    probs = torch.rand(rows, device=DEVICE)
    width = bias_column_width(inner, dtype) if bias_column else inner
    d_out = torch.randn(rows, width, device=DEVICE).to(dtype)

    h64, p64 = h.double().requires_grad_(), probs.double().requires_grad_()
    ref = _reference(h64, p64, width, clamp)
    ref.backward(d_out.double())

    h_in, p_in = h.clone().requires_grad_(), probs.clone().requires_grad_()
    out = clamped_glu(h_in, p_in, width, clamp, 1.0)
    out.backward(d_out)
    assert out.shape == (rows, width) and out.dtype == dtype
    if rows == 0:
        assert h_in.grad.shape == h.shape and p_in.grad.shape == probs.shape
        return
    if bias_column:  # the bias column is p itself and the padding exact zeros
        assert torch.equal(out[:, inner], probs.to(dtype))
        assert not out[:, inner + 1:].any()
    assert _rel(out, ref) < BOUND[dtype]
    assert _rel(h_in.grad, h64.grad) < BOUND[dtype]
    assert _rel(p_in.grad, p64.grad) < BOUND[dtype]
    clamped = (h[:, :inner].double() > clamp) if clamp is not None else None
    if clamped is not None and clamped.any():  # the clamp stops the gate's gradient
        assert not h_in.grad[:, :inner][clamped].any()


def test_is_quick_gelu_names_megatrons_activations():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu
    assert is_quick_gelu(quick_gelu) and is_quick_gelu(fused_quick_gelu)
    assert not is_quick_gelu(torch.nn.functional.silu)
