"""Expert layers for megatron-core's local (no Transformer Engine) MoE spec.

``GroupedGemmExperts``: megatron-core's ``SequentialMLP`` runs the local experts one after
another (two GEMMs and the activation per expert, with Python in between); this subclass keeps
its parameters, checkpoint layout and ModelOpt import/export names (``local_experts.N.linear_fc1``
...) and computes all experts with two grouped GEMMs (``torch.nn.functional.grouped_mm``) over
the dispatcher's expert-sorted rows, T rows in all, ``counts`` per expert:

    h   = [x | 1] · [W1 | b1]ᵀ            per expert's rows     x: [T, hidden], W1: [E, 2I, hidden]
    a   = activation(h) · p                gated / clamped as the MLP's own, p the routing probability
    out = [a | p] · [W2 | b2]ᵀ                                  W2: [E, hidden, I]

which is what ``SequentialMLP`` → ``MLP.forward`` (unfused bias path) computes, fc2's bias scaled
by the routing probability as megatron-core's MLP scales it.

Biases are one more input column of each GEMM (a column of ones for fc1, the probability p, in
bf16, for fc2; zero columns pad the rows to the 16 bytes grouped_mm needs: 2,880 → 2,888 at
GPT-OSS width), so the GEMMs add them in fp32 and their gradients come out of the weight-gradient
GEMMs: no gathered bias rows, no separate add or per-expert sum, no scatter. The stacked weights
[E, out, in + pad] are built from the parameters in forward and again in backward (a copy of
2·E·3·h·I bytes, microseconds) rather than kept from forward to backward: keeping them costs
that many bytes per layer (0.19 GiB per GPT-OSS-20B layer with 4 local experts). Saved for backward
per layer: [x | 1] (fc1's input), h (the activation's input), p, and [a | p] (fc2's input).

Megatron's selective recompute of the activation (``--recompute-modules moe_act``, as its
``TEGroupedMLP`` honours it): fc2's input [a | p] is not kept; backward recomputes it from h and p
(one elementwise pass) for fc2's weight gradient and the activation's own backward, all inside one
autograd Function. megatron-core uses ``CheckpointWithoutOutput`` for this (it frees the output's
storage and re-points it with a C++ extension compiled at run time); the activation has no
randomness, so recomputing inside the fc2 Function does the same with nothing to re-point. That
saves T·(I + pad)·2 bytes per layer (0.70 GiB per GPT-OSS-20B layer at 32K tokens, top-4).
megatron-core reads ``--recompute-modules`` only under ``--recompute-granularity selective``
(which it lets name moe_act only with ``--moe-grouped-gemm``; on the local spec that flag changes
nothing else: these experts are always grouped); we also read moe_act under ``full``, so that
``--recompute-method block --recompute-num-layers N --recompute-modules moe_act`` recomputes N
layers whole and only the activation of the others (a layer recomputed whole then also
recomputes its activation once more in its backward: one elementwise pass). Megatron's activation
offloading (``--fine-grained-activation-offloading``) needs Transformer Engine (megatron-core's
argument validation asserts it and its offload hooks call TE's ``cpu_offload``), so it never
reaches this local-spec module.

On CUDA the activation (with its bias column) is one kernel per direction: GPT-OSS's clamped quick-GELU
GLU in Triton (expert_activation.py), any other activation compiled by torch.compile.
Used where ``grouped_mm`` has a backward (CUDA; CPU in bf16) with expert-tensor-parallel size 1;
elsewhere the sequential loop runs. Token dispatch (EP all-to-all / all-gather) is megatron-core's.

Quantization-aware distillation (``--kd-quant``, ``weight_quant``): the stacked weights are the
parameters fake-quantized (``megatron_kd.ops.quant``: MXFP4 or NVFP4 blocks along each expert's
input dimension, the layout GPT-OSS's release stores), in forward and in the backward's input
gradient alike; the weight gradient is the one of the quantized weights, passed straight through to
the parameters the optimizer keeps. The biases stay as they are (the release keeps them in bf16).
Only this grouped path quantizes: a run whose experts would take the sequential loop is refused.

``ExpertRowParallelLinear``: megatron-core 0.19's MLP adds an expert's fc2 bias in place, scaled
by the routing probability (``output += bias * probs``, mlp.py). With expert-parallel and
expert-tensor-parallel size 1 the row-parallel fc2 routes its output through the identity
"reduce" of a size-1 group, an autograd Function that returns its input as a view, and autograd
forbids the in-place add in backward. Over a group of one rank the reduction does nothing, so we
skip it, as megatron-core already does under expert parallelism: the MLP then owns a fresh tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.utils import get_pg_size

from megatron_kd.models.expert_activation import clamped_glu, is_quick_gelu
from megatron_kd.ops.quant import fake_quantize

GROUPED_MM_ALIGN_BYTES = 16  # grouped_mm's row stride must be a multiple of 16 bytes


class ExpertRowParallelLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True  # no collective: a one-rank group has nothing to reduce


def _activation(h, gated, clamp, offset, activation_func):
    """The activation of megatron-core's MLP (its unfused path): gated with the clamp after the bias."""
    if not gated:
        return activation_func(h)
    gate, linear = torch.chunk(h, 2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        linear = linear.clamp(min=-clamp, max=clamp)
    return activation_func(gate) * (linear + offset)


def _scaled_activation_with_bias_column(h, probs, width: int, gated, clamp, offset, activation_func):
    """[activation(h) · p | p | 0 …] in h's dtype, ``width`` columns (no p column when width is the
    activation's own width: fc2 without bias)."""
    out = (_activation(h, gated, clamp, offset, activation_func) * probs.unsqueeze(-1)).to(h.dtype)
    if width == out.shape[-1]:
        return out
    pad = out.new_zeros(out.shape[0], width - out.shape[-1] - 1)
    return torch.cat([out, probs.unsqueeze(-1).to(h.dtype), pad], dim=-1)


@functools.lru_cache(maxsize=None)
def _compiled_activation():
    """One compiled kernel per direction; dynamic in the number of routed tokens, which changes
    every step under expert parallelism."""
    return torch.compile(_scaled_activation_with_bias_column, dynamic=True)


def expert_activation(h: torch.Tensor, probs: torch.Tensor, config, width: int) -> torch.Tensor:
    """fc2's input: the MLP's activation times each row's routing probability, then (when fc2 has
    biases) the probability as the bias column and zero padding, ``width`` columns in h's dtype."""
    if h.is_cuda and config.gated_linear_unit and is_quick_gelu(config.activation_func):
        return clamped_glu(h, probs, width, config.activation_func_clamp_value, config.glu_linear_offset)
    fn = _compiled_activation() if h.is_cuda else _scaled_activation_with_bias_column
    return fn(h, probs, width, config.gated_linear_unit, config.activation_func_clamp_value,
              config.glu_linear_offset, config.activation_func)


def bias_column_width(in_features: int, dtype: torch.dtype) -> int:
    """Columns of a GEMM input with its bias column, padded to grouped_mm's alignment."""
    align = GROUPED_MM_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    return -(-(in_features + 1) // align) * align


class ExpertWeights:
    """How one linear (fc1 or fc2) of the local experts is laid out for grouped_mm: the weights
    stacked [E, out, in], and with biases each expert's bias as column ``in`` of [E, out, width]
    (zero columns after it), the weights fake-quantized to ``quant`` where it is set. Holds no
    tensors: the parameters are passed in each time."""

    def __init__(self, linears, quant: str | None = None, dtype: torch.dtype | None = None):
        self.quant = quant
        self.experts = len(linears)
        self.out_features, self.in_features = linears[0].weight.shape
        self.has_bias = linears[0].bias is not None
        self.dtype = linears[0].weight.dtype if dtype is None else dtype  # of the stacked weights
        self.width = bias_column_width(self.in_features, self.dtype) if self.has_bias else self.in_features

    @staticmethod
    def params(linears) -> tuple:
        """The parameters in the order ``stack`` and ``split_grad`` use: weights, then biases."""
        return (*(m.weight for m in linears), *(m.bias for m in linears if m.bias is not None))

    def stack(self, params) -> torch.Tensor:
        weights = params[:self.experts]
        if self.quant is not None:  # inside the autograd Functions: their backward is straight-through
            # no finiteness check: a host sync per expert and pass; a NaN weight is a diverged run,
            # which Megatron's loss and gradient checks report
            with torch.no_grad():
                weights = [fake_quantize(w, self.quant, check_finite=False) for w in weights]
        if not self.has_bias:
            return torch.stack(weights).to(self.dtype)
        stacked = weights[0].new_empty(self.experts, self.out_features, self.width, dtype=self.dtype)
        for e, (w, b) in enumerate(zip(weights, params[self.experts:])):
            stacked[e, :, :self.in_features].copy_(w)
            stacked[e, :, self.in_features].copy_(b)
        stacked[:, :, self.in_features + 1:].zero_()
        return stacked

    def split_grad(self, grad: torch.Tensor) -> tuple:
        """[E, out, width] -> the gradients of ``params`` (views)."""
        weights = tuple(grad[e, :, :self.in_features] for e in range(self.experts))
        if not self.has_bias:
            return weights
        return (*weights, *(grad[e, :, self.in_features] for e in range(self.experts)))

    def with_ones_column(self, x: torch.Tensor) -> torch.Tensor:
        """[x | 1 | 0 …]: the input that multiplies the biases by one."""
        if not self.has_bias:
            return x
        tail = x.new_zeros(self.width - self.in_features)
        tail[0] = 1
        return torch.cat([x, tail.expand(x.shape[0], -1)], dim=1)


def _weight_grad(grad: torch.Tensor, inputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert grad_outᵀ · input over its rows: [E, out, width] (the grouped weight gradient)."""
    return F.grouped_mm(grad.t(), inputs, offs=offsets)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x_in[rows of e] · W_aug[e]ᵀ. With ``ones_column`` x is [T, in] and the Function
    appends the bias column itself (fc1); otherwise x already has ``layout.width`` columns (fc2's
    [a | p], whose gradient then includes p's column). Saves its input and the parameters (no copy),
    re-stacks the weights in backward."""

    @staticmethod
    def forward(ctx, x, offsets, layout, ones_column, *params):
        x_in = layout.with_ones_column(x) if ones_column else x
        ctx.save_for_backward(x_in, offsets, *params)
        ctx.layout, ctx.ones_column = layout, ones_column
        return F.grouped_mm(x_in, layout.stack(params).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x_in, offsets, *params = ctx.saved_tensors
        layout = ctx.layout
        grad = grad.contiguous()
        stacked = layout.stack(params)
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = stacked[:, :, :layout.in_features] if ctx.ones_column else stacked
            grad_x = F.grouped_mm(grad, w, offs=offsets)
        del stacked
        return (grad_x, None, None, None, *layout.split_grad(_weight_grad(grad, x_in, offsets)))


class _RecomputedActivationLinear(torch.autograd.Function):
    """fc2 of ``expert_activation(h, p)`` without keeping that input: saves h, p and the parameters,
    and backward recomputes [a | p] (with its autograd graph) for the weight gradient and the
    activation's backward."""

    @staticmethod
    def forward(ctx, h, probs, offsets, layout, activation, *params):
        ctx.save_for_backward(h, probs, offsets, *params)
        ctx.layout, ctx.activation = layout, activation
        return F.grouped_mm(activation(h, probs), layout.stack(params).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        h, probs, offsets, *params = ctx.saved_tensors
        layout = ctx.layout
        grad = grad.contiguous()
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip((h, probs), ctx.needs_input_grad[:2])]
            fc2_input = ctx.activation(*inputs)
        grad_w = _weight_grad(grad, fc2_input.detach(), offsets)
        wanted = [t for t in inputs if t.requires_grad]
        grads_in = [None, None]
        if wanted:
            grad_fc2_input = F.grouped_mm(grad, layout.stack(params), offs=offsets)
            found = iter(torch.autograd.grad(fc2_input, wanted, grad_fc2_input))
            grads_in = [next(found) if t.requires_grad else None for t in inputs]
        return (*grads_in, None, None, None, *layout.split_grad(grad_w))


def grouped_gemm_supported(x: torch.Tensor) -> bool:
    """Where ``grouped_mm`` has forward and backward (torch 2.11: CUDA; CPU only in bf16)."""
    return x.is_cuda or x.dtype == torch.bfloat16


def recomputes_moe_act(config) -> bool:
    """``--recompute-modules moe_act`` under selective (megatron's reading) or full recompute (ours:
    the layers a block recompute leaves alone); see the module docstring."""
    return config.recompute_granularity is not None and "moe_act" in (config.recompute_modules or ())


class ExpertActivationTap(torch.nn.Module):
    """The identity on the grouped path's fc2 input [T, width] (the activation times the routing
    probability, then the bias column and padding), called with the rows per expert: the place where
    forward pre-hooks read that activation (``megatron-kd prune``'s importance), as they read each
    expert's ``linear_fc2`` input on the sequential path. No parameters, no state-dict entries."""

    def forward(self, fc2_input: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return fc2_input


class GroupedGemmExperts(SequentialMLP):
    weight_quant: str | None = None
    """The FP4 format the experts' weights are fake-quantized to (``--kd-quant``), or None."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fc2_input = ExpertActivationTap()

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x, dtype = permuted_local_hidden_states, None
        if torch.is_autocast_enabled(x.device.type):
            # grouped_mm has no autocast rule (torch 2.11): input and stacked weights go to the autocast
            # dtype, as they would for mm; the parameters' gradients come back in their own dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
        if (not grouped_gemm_supported(x) or get_pg_size(self.tp_group) != 1 or self.config.fp8 or self.config.fp4
                or self.config.moe_apply_probs_on_input):
            if self.weight_quant is not None:
                raise ValueError(f"--kd-quant {self.weight_quant}: the experts' fake quantization runs on the grouped "
                                 f"path only (CUDA, or bf16 on CPU; expert-tensor-parallel size 1; no --fp8-format / "
                                 f"--fp4-format), and this run's experts take the sequential loop")
            return super().forward(x, tokens_per_expert, permuted_probs)
        fc1 = [e.linear_fc1 for e in self.local_experts]
        fc2 = [e.linear_fc2 for e in self.local_experts]
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device, dtype=torch.int64)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        fc1_layout = ExpertWeights(fc1, self.weight_quant, dtype)
        fc2_layout = ExpertWeights(fc2, self.weight_quant, dtype)
        h = _GroupedLinear.apply(x, offsets, fc1_layout, True, *ExpertWeights.params(fc1))
        activation = functools.partial(expert_activation, config=self.config, width=fc2_layout.width)
        if recomputes_moe_act(self.config) and torch.is_grad_enabled():  # no grad: nothing kept to recompute
            out = _RecomputedActivationLinear.apply(h, permuted_probs, offsets, fc2_layout, activation,
                                                    *ExpertWeights.params(fc2))
        else:
            out = _GroupedLinear.apply(self.fc2_input(activation(h, permuted_probs), counts), offsets, fc2_layout,
                                       False, *ExpertWeights.params(fc2))
        return out, None


def quantize_experts(model: torch.nn.Module, fmt: str) -> int:
    """Fake-quantize the weights of every ``GroupedGemmExperts`` of ``model`` to ``fmt`` (``--kd-quant``);
    returns how many there are. None is an error: the flag check refuses the runs that build none."""
    experts = [m for m in model.modules() if isinstance(m, GroupedGemmExperts)]
    if not experts:
        raise ValueError(f"--kd-quant {fmt}: the model has no megatron_kd grouped experts to fake-quantize")
    for module in experts:
        module.weight_quant = fmt
    return len(experts)


@torch.no_grad()
def bake_quantized_experts(model: torch.nn.Module) -> int:
    """Replace the weights of every fake-quantized ``GroupedGemmExperts`` of ``model`` with their
    quantized values (what its forward computes with), for export; returns how many weights."""
    baked = 0
    for module in model.modules():
        if isinstance(module, GroupedGemmExperts) and module.weight_quant is not None:
            for expert in module.local_experts:
                for linear in (expert.linear_fc1, expert.linear_fc2):
                    linear.weight.copy_(fake_quantize(linear.weight, module.weight_quant))
                    baked += 1
    return baked
