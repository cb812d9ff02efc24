"""One way to start torch.distributed in a process that may be alone.

Under torchrun (or any launcher that sets ``WORLD_SIZE`` / ``MASTER_PORT``) the group rendezvous
through the environment as usual. A process on its own (the demo, a one-GPU benchmark, a test's
subprocess) takes an in-process store instead of a TCP port: a port picked ahead of time can be
taken by the time it is bound (another job, or a client socket that connected to itself), which is
a failure that has nothing to do with the work.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_process_group"]


def _launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "MASTER_PORT" in os.environ


def init_process_group(backend: str | None = None, *, timeout_s: float = 600.0,
                       device: torch.device | None = None) -> None:
    """Join the launcher's group, or make a group of one without a port; no-op if one exists.

    ``backend`` defaults to NCCL on a CUDA host and gloo elsewhere; ``device`` binds NCCL's
    communicator eagerly (torch's ``device_id``).
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    if _launched():
        dist.init_process_group(**kwargs)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
