"""megatron_kd/megatron/optimizer.py: megatron-core builds torch's fused AdamW when asked.

1. without the patch megatron-core (no TE / Apex) builds the multi-tensor AdamW; with it the same
   builder call gives ``fused=True`` (CPU parameters here; CUDA parameters on a GPU machine)
2. the fused update equals the multi-tensor one over several steps (torch 2.11 has fused AdamW on CPU)
3. the patch is idempotent and leaves ``torch.optim.AdamW`` itself alone outside the builder
"""

import pytest
import torch

import megatron.core.optimizer as mcore_optimizer
from megatron.core.optimizer import OptimizerConfig

from megatron_kd.megatron.optimizer import fused_eligible, use_fused_torch_adamw

pytestmark = pytest.mark.skipif(not mcore_optimizer.USING_PYTORCH_OPTIMIZER,
                                reason="megatron-core uses TE's / Apex's FusedAdam here")


@pytest.fixture
def restore_builder(monkeypatch):
    """Undo the patch after the test (monkeypatch restores the module attribute)."""
    monkeypatch.setattr(mcore_optimizer, "_get_megatron_optimizer_based_on_param_groups",
                        mcore_optimizer._get_megatron_optimizer_based_on_param_groups)


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g).to(device)) for shape in ((64, 48), (48,), (7, 5, 3))]


def _build(params):
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                             adam_eps=1e-8)
    groups = [{"params": params[:2], "wd_mult": 1.0}, {"params": params[2:], "weight_decay": 0.0}]
    optimizer, _ = mcore_optimizer._get_megatron_optimizer_based_on_param_groups(
        config, model_chunks=[], param_groups=groups, skip_megatron_wrapping=True)
    return optimizer


def _check_builds_fused(device):
    plain = _build(_params(device))
    assert type(plain) is torch.optim.AdamW and not plain.defaults["fused"]
    assert use_fused_torch_adamw()
    fused = _build(_params(device))
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"]
    assert all(group["fused"] for group in fused.param_groups)
    assert torch.optim.AdamW is type(plain)  # only swapped inside the builder call


def test_patched_builder_makes_fused_adamw_cpu(restore_builder):
    _check_builds_fused(torch.device("cpu"))


@pytest.mark.cuda
def test_patched_builder_makes_fused_adamw_cuda(restore_builder):
    _check_builds_fused(torch.device("cuda"))


def test_fused_update_equals_multi_tensor_update(restore_builder, seed):
    reference, patched, initial = _params("cpu", seed), _params("cpu", seed), _params("cpu", seed)
    foreach = _build(reference)
    use_fused_torch_adamw()
    fused = _build(patched)
    assert fused.defaults["fused"] and not foreach.defaults["fused"]
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(5):
        for a, b in zip(reference, patched):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        foreach.step()
        fused.step()
    for a, b, start in zip(reference, patched, initial):
        assert (a - start).abs().mean() > 5e-3  # five steps of lr 1e-2 moved the parameters
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_patch_is_idempotent(restore_builder):
    assert use_fused_torch_adamw()
    once = mcore_optimizer._get_megatron_optimizer_based_on_param_groups
    assert use_fused_torch_adamw()
    assert mcore_optimizer._get_megatron_optimizer_based_on_param_groups is once
    assert once.__wrapped__ is not once and not getattr(once.__wrapped__, "megatron_kd_fused_adamw", False)


def test_ineligible_parameters_keep_the_default():
    assert fused_eligible([torch.zeros(2)]) and fused_eligible([{"params": [torch.zeros(2)]}])
    assert not fused_eligible([torch.zeros(2, dtype=torch.int64)])
    assert not fused_eligible([torch.zeros(2, device="meta")])
    assert not fused_eligible([])
