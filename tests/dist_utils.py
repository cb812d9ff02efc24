"""Multi-process helpers for CPU tests: gloo process groups and megatron-core on CPU.

megatron-core assumes CUDA in four places that the tests reach; ``megatron_cpu_patches`` redirects
them to the CPU for the duration of a test (never in the library):
  1. ``tensor_parallel.random.get_cuda_rng_tracker().fork()`` -> a no-op context;
  2. ``torch.cuda.current_device()`` and megatron's global memory buffer -> CPU tensors;
  3. Megatron-LM's argument validation asks the GPU's architecture when TP > 1 -> Hopper (9);
  4. the causal / sliding-window masks of its local attention softmax -> built on the CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, backend, args, env=None):
    os.environ.update(env or {})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=180))
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


# What a gloo (CPU) child sees on a machine with a GPU: no GPU, and Triton in its interpreter, as on
# the CPU machines. ``megatron_cpu_patches`` points torch.cuda.current_device at the CPU, which
# torch.compile (megatron-core's fused bias-dropout-add) queries when CUDA is available.
_CPU_CHILD_ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


@contextlib.contextmanager
def _environment(changes: dict[str, str]):
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spawn(fn, *args, world_size: int = 2, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; fail if any fails.

    ``backend`` "gloo" (CPU: the children see no GPU, whatever the machine has) or "nccl" (rank r
    on cuda:r). ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    env = _CPU_CHILD_ENV if backend == "gloo" else {}
    # Without CUDA (CI), children fork from one forkserver per pytest process that imported torch,
    # transformers, megatron-core and megatron_kd once: a spawned child spent ~20 s re-importing
    # them, over a hundred children a run. The forkserver itself never computes, so no thread pool
    # is forked. With CUDA, fresh processes as before (the server's environment would be the GPU's).
    method = "spawn" if torch.cuda.is_available() else "forkserver"
    with _environment(env):
        mp.start_processes(
            _entry, args=(fn, world_size, free_port(), backend, args, env), nprocs=world_size, join=True,
            start_method=method,
        )


# what the forkserver imports before it forks its first child (each child inherits them)
_FORKSERVER_PRELOAD = ["torch", "numpy", "transformers", "megatron.core", "megatron.training",
                       "megatron_kd.megatron.flags", "megatron_kd.megatron.run", "dist_utils"]
if not torch.cuda.is_available():
    import multiprocessing

    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)


class _CpuMemoryBuffer:
    def __init__(self):
        self.buffer = {}

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        key = (name, dtype)
        numel = 1
        for d in shape:
            numel *= d
        if key not in self.buffer or self.buffer[key].numel() < numel:
            self.buffer[key] = torch.empty(numel, dtype=dtype)
        return self.buffer[key][:numel].view(*shape)


def _cpu_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_window_mask(sq, skv, window):
    # megatron-core's get_sliding_window_causal_mask, on the CPU: True = masked
    keep = torch.ones(sq, skv, dtype=torch.bool)
    keep = torch.tril(torch.triu(keep, diagonal=skv - sq - window[0]), diagonal=skv - sq + window[1])
    return ~keep


@contextlib.contextmanager
def megatron_cpu_patches():
    """Let megatron-core modules run on CPU tensors (see module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.training import arguments

    tracker = mcore_random.get_cuda_rng_tracker()
    saved = (torch.cuda.current_device, type(tracker).fork, parallel_state.get_global_memory_buffer,
             arguments.get_device_arch_version, fused_softmax.get_default_causal_mask,
             fused_softmax.get_sliding_window_causal_mask)
    buffer = _CpuMemoryBuffer()
    torch.cuda.current_device = lambda: "cpu"
    type(tracker).fork = lambda self, name=None: contextlib.nullcontext()
    parallel_state.get_global_memory_buffer = lambda: buffer
    arguments.get_device_arch_version = lambda: 9
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_window_mask
    try:
        yield
    finally:
        (torch.cuda.current_device, type(tracker).fork, parallel_state.get_global_memory_buffer,
         arguments.get_device_arch_version, fused_softmax.get_default_causal_mask,
         fused_softmax.get_sliding_window_causal_mask) = saved


def init_tensor_parallel(tp_size: int):
    """megatron-core's own process groups over the running gloo world; returns the TP group."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    return parallel_state.get_tensor_model_parallel_group()
