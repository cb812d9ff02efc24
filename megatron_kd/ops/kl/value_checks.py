"""Checks that read tensor values, and the host copy they ride on.

``PendingValueChecks`` (made by ``check_inputs``) queues the value checks of the loss's inputs on
the device and reads their verdict later, at one point the chunk loop chooses; ``HostCopy`` is the
copy to the host that does not wait, also used for the deferred check of backward's incoming
gradient under main_grad fusion (``function.py``). Nothing here imports another ops module.
"""

from __future__ import annotations

import torch


class HostCopy:
    """``tensor`` copied to the host without waiting; ``get()`` waits for that copy alone, not for
    the work queued after it."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.detach().clone()

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


class PendingValueChecks:
    """The checks that read tensor values (ids and labels in range, no NaN / +inf log-probabilities):
    ``launch`` queues them on the device with a copy to the host that does not wait; ``raise_if_bad``
    waits for that copy.

    ``fused_topk_kl`` launches them behind its first logits GEMM and reads the verdict once the
    first chunk's passes are queued, before its first write that cannot be undone (the weight
    gradient into ``main_grad``), so neither the checks nor the read leave the GPU idle. The work queued before the read is harmless with bad
    values: ids and labels outside this rank's shard are masked out of every kernel, and NaN only
    reaches buffers of the op's own.
    """

    def __init__(self, topk_ids, topk_logprobs, labels, *, vocab: int, tp: int):
        self.vocab = vocab
        self._note = f"vocabulary size {vocab} (weight rows {vocab // tp} x tp {tp})"
        self._inputs = (topk_ids, topk_logprobs, labels)
        self._names = None
        self._values = None  # HostCopy of the checks' results until read

    def launch(self) -> None:
        """Queue the checks and their copy to the host (once)."""
        if self._names is not None:
            return
        topk_ids, topk_logprobs, labels = self._inputs
        self._inputs = None
        checks = {}
        if topk_ids.numel():
            checks.update(id_lo=topk_ids.min(), id_hi=topk_ids.max(), nan=torch.isnan(topk_logprobs).any(),
                          posinf=(topk_logprobs == float("inf")).any())
        if labels is not None and labels.numel():
            checks.update(label_lo=labels.min(), label_hi=labels.max())
        self._names = list(checks)
        if checks:
            self._values = HostCopy(torch.stack([c.to(torch.int64) for c in checks.values()]))

    def raise_if_bad(self) -> None:
        """Wait for the verdict (the first time); raise ``ValueError`` naming the bad argument."""
        self.launch()
        if self._values is None:
            return
        got = dict(zip(self._names, self._values.get().tolist()))
        self._values = None  # read once
        vocab = self.vocab
        if "id_lo" in got:
            lo, hi = got["id_lo"], got["id_hi"]
            if lo < -1 or hi >= vocab:
                bad = lo if lo < -1 else hi
                raise ValueError(f"topk_ids holds id {bad}; ids must be -1 (padding) or in [0, {vocab}), {self._note}")
            if got["nan"]:
                raise ValueError("topk_logprobs holds NaN; padding entries must be -inf (or id -1)")
            if got["posinf"]:
                raise ValueError("topk_logprobs holds +inf; log-probabilities must be <= 0 or -inf for padding")
        if "label_lo" in got:
            lo, hi = got["label_lo"], got["label_hi"]
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"labels holds id {bad} outside [0, {vocab}), {self._note}; mask tokens with loss_mask"
                )
