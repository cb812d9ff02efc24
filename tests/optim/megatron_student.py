"""A megatron-core model wrapped for training the way Megatron-LM wraps it (bf16 Float16Module,
DistributedDataParallel with the distributed optimizer's parameter buffer, ``get_megatron_optimizer``),
with megatron-core's default optimizer or a ``--kd-optimizer`` choice installed. Shared by the
optimizer tests and benchmarks/bench_optimizer.py; on CPU run it inside
``megatron_cpu.megatron_optimizer_cpu_patches``."""

from __future__ import annotations

import torch

from megatron_kd.optim import megatron as kd_optimizer


def optimizer_config(choice: str, *, lr: float, weight_decay: float = 0.0, clip_grad: float = 1.0,
                     betas=(0.9, 0.999), eps: float = 1e-8, moments: str | None = None, grad_fp32: bool | None = None):
    """megatron-core's OptimizerConfig as Megatron-LM fills it from the flags of ``choice`` (what
    ``expand_optimizer_flags`` adds): precision-aware with bf16 gradients and 1-byte moments for
    bf16-sr-8bit. ``moments`` / ``grad_fp32`` override the choice's, for measurements."""
    from megatron.core.optimizer import OptimizerConfig

    common = dict(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=weight_decay, clip_grad=clip_grad,
                  adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, bf16=True, use_distributed_optimizer=True)
    if choice == "megatron":
        return OptimizerConfig(**common)
    moment_dtype = torch.float32 if moments == "fp32" else torch.uint8
    grads = torch.float32 if grad_fp32 else torch.bfloat16
    return OptimizerConfig(**common, use_precision_aware_optimizer=True, main_grads_dtype=grads,
                           exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)


def wrap_for_training(model, choice: str, *, lr: float, seed: int = 0, weight_decay: float = 0.0,
                      clip_grad: float = 1.0, betas=(0.9, 0.999), rounding: str | None = None,
                      moments: str | None = None, grad_fp32: bool | None = None, bucket_size: int | None = None):
    """(DDP-wrapped bf16 model, megatron optimizer). ``rounding`` / ``moments`` / ``grad_fp32``
    change the bf16-sr-8bit choice's settings (measurements); megatron's default always keeps fp32
    gradients (Megatron-LM turns on --accumulate-allreduce-grads-in-fp32 for bf16)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    overrides = {k: v for k, v in (("rounding", rounding), ("moments", moments)) if v is not None}
    kd_optimizer.install(choice, seed=seed, **overrides)
    config = model.config
    config.bf16 = True
    fp32_grads = choice == "megatron" or bool(grad_fp32)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=fp32_grads,
                                               bucket_size=bucket_size)
    wrapped = DistributedDataParallel(config, ddp_config, Float16Module(config, model))
    opt_config = optimizer_config(choice, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, betas=betas,
                                  moments=moments, grad_fp32=grad_fp32)
    return wrapped, get_megatron_optimizer(opt_config, [wrapped])
