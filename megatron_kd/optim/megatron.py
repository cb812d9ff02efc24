"""``--kd-optimizer``: which optimizer megatron-core builds, wired into its own construction.

    --kd-optimizer megatron        (default) what megatron-core builds from its own flags
    --kd-optimizer bf16-sr-8bit    Bf16Adam: bf16 weights updated by stochastic rounding (no fp32
                                   master copy), 8-bit blockwise moments, bf16 gradients

How ``bf16-sr-8bit`` runs inside megatron-core 0.19 (nothing around it):
1. ``expand_optimizer_flags`` adds the Megatron-LM flags it stands for (``IMPLIED_FLAGS``):
   ``--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16
   --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8``, and refuses flags that contradict it. So the DDP
   gradient buffer is bf16 (2 bytes) and megatron-core takes its precision-aware path: the
   distributed optimizer hands the optimizer this rank's shards of the bf16 parameters themselves
   (no fp32 main copy) with their gradients as ``decoupled_grad``, and checkpoints the optimizer
   through ``get_unscaled_state`` / ``set_scaled_state`` in any of its sharding formats.
2. ``install`` (opt-in, idempotent, logged) rebinds the names megatron-core builds that path from:
   ``megatron.core.optimizer.Adam`` (Transformer Engine's FusedAdam where TE is installed, else
   torch's AdamW, which cannot take the precision-aware keywords) becomes ``Bf16Adam`` bound to the
   choice, with ``USING_PYTORCH_OPTIMIZER`` False so it is called with FusedAdam's keywords;
   ``distrib_optimizer``'s ``Adam`` / ``HAVE_APEX_OR_TE`` / ``USING_TE_OPTIMIZER`` say a FusedAdam-like
   optimizer is in use (the step is read from the param groups); and ``OptimizerConfig``'s check
   that TE's FusedAdam exists (the last statement of its precision-aware branch) is skipped when TE
   is absent. With TE installed (NGC) the same rebinding applies: TE's FusedAdam offers fp32 or fp16
   master weights (or bf16 + 16-bit remainders) and fp32/fp16/bf16/fp8 moments with per-tensor
   scales, round-to-nearest, none of which reaches ~2 bytes per parameter; Bf16Adam runs instead.
   ``uninstall`` restores every name.
The stochastic-rounding streams are keyed by ``--seed`` and by the rank in the model-parallel group
(experts: the expert-tensor-model-pipeline group), so replicas over data parallelism draw the same
bits and different shards of a weight different ones.

``optimizer_memory`` gives the bytes per parameter that ``megatron-kd plan`` counts.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from megatron_kd.errors import FlagError
from megatron_kd.optim.adam import Bf16Adam, state_bytes_per_element

OPTIMIZERS = ("megatron", "bf16-sr-8bit")
DEFAULT_OPTIMIZER = "megatron"
HELP = ("Optimizer state. 'megatron': what megatron-core builds from its own flags (fp32 master weights and "
        "moments by default: 12 bytes per parameter, plus fp32 gradients). 'bf16-sr-8bit': Adam on the bf16 "
        "weights with stochastic rounding (no fp32 master copy), 8-bit blockwise moments and bf16 gradients: "
        "~2 bytes of state and 2 of gradient per parameter, what fits a full GPT-OSS-120B student on one 8 x H200 "
        "node; it implies --bf16 --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16 "
        "--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8. Within 0.5%% of 'megatron' in held-out cross-entropy at lr 1e-5 "
        "and 1e-4 in benchmarks/bench_optimizer.py; checkpoints hold fp32 values (Megatron's format) and resume "
        "bit for bit.")

# (flag, value or None for a switch) that a choice stands for
IMPLIED_FLAGS = {
    "bf16-sr-8bit": (("--bf16", None), ("--use-distributed-optimizer", None),
                     ("--use-precision-aware-optimizer", None), ("--main-grads-dtype", "bf16"),
                     ("--exp-avg-dtype", "fp8"), ("--exp-avg-sq-dtype", "fp8")),
}
# flags that contradict a choice, and why
CONFLICTING_FLAGS = {
    "bf16-sr-8bit": {
        "--fp16": "it updates bf16 weights",
        "--fp8-param-gather": "it updates bf16 weights (fp8 parameters have no bf16 shard to update)",
        "--accumulate-allreduce-grads-in-fp32": "it keeps bf16 gradients",
        "--optimizer-cpu-offload": "its state stays on the GPUs (Megatron's offload runs torch's fp32 Adam)",
        "--main-params-dtype": "it keeps no master copy",
        "--optimizer-cuda-graph": "it does not run inside a CUDA graph",
        "--use-megatron-fsdp": "it runs under Megatron's distributed optimizer",
        "--kd-fused-adam": "it is not torch's AdamW (which --kd-fused-adam builds with fused=True)",
    },
}

logger = logging.getLogger(__name__)


def _kd_optimizer(argv: list[str]) -> str:
    choice = DEFAULT_OPTIMIZER
    for i, token in enumerate(argv):
        if token == "--kd-optimizer" and i + 1 < len(argv):
            choice = argv[i + 1]
        elif token.startswith("--kd-optimizer="):
            choice = token.split("=", 1)[1]
    if choice not in OPTIMIZERS:
        raise FlagError(f"--kd-optimizer must be one of {', '.join(OPTIMIZERS)}, got {choice!r}")
    return choice


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``argv`` (the last one), "" for a switch, None if absent."""
    value = None
    for i, token in enumerate(argv):
        if token == flag:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def expand_optimizer_flags(argv: list[str]) -> list[str]:
    """``argv`` plus the Megatron-LM flags its ``--kd-optimizer`` choice implies (those not given);
    a flag that contradicts the choice is a ``FlagError``."""
    choice = _kd_optimizer(argv)
    if choice == "megatron":
        return list(argv)
    for flag, reason in CONFLICTING_FLAGS[choice].items():
        if _flag_value(argv, flag) is not None:
            raise FlagError(f"{flag} contradicts --kd-optimizer {choice}: {reason}; drop {flag}")
    optimizer = _flag_value(argv, "--optimizer")
    if optimizer not in (None, "adam"):
        raise FlagError(f"--optimizer {optimizer} contradicts --kd-optimizer {choice}, an Adam: drop --optimizer")
    out = list(argv)
    for flag, value in IMPLIED_FLAGS[choice]:
        given = _flag_value(argv, flag)
        if given is None:
            out += [flag] if value is None else [flag, value]
        elif value is not None and given != value:
            raise FlagError(f"{flag} {given} contradicts --kd-optimizer {choice}, which needs {flag} {value}: "
                            f"drop {flag}")
    return out


@dataclass(frozen=True)
class OptimizerMemory:
    """Bytes per parameter: optimizer state (on the rank that updates it) and gradient buffer."""

    state: float
    gradient: float


def optimizer_memory(choice: str) -> OptimizerMemory:
    """What ``megatron-kd plan`` counts for a ``--kd-optimizer`` choice other than "megatron"
    (whose bytes follow Megatron's own flags). Tensors under 4,096 elements keep fp32 moments: a
    few MB in a 120B model, not counted."""
    if choice == "bf16-sr-8bit":
        return OptimizerMemory(state=state_bytes_per_element("8bit"), gradient=2.0)
    raise ValueError(f"optimizer_memory: no fixed bytes for --kd-optimizer {choice!r}")


# ---- the patch ---------------------------------------------------------------------------------


def _model_parallel_stream(group: dict) -> int:
    """Rank in the group of ranks that hold different weights (data-parallel replicas share it)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    if group.get("is_expert_parallel", False):
        return torch.distributed.get_rank(parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return torch.distributed.get_rank(parallel_state.get_model_parallel_group())


# Bf16Adam's settings of each choice
SETTINGS = {"bf16-sr-8bit": {"rounding": "stochastic", "moments": "8bit"}}


def bound_optimizer(choice: str, seed: int, **overrides) -> type[Bf16Adam]:
    """``Bf16Adam`` with the choice's settings (``overrides``: other ``rounding`` / ``moments``, for
    measurements), as megatron-core will construct it."""
    if choice not in SETTINGS:
        raise ValueError(f"bound_optimizer: {choice!r} is megatron-core's own optimizer")
    settings = {**SETTINGS[choice], **overrides, "seed": seed}

    class MegatronBf16Adam(Bf16Adam):
        __doc__ = f"Bf16Adam for --kd-optimizer {choice}: {settings}."
        binding = (choice, tuple(sorted(settings.items())))

        def __init__(self, params, **kwargs):
            super().__init__(params, **settings, group_stream=_model_parallel_stream, **kwargs)

    return MegatronBf16Adam


def _skip_te_fusedadam_check(post_init):
    @functools.wraps(post_init)
    def checked(self):
        try:
            post_init(self)
        except RuntimeError as e:
            # "--use-precision-aware-optimizer requires FusedAdam from TransformerEngine": the last
            # statement of the precision-aware branch, so nothing else is skipped
            if "requires FusedAdam from TransformerEngine" not in str(e):
                raise
    checked.skips_te_check = True
    return checked


_SAVED: dict | None = None  # the names install() replaced, for uninstall()


def installed() -> type[Bf16Adam] | None:
    """The optimizer class megatron-core builds now, if ``install`` replaced its own."""
    import megatron.core.optimizer as mcore_optimizer

    return mcore_optimizer.Adam if _SAVED is not None else None


def install(choice: str, *, seed: int = 0, **overrides) -> None:
    """Make megatron-core's optimizer construction build ``choice`` (see the module docstring);
    ``overrides`` change Bf16Adam's ``rounding`` / ``moments`` (measurements). "megatron" restores
    megatron-core's own. Calling it again with the same arguments does nothing."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    global _SAVED
    if choice not in OPTIMIZERS:
        raise FlagError(f"--kd-optimizer must be one of {', '.join(OPTIMIZERS)}, got {choice!r}")
    if choice == "megatron":
        uninstall()
        return
    cls = bound_optimizer(choice, seed, **overrides)
    current = installed()
    if current is not None and current.binding == cls.binding:
        return
    uninstall()
    _SAVED = {
        "optimizer": {name: getattr(mcore_optimizer, name) for name in ("Adam", "USING_PYTORCH_OPTIMIZER")},
        "distrib_optimizer": {name: getattr(distrib_optimizer, name)
                              for name in ("Adam", "HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER")},
        "post_init": OptimizerConfig.__post_init__,
    }
    mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER = cls, False
    distrib_optimizer.Adam, distrib_optimizer.HAVE_APEX_OR_TE = cls, True
    if not distrib_optimizer.USING_APEX_OPTIMIZER:
        distrib_optimizer.USING_TE_OPTIMIZER = True  # the step lives in the param groups, as TE's
    OptimizerConfig.__post_init__ = _skip_te_fusedadam_check(_SAVED["post_init"])
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        replaced = "Transformer Engine's FusedAdam" if _SAVED["distrib_optimizer"]["HAVE_APEX_OR_TE"] else "torch AdamW"
        logger.warning(f"megatron_kd: --kd-optimizer {choice}: megatron-core builds Bf16Adam "
                       f"({dict(cls.binding[1])}) where it would build {replaced}")


def uninstall() -> None:
    """Restore megatron-core's own optimizer names."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    global _SAVED
    if _SAVED is None:
        return
    for name, value in _SAVED["optimizer"].items():
        setattr(mcore_optimizer, name, value)
    for name, value in _SAVED["distrib_optimizer"].items():
        setattr(distrib_optimizer, name, value)
    OptimizerConfig.__post_init__ = _SAVED["post_init"]
    _SAVED = None
