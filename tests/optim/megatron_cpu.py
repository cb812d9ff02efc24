"""megatron-core's DDP and distributed optimizer on CPU tensors (test and benchmark harness only).

Beyond ``dist_utils.megatron_cpu_patches`` (RNG tracker, current device, memory buffer, masks),
megatron-core's DistributedDataParallel, DistributedOptimizer and gradient clipping assume CUDA in
three more ways; ``megatron_optimizer_cpu_patches`` redirects them for the duration of a block:
  1. tensors created with ``device="cuda"`` (flags, norms, found-inf buffers) and ``.cuda()`` calls
     -> the CPU (a TorchFunctionMode rewrites the device argument);
  2. ``Tensor.type()`` checks for "torch.cuda.BFloat16Tensor" / "torch.cuda.FloatTensor" -> CPU
     tensors answer with the CUDA type names;
  3. ``torch.cuda.current_stream()`` (waited on before a gradient reduction) -> a stream that waits
     on nothing; ``torch.cuda.synchronize()`` (before distributed checkpointing writes) -> nothing.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_utils import megatron_cpu_patches  # noqa: E402


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _IdleStream:
    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


@contextlib.contextmanager
def megatron_optimizer_cpu_patches():
    """megatron-core modules, its DDP and its distributed optimizer on CPU (module docstring)."""
    saved = torch.cuda.current_stream, torch.cuda.synchronize
    torch.cuda.current_stream = lambda *args, **kwargs: _IdleStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        with megatron_cpu_patches(), _CudaToCpu():
            yield
    finally:
        torch.cuda.current_stream, torch.cuda.synchronize = saved
