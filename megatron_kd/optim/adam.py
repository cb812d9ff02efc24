"""``Bf16Adam``: Adam(W) that updates bf16 parameters in place, with no fp32 master copy, and keeps
its moments in 8 bits.

Per parameter, what the optimizer holds (Megatron's default in brackets):
  weights    the bf16 parameter itself, updated by stochastic rounding (``rounding.py``)
             [bf16 weights + an fp32 master copy: 4 bytes]
  moments    exp_avg and exp_avg_sq in the 8-bit blockwise format of ``quantize.py``, 1 + 1/64
             bytes each; fp32 for tensors under 4,096 elements           [fp32: 4 + 4 bytes]
  => 2.03 bytes per parameter instead of 12.

One update (on CUDA one Triton kernel launch per group and kind of tensor, ``adam_triton.py``;
elsewhere the torch ops below, per chunk of ``CHUNK`` elements so that temporaries stay bounded
whatever the tensor): the moments are dequantized to fp32, the gradient (any float dtype;
Megatron's bf16 ``decoupled_grad``) is read in fp32, and torch's AdamW formula runs in fp32 on an
fp32 copy of the parameter::

    p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
    p ← p − lr/(1−β1^t) · m / (sqrt(v)/sqrt(1−β2^t) + eps)

then m and v are quantized again (the update used their fp32 values) and p is rounded to bf16:
stochastically (unbiased; the default) or to nearest (``rounding="nearest"``, for comparisons: it
drops updates below half a bf16 step). fp32 parameters are written in fp32.

The random bits of stochastic rounding are a hash of (``seed``, the parameter tensor, the element's
index in it, the step): nothing to checkpoint, identical after a resume, and identical whether the
tensor is one shard or split across data-parallel ranks (Megatron's distributed optimizer hands
the optimizer 1-D views of its shard of each parameter: ``_TensorOrigins`` maps each back to the
parameter it was built with and the offset in it). ``group_stream(param_group)`` adds what tells
apart tensors that hold different weights at the same index on other model-parallel ranks (the
Megatron wiring passes the rank in the model-parallel group).

The interface is Transformer Engine's ``FusedAdam`` as megatron-core's precision-aware path uses it
(``master_weights``, ``master_weight_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``,
``use_decoupled_grad``, ``store_param_remainders`` keywords; the step in ``param_groups[i]["step"]``;
``initialize_state``, ``get_unscaled_state`` and ``set_scaled_state``), so megatron-core's
distributed optimizer shards it and its checkpoint code saves and loads it: state is exported as fp32
values (``"master_param"`` = the bf16 parameter, the moments dequantized) and quantizing them again
gives back the same codes and scales bit for bit (``quantize.py``). ``state_dict`` /
``load_state_dict`` keep the packed tensors as they are.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
import math
from typing import Callable

import torch

from megatron_kd.errors import UserError
from megatron_kd.optim import quantize
from megatron_kd.optim.rounding import MAX_ELEMENTS, random_bits16, stochastic_round_bf16, stream_key, stream_key_from

ROUNDINGS = ("stochastic", "nearest")
MOMENTS = ("8bit", "fp32")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# elements per update call; a multiple of the quantization block. ~40 bytes of fp32/int64
# temporaries per element: ~0.7 GB at most, whatever the tensor
CHUNK = 1 << 24
_STORED_DTYPE = {"8bit": torch.uint8, "fp32": torch.float32}  # what megatron-core's flags must say
IMPLS = ("auto", "triton", "torch")


def state_bytes_per_element(moments: str) -> float:
    """Optimizer-state bytes per parameter element of a large tensor (no master copy)."""
    return 2 * (1 + 4 / quantize.BLOCK) if moments == "8bit" else 8.0


class _TensorOrigins:
    """For each tensor the optimizer updates: which of the tensors it was built with (an index, in
    construction order) holds it and at which element it starts there. Megatron's distributed
    optimizer replaces the parameters of the groups by 1-D views of this rank's shard of each; a
    view is found in the storage range of the parameter it was cut from."""

    def __init__(self, param_groups: list[dict], group_stream: Callable[[dict], int]):
        self._by_storage: dict[int, list[tuple[int, int, int, int]]] = {}  # ptr -> (start, end, index, stream)
        self._count = 0
        for group in param_groups:
            for p in group["params"]:
                self._add(p, group_stream(group))
        self._group_stream = group_stream
        self._found: dict[torch.Tensor, tuple[int, int, int]] = {}

    def _add(self, p: torch.Tensor, stream: int) -> None:
        start = p.storage_offset()
        spans = self._by_storage.setdefault(p.untyped_storage().data_ptr(), [])
        bisect.insort(spans, (start, start + p.numel(), self._count, stream))
        self._count += 1

    def origin(self, p: torch.Tensor, group: dict) -> tuple[int, int, int]:
        """(tensor index, stream, offset of p's first element in that tensor)."""
        found = self._found.get(p)
        if found is None:
            spans = self._by_storage.get(p.untyped_storage().data_ptr(), [])
            i = bisect.bisect_right(spans, (p.storage_offset(), math.inf)) - 1
            if i >= 0 and spans[i][0] <= p.storage_offset() < spans[i][1]:
                start, _, index, stream = spans[i]
                found = (index, stream, p.storage_offset() - start)
            else:  # a tensor the optimizer was not built with: a stream of its own
                self._add(p, self._group_stream(group))
                found = (self._count - 1, self._group_stream(group), 0)
            self._found[p] = found
        return found


def _zero_moment(numel: int, signed: bool, device) -> torch.Tensor:
    if quantize.is_quantized(numel):
        return quantize.packed_zeros(numel, signed, device)
    return torch.zeros(numel, dtype=torch.float32, device=device)


_QMAPS: dict[tuple[bool, str], torch.Tensor] = {}


def _qmap(signed: bool, device) -> torch.Tensor:
    key = (signed, str(torch.device(device)))
    if key not in _QMAPS:
        _QMAPS[key] = quantize.dynamic_map(signed, device)
    return _QMAPS[key]


def _moment_chunk(stored: torch.Tensor, start: int, end: int):
    """Elements [start, end) of a stored moment (start: a multiple of the block): the fp32 slice, or
    the (codes, scales) of its blocks."""
    if stored.dtype == torch.float32:
        return stored[start:end]
    codes, scales = quantize.packed_views(stored)
    first, last = start // quantize.BLOCK, -(-end // quantize.BLOCK)
    return codes[first * quantize.BLOCK:last * quantize.BLOCK], scales[first:last]


def _load(chunk, qmap: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 values of a moment chunk (a copy)."""
    if isinstance(chunk, torch.Tensor):
        return chunk.clone()
    codes, scales = chunk
    return quantize.dequantize(codes, scales, qmap, n)


def _encode(chunk, qmap: torch.Tensor, values: torch.Tensor):
    """What to store into a moment chunk: the fp32 values, or their (codes, scales)."""
    return values if isinstance(chunk, torch.Tensor) else quantize.quantize(values, qmap)


def _store(chunk, encoded) -> None:
    if isinstance(chunk, torch.Tensor):
        chunk.copy_(encoded)
    else:
        for target, value in zip(chunk, encoded):
            target.copy_(value)


def _chunk_step(param, grad, exp_avg, exp_avg_sq, qmap_signed, qmap_unsigned, scalars, *,
                key: tuple[int, int] | None, offset: int, adam_w_mode: bool):
    """One chunk's update in torch ops, without side effects: returns the new parameter values and
    the encoded moments. ``scalars``: ``step_scalars`` (numbers, or a device tensor of them)."""
    n = param.numel()
    m, v = _load(exp_avg, qmap_signed, n), _load(exp_avg_sq, qmap_unsigned, n)
    p32, m, v = _adam_chunk(param, grad, m, v, scalars, adam_w_mode)
    if key is not None:
        p32 = stochastic_round_bf16(p32, random_bits16(key, offset, n, param.device))
    return p32.to(param.dtype), _encode(exp_avg, qmap_signed, m), _encode(exp_avg_sq, qmap_unsigned, v)


# what ``step_scalars`` holds, by position
DECAY, L2, LERP, BETA2, GRAD_SQ, BIAS2_SQRT, EPS, NEG_STEP = range(8)


def step_scalars(group: dict, t: int) -> tuple[float, ...]:
    """The numbers of step ``t`` of a parameter group, in ``_adam_chunk``'s positions (computed in
    float64 as torch's AdamW computes them on the host; the update rounds them to fp32 as its ops do)."""
    lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
    correct = group["bias_correction"]
    return (1 - lr * wd, wd, 1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2 ** t) if correct else 1.0,
            group["eps"], -lr / (1 - beta1 ** t if correct else 1.0))


def _adam_chunk(param, grad, exp_avg, exp_avg_sq, s, adam_w_mode: bool):
    """One Adam(W) update of a chunk in fp32: returns (parameter fp32, exp_avg, exp_avg_sq), the
    moments updated in place. torch.optim.AdamW's formula and order of operations, bit for bit on the
    CPU; its ``value=`` scalars are multiplied in first as its kernels do, so that ``s`` may hold
    0-d tensors (the Triton kernel follows the same order and reads the numbers from the device).
    No branch on a value: a weight decay of 0 multiplies by exactly 1 (adds exactly 0 with L2)."""
    p32 = param.float()
    g32 = grad.float()
    if adam_w_mode:
        p32.mul_(s[DECAY])
    else:
        g32 = g32.add(p32.mul(s[L2]))
    exp_avg.lerp_(g32, s[LERP])
    exp_avg_sq.mul_(s[BETA2]).addcmul_(g32.mul(s[GRAD_SQ]), g32)  # value · g rounded first, as addcmul_
    denom = exp_avg_sq.sqrt().div_(s[BIAS2_SQRT]).add_(s[EPS])
    p32.addcdiv_(exp_avg.mul(s[NEG_STEP]), denom)  # (value · m) / denom, as addcdiv_
    return p32, exp_avg, exp_avg_sq


def _to_device(numbers, device: torch.device) -> torch.Tensor:
    """fp32 numbers on ``device``; to a GPU from pinned memory, so that the host does not wait for the
    kernels queued before the copy."""
    values = torch.tensor(numbers, dtype=torch.float32)
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


class Bf16Adam(torch.optim.Optimizer):
    """See the module docstring. ``rounding``: "stochastic" | "nearest"; ``moments``: "8bit" |
    "fp32"; ``seed``: of the stochastic-rounding streams; ``impl``: "triton" (one fused kernel per
    tensor, ``adam_triton.py``), "torch" (the per-chunk reference in torch ops) or "auto" (Triton for
    CUDA tensors). The keywords after ``impl`` are those megatron-core passes to Transformer
    Engine's FusedAdam; each is checked against what this optimizer does."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, adam_w_mode: bool = True,
                 rounding: str = "stochastic", moments: str = "8bit", seed: int = 0, impl: str = "auto",
                 group_stream: Callable[[dict], int] = lambda group: 0,
                 master_weights: bool = True, master_weight_dtype: torch.dtype | None = None,
                 exp_avg_dtype: torch.dtype | None = None, exp_avg_sq_dtype: torch.dtype | None = None,
                 use_decoupled_grad: bool = False, store_param_remainders: bool = False, capturable: bool = False):
        if rounding not in ROUNDINGS:
            raise UserError(f"Bf16Adam rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if moments not in MOMENTS:
            raise UserError(f"Bf16Adam moments must be one of {MOMENTS}, got {moments!r}")
        if impl not in IMPLS:
            raise UserError(f"Bf16Adam impl must be one of {IMPLS}, got {impl!r}")
        if amsgrad:
            raise UserError("Bf16Adam has no AMSGrad variant: amsgrad must be False")
        if capturable:
            raise UserError("Bf16Adam cannot run inside a CUDA graph: drop --optimizer-cuda-graph")
        if not master_weights:
            # megatron-core asks the optimizer to own the weights of record on this path; here they
            # are the bf16 parameters themselves (stochastic rounding makes them the master copy)
            raise UserError("Bf16Adam owns the weights of record (the bf16 parameters): master_weights must be True")
        if master_weight_dtype not in (None, torch.float32):
            raise UserError(f"Bf16Adam keeps no separate master copy: --main-params-dtype must be fp32 (the default), "
                            f"got {master_weight_dtype}")
        # store_param_remainders (the low 16 bits of an fp32 master, in TE) has nothing to store here
        for flag, dtype in (("--exp-avg-dtype", exp_avg_dtype), ("--exp-avg-sq-dtype", exp_avg_sq_dtype)):
            if dtype is not None and dtype != _STORED_DTYPE[moments]:
                expected = "fp8 (one byte)" if moments == "8bit" else "fp32"
                raise UserError(f"Bf16Adam keeps {moments} moments: {flag} must be {expected}, got {dtype}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    raise UserError(f"Bf16Adam updates bf16 or fp32 parameters, got {p.dtype}: train with --bf16")
                if not p.is_contiguous():
                    raise UserError("Bf16Adam updates contiguous parameters only")
                if p.numel() > MAX_ELEMENTS:
                    raise UserError(f"Bf16Adam indexes a tensor's elements with 32 bits: {p.numel()} elements")
        self.adam_w_mode, self.rounding, self.moments, self.seed = adam_w_mode, rounding, moments, seed
        self.use_decoupled_grad = use_decoupled_grad
        self._origins = _TensorOrigins(self.param_groups, group_stream)
        self.impl = impl
        self._prefixes: dict[tuple[int, int], tuple[int, int]] = {}  # (index, stream) -> stream_key prefix
        self._batches: dict[tuple, object] = {}  # (group, kind) -> adam_triton.KernelBatch

    # -- the update ---------------------------------------------------------------------------------

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    def _uses_triton(self, device: torch.device) -> bool:
        return self.impl == "triton" or (self.impl == "auto" and device.type == "cuda")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            # one step count per group, as TE's FusedAdam keeps it (megatron-core saves it from here)
            group["step"] = group.get("step", 0) + 1
            numbers, batches = step_scalars(group, group["step"]), defaultdict(list)
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None or not p.numel():
                    continue
                if not self.state[p]:
                    self.initialize_state(p)
                if self._uses_triton(p.device):
                    kind = (p.device, p.dtype, grad.dtype, self.state[p]["exp_avg"].dtype)
                    batches[kind].append((p, grad))
                else:
                    self._torch_update(p, grad, group, numbers)
            on_device = {}  # the step's numbers, one small copy per group and device
            for kind, members in batches.items():
                if kind[0] not in on_device:
                    on_device[kind[0]] = _to_device(numbers, kind[0])
                self._triton_update(group_index, group, kind, members, on_device[kind[0]])
        return loss

    def _stochastic(self, p: torch.Tensor) -> bool:
        return self.rounding == "stochastic" and p.dtype == torch.bfloat16

    def _triton_update(self, group_index: int, group: dict, kind: tuple, members: list, scalars) -> None:
        """Every tensor of one kind in a group with one kernel launch (``adam_triton.KernelBatch``)."""
        from megatron_kd.optim.adam_triton import KernelBatch

        device = kind[0]
        stochastic = self._stochastic(members[0][0])
        prefixes, offsets = [], []
        for p, _ in members:
            if stochastic:
                index, stream, offset = self._origins.origin(p, group)
                prefixes.append(self._stream_prefix(index, stream))
                offsets.append(offset)
            else:
                prefixes.append((0, 0))
                offsets.append(0)
        batch = self._batches.setdefault((group_index, *kind), KernelBatch())
        batch.launch([p.view(-1) for p, _ in members], [g.reshape(-1).contiguous() for _, g in members],
                     [self.state[p]["exp_avg"] for p, _ in members], [self.state[p]["exp_avg_sq"] for p, _ in members],
                     prefixes, offsets, (_qmap(True, device), _qmap(False, device)), scalars, step=group["step"],
                     stochastic=stochastic, adam_w_mode=self.adam_w_mode)

    def _stream_prefix(self, index: int, stream: int) -> tuple[int, int]:
        """``stream_key(seed, stream, index)``, which each step's number finishes (cached: the hash is
        Python arithmetic)."""
        prefix = self._prefixes.get((index, stream))
        if prefix is None:
            prefix = self._prefixes[(index, stream)] = stream_key(self.seed, stream, index)
        return prefix

    def _torch_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict, scalars) -> None:
        """The update in torch ops, per chunk of ``CHUNK`` elements."""
        state = self.state[p]
        stochastic = self._stochastic(p)
        key, offset = None, 0
        if stochastic:
            index, stream, offset = self._origins.origin(p, group)
            key = stream_key_from(self._stream_prefix(index, stream), group["step"])
        flat_p, flat_g = p.view(-1), grad.reshape(-1)
        qmaps = _qmap(True, p.device), _qmap(False, p.device)
        for start in range(0, p.numel(), CHUNK):
            end = min(p.numel(), start + CHUNK)
            m, v = _moment_chunk(state["exp_avg"], start, end), _moment_chunk(state["exp_avg_sq"], start, end)
            new_p, new_m, new_v = _chunk_step(flat_p[start:end], flat_g[start:end], m, v, *qmaps, scalars, key=key,
                                              offset=offset + start if stochastic else 0, adam_w_mode=self.adam_w_mode)
            _store(m, new_m)
            _store(v, new_v)
            flat_p[start:end].copy_(new_p)

    # -- Transformer Engine FusedAdam's state interface (megatron-core's precision-aware path) ------

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool | None = None) -> None:
        """Zero moments; ``"master_param"`` is the parameter itself (megatron-core exports it as the
        weights of record)."""
        n, device = param.numel(), param.device
        if self.moments == "8bit":
            moments = {"exp_avg": _zero_moment(n, True, device), "exp_avg_sq": _zero_moment(n, False, device)}
        else:
            moments = {key: torch.zeros(n, dtype=torch.float32, device=device) for key in MOMENT_KEYS}
        self.state[param].update(moments, master_param=param)

    @torch.no_grad()
    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """An fp32 copy of ``state_name`` ("master_param", "exp_avg", "exp_avg_sq"), param's shape."""
        state = self.state[param]
        if not state:
            self.initialize_state(param)
        if state_name == "master_param":
            return param.detach().float()
        if state_name not in MOMENT_KEYS:
            raise KeyError(f"Bf16Adam has no state {state_name!r} (master_param, exp_avg, exp_avg_sq)")
        n = param.numel()
        values = _load(_moment_chunk(state[state_name], 0, n), _qmap(state_name == "exp_avg", param.device), n)
        return values.view(param.shape)

    @torch.no_grad()
    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store fp32 values into ``state_name``: a moment is quantized (the codes and scales it was
        exported from, bit for bit); ``"master_param"`` is copied into the parameter."""
        state = self.state[param]
        if not state:
            self.initialize_state(param)
        values = unscaled_state.detach().reshape(-1).to(device=param.device, dtype=torch.float32)
        if values.numel() != param.numel():
            raise ValueError(f"set_scaled_state({state_name!r}): {values.numel()} values for {param.numel()} elements")
        if state_name == "master_param":
            param.view(-1).copy_(values)
        elif state_name in MOMENT_KEYS:
            chunk = _moment_chunk(state[state_name], 0, param.numel())
            _store(chunk, _encode(chunk, _qmap(state_name == "exp_avg", param.device), values))
        else:
            raise KeyError(f"Bf16Adam has no state {state_name!r} (master_param, exp_avg, exp_avg_sq)")

    def load_state_dict(self, state_dict: dict) -> None:
        """Param-group settings (lr, step, ...) and the state of every parameter of the groups.

        Unlike torch's (which casts every floating tensor to its parameter's dtype) it keeps this
        optimizer's dtypes: a moment in this optimizer's own layout is taken as it is (no copy); a
        tensor of the parameter's size is taken as fp32 values and quantized (what megatron-core's
        placeholders are before it sets a checkpoint's values); ``"master_param"`` stays the
        parameter itself (it is loaded with the model). A parameter without saved state gets zero
        moments: megatron-core's distributed optimizer calls this right after it hands over its
        shards, so the state is allocated once, up front, and a checkpoint load later finds it
        allocated instead of making placeholders of every element (fp32 for the master weights:
        6 bytes per parameter, which would not fit beside a 120B rank's model)."""
        groups, saved = state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)):
            raise ValueError("Bf16Adam.load_state_dict: the saved parameter groups do not match this optimizer's")
        for mine, g in zip(self.param_groups, groups):
            mine.update({k: v for k, v in g.items() if k != "params"})
        previous, self.state = self.state, defaultdict(dict)
        for mine, g in zip(self.param_groups, groups):
            for p, saved_id in zip(mine["params"], g["params"]):
                self._load_param_state(p, saved.get(saved_id, {}))
        del previous

    def _load_param_state(self, p: torch.Tensor, saved: dict) -> None:
        self.initialize_state(p)
        state = self.state[p]
        for key in MOMENT_KEYS:
            value = saved.get(key)
            if value is None:
                continue
            if value.dtype == state[key].dtype and value.shape == state[key].shape:  # this optimizer's layout
                state[key] = value.to(p.device)
            elif value.numel() == p.numel():
                self.set_scaled_state(p, key, value.float())
            else:
                raise ValueError(f"Bf16Adam.load_state_dict: {key} of a {p.numel()}-element parameter has "
                                 f"{value.numel()} elements of {value.dtype}")

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (moments; the parameters are the model's)."""
        return sum(s[key].numel() * s[key].element_size() for s in self.state.values() for key in MOMENT_KEYS if key in s)
