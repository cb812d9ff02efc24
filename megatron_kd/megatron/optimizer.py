"""torch's fused AdamW for megatron-core's optimizer when Transformer Engine and Apex are absent.

megatron-core 0.19 (``megatron/core/optimizer/__init__.py``) imports TE's or Apex's ``FusedAdam``
and, when neither is installed, sets ``USING_PYTORCH_OPTIMIZER`` and builds
``torch.optim.AdamW(params, lr, weight_decay, betas, eps, capturable)`` (``torch.optim.Adam``
without decoupled weight decay) in ``_get_megatron_optimizer_based_on_param_groups``. Without
``fused`` or ``foreach`` torch picks its multi-tensor (foreach) implementation: several kernels per
tensor list and per-list temporaries. torch's own ``fused=True`` implementation does the whole
update in one kernel per chunk of tensors, with the same arithmetic in fp32.

``use_fused_torch_adamw()`` wraps that builder (the module attribute its callers look up): for the
duration of each call ``torch.optim.AdamW`` / ``torch.optim.Adam`` are subclasses that pass
``fused=True`` when every parameter is a floating-point tensor on a device with fused kernels
(CUDA; CPU in torch >= 2.4, which the tests use). Everything else megatron-core does with the
optimizer (its wrappers, the distributed optimizer's ``isinstance`` checks, checkpoints) sees an
ordinary ``torch.optim.AdamW``. Opt-in (``--kd-fused-adam``), idempotent, logged; a no-op when TE or
Apex provides megatron-core's ``FusedAdam`` or ``megatron_kd.optim`` replaced megatron-core's Adam
(``--kd-optimizer``: then ``USING_PYTORCH_OPTIMIZER`` is False too). The optimizer's parameter
groups carry torch's ``fused`` key, and torch's ``load_state_dict`` restores a checkpoint's groups
as saved: a run resumed from a checkpoint written without the flag keeps the multi-tensor update.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

logger = logging.getLogger(__name__)

FUSED_DEVICES = ("cuda", "cpu")  # devices with torch's fused Adam/AdamW kernels (torch 2.11)


def fused_eligible(param_groups) -> bool:
    """True when every parameter of ``param_groups`` (tensors or dicts with "params") can take the
    fused update: a floating-point tensor on a device with fused kernels."""
    params = []
    for group in param_groups:
        params.extend(group["params"] if isinstance(group, dict) else [group])
    return bool(params) and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)


def _fused_variant(base: type) -> type:
    """``base`` (torch.optim.AdamW or Adam) constructed with ``fused=True`` where eligible."""

    class Fused(base):
        def __init__(self, params, *args, fused=None, **kwargs):
            params = list(params)
            if fused is None and fused_eligible(params):
                fused = True
            super().__init__(params, *args, fused=fused, **kwargs)

    Fused.__name__ = Fused.__qualname__ = f"Fused{base.__name__}"
    return Fused


@contextlib.contextmanager
def _torch_adam_classes_fused():
    """torch.optim.AdamW / Adam replaced by their fused variants inside the block."""
    saved = torch.optim.AdamW, torch.optim.Adam
    torch.optim.AdamW, torch.optim.Adam = _fused_variant(saved[0]), _fused_variant(saved[1])
    try:
        yield
    finally:
        torch.optim.AdamW, torch.optim.Adam = saved


def use_fused_torch_adamw() -> bool:
    """Make megatron-core build torch's fused AdamW. Returns True when the patch is in place (now or
    from an earlier call), False when megatron-core uses TE's or Apex's FusedAdam (nothing to do)."""
    import megatron.core.optimizer as mcore_optimizer

    if not mcore_optimizer.USING_PYTORCH_OPTIMIZER:
        logger.info("megatron_kd: torch's fused AdamW not installed: megatron-core does not build torch's AdamW "
                    "here (Transformer Engine's or Apex's FusedAdam, or another --kd-optimizer, is in use)")
        return False
    builder = mcore_optimizer._get_megatron_optimizer_based_on_param_groups
    if getattr(builder, "megatron_kd_fused_adamw", False):
        return True

    @functools.wraps(builder)
    def build_with_fused_adamw(*args, **kwargs):
        with _torch_adam_classes_fused():
            return builder(*args, **kwargs)

    build_with_fused_adamw.megatron_kd_fused_adamw = True
    mcore_optimizer._get_megatron_optimizer_based_on_param_groups = build_with_fused_adamw
    logger.warning("megatron_kd: megatron-core's optimizer builds torch.optim.AdamW(fused=True) "
                   "(no Transformer Engine or Apex FusedAdam here)")
    return True
