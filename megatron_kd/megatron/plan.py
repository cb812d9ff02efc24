"""``megatron-kd plan``: will this student fit, per GPU, before anything is launched?

    megatron-kd plan <the Megatron-LM flags of the run> [--gpus 8] [--gpu-memory 141GB]
                     [--host-memory 2TB] [--loss fused|dense|ce] [--search]

Per GPU, in GiB (the most loaded rank):

  weights      bf16 parameters of this rank's shard: the non-expert part (tensor-parallel shard
               plus replicated norms and router) and its experts (1/EP of them)
  gradients    Megatron's ``main_grad`` buffer: fp32 (bf16 training accumulates and reduces in fp32),
               bf16 with ``--main-grads-dtype bf16`` / ``--grad-reduce-in-bf16``
  optimizer    ``--kd-optimizer bf16-sr-8bit``: 8-bit moments and no master copy, 2.03 bytes per
               parameter (``megatron_kd.optim.megatron.optimizer_memory``); otherwise
               Adam's master weights and two moments, in the precision-aware dtypes
               (``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``), sharded over
               data parallel by the distributed optimizer (experts over expert-data parallel). With
               ``--optimizer-cpu-offload`` Megatron's hybrid optimizer runs torch's Adam in fp32
               whatever those dtypes say: what it moves to host memory
               (``--optimizer-offload-fraction``) costs 20 bytes per parameter there (measured), and
               the part it keeps on the GPU 12
  activations  what backward keeps: per layer and token, attention (q/k/v, context, projection
               input, norms) and MoE (dispatched tokens, fc1 output, activation) in bf16
               (``--recompute-modules moe_act``: no activation; megatron_kd's experts recompute it),
               plus one MoE layer's stacked expert weights in flight (rebuilt in its backward). With
               ``--recompute-granularity full`` layers recomputed whole keep only their input:
               ``--recompute-method uniform`` with N layers per group keeps every group's input and
               one group in flight; ``block`` with N layers keeps the first N layers' inputs and the
               other layers whole (the block's backward comes last, one layer of it in flight).
               Sinks, windows and the attention kernels keep O(s) statistics only. The attention
               is FlashAttention-4's (core attention's flash4 path: K/V kept as their groups); without
               flash-attn-4 the cuDNN path keeps K/V repeated to the query heads, 4·(heads − groups)·d
               bytes per token more on each full-attention layer (0.44 GiB at GPT-OSS width, 32K)
  dispatch     the all-to-all send and receive buffers of routed tokens (EP > 1)
  loss         ``fused``: one chunk block (one bf16 weight gradient + 0.5 GiB, less the op's own
               buffers) and Megatron's dummy weight gradient; ``ce``: Megatron's output layer +
               cross-entropy (bf16 logits and their fp32 copy, [s, V/TP]); ``dense``: materialized
               KD: bf16 logits and four fp32 [s, V/TP] tensors at its peak (copy, log-softmax,
               probabilities, logit gradient)
  kd batch     the teacher's ids (int32) and log-probs (fp32), [s, K] per micro-batch

Parameter counts come from Megatron-LM's own estimator (``theoretical_memory_usage``), which already
splits tensor-parallel, replicated and expert-parallel parameters; we add the terms it lacks (the
KD loss path, precision-aware and offloaded optimizer states, MoE dispatch, the activations of
this project's local attention and experts). The estimate is checked against peaks measured on
H200s (``benchmarks/memory_measurements.json``, ``tests/megatron/test_plan.py``).

Before estimating, the run's layout is checked as Megatron checks it at start-up (one ``FlagError``
line for the first rule it breaks; ``layout_error``): positive sizes, none above 2**31 - 1
(``PLAN_SIZE_LIMIT``); TP x PP x CP divides the GPUs; expert-TP x EP x PP divides them and EP the
experts; heads and query groups divisible by TP; layers by PP; the global batch by micro-batch x DP;
the sequence by 2 x CP (CP > 1) and by TP under sequence parallelism; MoE under TP > 1 needs
sequence parallelism. Every term is >= 0 (asserted).

``--search`` tries the layouts (TP, EP, PP, CP, recompute, micro-batch) that divide the GPUs (and,
with ``--transformer-impl local``, that megatron-core's local spec can run; recompute: none, every
layer, or block recompute of a quarter, half or three quarters of each stage's layers, each with and
without moe_act) and lists those that fit, fastest first by a simple cost model: compute per GPU,
× (1 + 1/3 of the fraction of layers recomputed whole) (a layer's forward is a third of its
forward + backward), ×1.01 with moe_act (one elementwise pass per MoE layer), + 10% per doubling
of TP (its all-reduces), + the pipeline bubble (PP−1)/micro-batches. Each listed layout names the
recompute flags that give it.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import re
from dataclasses import dataclass, field

from megatron_kd.ops.kl.function import triton_block_budget, triton_row_bytes
from megatron_kd.optim.megatron import expand_optimizer_flags, optimizer_memory

GIB = 2**30
DEFAULT_GPU_MEMORY = "141GB"  # one H200
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def parse_size(text: str) -> float:
    """'141GB', '2TB', '80GiB' -> bytes (GB/TB decimal, GiB/TiB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 141GB, 2TB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}[unit]
    return float(m.group(1)) * scale


RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    recompute: bool = False  # --recompute-granularity full
    micro_batch: int = 1
    recompute_method: str = "uniform"  # with recompute: --recompute-method
    recompute_layers: int = 1  # with recompute: --recompute-num-layers (group size, or the block's layers)
    moe_act: bool = False  # --recompute-modules moe_act (megatron_kd's experts honour it under full too)

    def recompute_flags(self) -> list[str]:
        """The Megatron-LM flags of this layout's recompute."""
        flags = []
        if self.recompute:
            flags += ["--recompute-granularity", "full", "--recompute-method", self.recompute_method,
                      "--recompute-num-layers", str(self.recompute_layers)]
        if self.moe_act:
            flags += ([] if self.recompute else ["--recompute-granularity", "selective", "--moe-grouped-gemm"])
            flags += ["--recompute-modules", "moe_act"]
        return flags

    def describe(self) -> str:
        recompute = ""
        if self.recompute:
            recompute = (" recompute=full" if (self.recompute_method, self.recompute_layers) == ("uniform", 1)
                         else f" recompute={self.recompute_method}:{self.recompute_layers}")
        return (f"TP{self.tp} PP{self.pp} EP{self.ep} CP{self.cp} mbs{self.micro_batch}" + recompute
                + (" +moe_act" if self.moe_act else ""))


@dataclass
class Plan:
    layout: Layout
    gpu_bytes: dict[str, float] = field(default_factory=dict)  # per GPU, by term
    host_bytes: float = 0.0  # per GPU (offloaded optimizer state)
    params: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.gpu_bytes.values())


def shard_parameters(args) -> tuple[float, float]:
    """(non-expert, expert) parameters on the most loaded rank, from Megatron-LM's estimator.

    Its ``compute_weight_and_optimizer_memory`` returns bytes: 18 per parameter without the
    distributed optimizer, 6 + 12/DP (non-expert) and 6 + 12/EDP (expert) with it. Two calls (DP = 1
    with EDP → ∞) separate the two counts. It knows gated units only through ``--swiglu``."""
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    a = copy.copy(args)
    a.swiglu = bool(args.swiglu or args.quick_geglu)
    a.use_distributed_optimizer = False
    plain = compute_weight_and_optimizer_memory(a) / 18  # Pd + Pe
    a.use_distributed_optimizer, a.data_parallel_size = True, 1
    a.world_size = args.expert_tensor_parallel_size * args.expert_model_parallel_size * args.pipeline_model_parallel_size
    a.world_size *= 10**12  # expert-data parallel "infinite": experts cost 6 bytes
    split = compute_weight_and_optimizer_memory(a)  # 18·Pd + 6·Pe
    experts = (18 * plain - split) / 12
    return plain - experts, experts


# Megatron's --optimizer-cpu-offload (megatron-core 0.19's HybridDeviceOptimizer) hands each shard
# parameter to torch's Adam in fp32 (param_update_in_fp32), ignoring the precision-aware dtypes. On
# the host, per offloaded parameter: an fp32 master copy, a pinned fp32 gradient, two fp32 moments
# and the pinned bf16 staging copy that the caching host allocator keeps (18 bytes, then its rounding
# of pinned blocks). Measured: 20.2 bytes of peak RSS per parameter (0.94B parameters, fraction 1,
# one H200 machine, 2026-11-30). The fraction kept on the GPU holds an fp32 copy and fp32 moments.
OFFLOAD_HOST_BYTES_PER_PARAM = 20.0
OFFLOAD_GPU_BYTES_PER_PARAM = 12.0


def _gradient_bytes_per_param(args) -> float:
    """Megatron's main_grad buffer: bf16 only when bf16 training does not accumulate in fp32."""
    bf16_grads = getattr(args, "main_grads_dtype", "fp32") == "bf16" or getattr(args, "grad_reduce_in_bf16", False)
    return 2.0 if getattr(args, "bf16", False) and bf16_grads else 4.0


def _optimizer_bytes_per_param(args) -> float:
    choice = getattr(args, "kd_optimizer", "megatron")
    if choice != "megatron":
        return optimizer_memory(choice).state
    main = 2 if getattr(args, "main_params_dtype", "fp32") == "fp16" else 4
    if not getattr(args, "use_precision_aware_optimizer", False):
        return 12.0
    return main + _DTYPE_BYTES[getattr(args, "exp_avg_dtype", "fp32")] + _DTYPE_BYTES[getattr(args, "exp_avg_sq_dtype", "fp32")]


def _layer_activation_bytes_per_token(args, moe_act: bool = False) -> tuple[float, float]:
    """(attention + norms, MoE or MLP) bytes kept per token of one layer, bf16; ``moe_act``: the
    experts' activation is recomputed, not kept."""
    h, n = args.hidden_size, args.num_attention_heads
    g = args.num_query_groups if args.group_query_attention else n
    d = args.kv_channels or h // n
    attention = 2 * ((n + 2 * g) * d + 2 * n * d + 2 * h)  # q/k/v, context, projection input, norm in/out
    if args.num_experts:
        ffn, k = args.moe_ffn_hidden_size or args.ffn_hidden_size, args.moe_router_topk
        # per routed copy: fc1's input [x | 1], its output (2·ffn: the activation's input), fc2's input
        # (the activation); fc2's output goes to the combine, which keeps nothing of it; then norm, residual
        mlp = 2 * k * (h + 3 * ffn) + 2 * 2 * h
        if moe_act:
            mlp -= 2 * k * ffn
    else:
        mlp = 2 * (h + 3 * args.ffn_hidden_size) + 2 * 2 * h
    return attention, mlp


def micro_batches(args, layout: Layout, gpus: int) -> int:
    """Micro-batches per data-parallel rank in one global batch."""
    data_parallel = max(1, gpus // (layout.tp * layout.pp * layout.cp))
    return max(1, args.global_batch_size // layout.micro_batch // data_parallel)


def layout_error(args, layout: Layout, gpus: int, *, sequence_parallel: bool | None = None) -> str | None:
    """The first of Megatron's layout rules that ``layout`` on ``gpus`` GPUs breaks, as one line
    naming the flags, or None. ``sequence_parallel`` overrides ``--sequence-parallel`` (the search
    assumes it wherever the spec has it)."""
    sizes = {"--gpus": gpus, "--tensor-model-parallel-size": layout.tp, "--pipeline-model-parallel-size": layout.pp,
             "--context-parallel-size": layout.cp, "--expert-model-parallel-size": layout.ep,
             "--micro-batch-size": layout.micro_batch}
    for flag, value in sizes.items():
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    model = layout.tp * layout.pp * layout.cp
    if gpus % model:
        return (f"--tensor-model-parallel-size {layout.tp} x --pipeline-model-parallel-size {layout.pp} x "
                f"--context-parallel-size {layout.cp} = {model} does not divide --gpus {gpus}")
    data_parallel = gpus // model
    experts = args.num_experts
    if layout.ep > 1 and not experts:
        return f"--expert-model-parallel-size {layout.ep} needs --num-experts"
    if experts and experts % layout.ep:
        return f"--expert-model-parallel-size {layout.ep} does not divide --num-experts {experts}"
    expert_tp = args.expert_tensor_parallel_size or layout.tp
    if expert_tp < 1:
        return f"--expert-tensor-parallel-size must be >= 1, got {expert_tp}"
    expert_model = expert_tp * layout.ep * layout.pp
    if gpus % expert_model:
        return (f"--expert-tensor-parallel-size {expert_tp} x --expert-model-parallel-size {layout.ep} x "
                f"--pipeline-model-parallel-size {layout.pp} = {expert_model} does not divide --gpus {gpus}")
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.num_attention_heads % layout.tp:
        return (f"--tensor-model-parallel-size {layout.tp} does not divide --num-attention-heads "
                f"{args.num_attention_heads}")
    if groups % layout.tp:
        return f"--tensor-model-parallel-size {layout.tp} does not divide --num-query-groups {groups}"
    uneven = (getattr(args, "decoder_first_pipeline_num_layers", None), getattr(args, "decoder_last_pipeline_num_layers", None),
              getattr(args, "pipeline_model_parallel_layout", None))
    if all(x is None for x in uneven) and args.num_layers % layout.pp:
        return f"--pipeline-model-parallel-size {layout.pp} does not divide --num-layers {args.num_layers}"
    if args.global_batch_size % (layout.micro_batch * data_parallel):
        return (f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                f"{layout.micro_batch} x data-parallel size {data_parallel} (= --gpus {gpus} / {model})")
    if layout.cp > 1 and args.seq_length % (2 * layout.cp):
        return f"--seq-length {args.seq_length} is not a multiple of 2 x --context-parallel-size {layout.cp}"
    sequence_parallel = args.sequence_parallel if sequence_parallel is None else sequence_parallel
    if sequence_parallel and layout.tp > 1 and (args.seq_length // layout.cp) % layout.tp:
        return (f"--seq-length {args.seq_length} (per context-parallel rank {args.seq_length // layout.cp}) is not a "
                f"multiple of --tensor-model-parallel-size {layout.tp} under --sequence-parallel")
    if experts and layout.tp > 1 and not sequence_parallel:
        return (f"MoE under --tensor-model-parallel-size {layout.tp} needs --sequence-parallel (megatron-core refuses "
                "to train it without)")
    return None


# the run's sizes, each >= 1 where given (layout_error checks them again for the layouts --search makes)
_MODEL_SIZES = (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                ("--num-attention-heads", "num_attention_heads"), ("--seq-length", "seq_length"),
                ("--ffn-hidden-size", "ffn_hidden_size"), ("--kv-channels", "kv_channels"),
                ("--num-query-groups", "num_query_groups"), ("--num-experts", "num_experts"),
                ("--moe-ffn-hidden-size", "moe_ffn_hidden_size"), ("--moe-router-topk", "moe_router_topk"),
                ("--global-batch-size", "global_batch_size"), ("--vocab-size", "vocab_size"),
                ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by"),
                ("--micro-batch-size", "micro_batch_size"),
                ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                ("--context-parallel-size", "context_parallel_size"),
                ("--expert-model-parallel-size", "expert_model_parallel_size"),
                ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"))


# the largest value of one size plan estimates with (int32's): far beyond any run, far below where
# the estimate's products of sizes leave float range
PLAN_SIZE_LIMIT = 2**31 - 1


def check_model_sizes(args) -> None:
    """Every size the estimate uses is >= 1 and at most ``PLAN_SIZE_LIMIT`` where given (one ``FlagError``)."""
    from megatron_kd.errors import FlagError

    for flag, dest in (*_MODEL_SIZES, ("--kd-topk", "kd_topk"), ("--kd-draws", "kd_draws")):
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be >= 1, got {value}")
        if value is not None and value > PLAN_SIZE_LIMIT:  # the estimate's floats would overflow, or mean nothing
            raise FlagError(f"{flag} {value}: plan sizes runs up to {PLAN_SIZE_LIMIT:,} in any one size")
    if args.num_experts and args.moe_router_topk > args.num_experts:
        raise FlagError(f"--moe-router-topk {args.moe_router_topk} is more than --num-experts {args.num_experts}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise FlagError(f"--num-attention-heads {args.num_attention_heads} does not divide --hidden-size "
                        f"{args.hidden_size} (or give --kv-channels)")
    offload = getattr(args, "optimizer_offload_fraction", 0.0)
    if not 0 <= offload <= 1:
        raise FlagError(f"--optimizer-offload-fraction must be in [0, 1], got {offload}")


def _on_layout(args, layout: Layout, gpus: int):
    """A copy of ``args`` with the parallel sizes of ``layout`` on ``gpus`` GPUs."""
    a = copy.copy(args)
    a.tensor_model_parallel_size, a.pipeline_model_parallel_size = layout.tp, layout.pp
    a.expert_model_parallel_size, a.context_parallel_size = layout.ep, layout.cp
    a.expert_tensor_parallel_size = a.expert_tensor_parallel_size or layout.tp
    a.micro_batch_size, a.world_size = layout.micro_batch, gpus
    a.data_parallel_size = gpus // (layout.tp * layout.pp * layout.cp)
    return a


def model_parameters(args) -> float:
    """Parameters of the whole model of ``args`` (``plan_args``' namespace): the count that
    ``estimate`` multiplies by its bytes per parameter, ``shard_parameters`` on one process (no
    parallelism), non-expert plus expert. Megatron-LM's estimator counts weight matrices, norms and
    word embeddings, not linear biases nor a learned position table (``--position-embedding-type
    learned_absolute``). The CPU demo sizes its models with it."""
    whole = _on_layout(args, Layout(), 1)
    whole.expert_tensor_parallel_size = 1
    return sum(shard_parameters(whole))


def estimate(args, layout: Layout, *, gpus: int, loss: str = "fused", kd_topk: int = 100) -> Plan:
    """Memory per GPU of the run ``args`` (Megatron-LM flags) under ``layout`` on ``gpus`` GPUs."""
    a = _on_layout(args, layout, gpus)
    dense, experts = shard_parameters(a)
    expert_dp = gpus // (a.expert_tensor_parallel_size * layout.ep * layout.pp)
    plan = Plan(layout, params={"non-expert": dense, "expert": experts})
    # the parameters this rank's optimizer updates
    optimized = (dense / (a.data_parallel_size if a.use_distributed_optimizer else 1)
                 + experts / (expert_dp if a.use_distributed_optimizer else 1))
    plan.gpu_bytes["weights"] = 2 * (dense + experts)
    plan.gpu_bytes["gradients"] = _gradient_bytes_per_param(a) * (dense + experts)
    if getattr(a, "optimizer_cpu_offload", False):
        offload = a.optimizer_offload_fraction
        plan.gpu_bytes["optimizer"] = optimized * (1 - offload) * OFFLOAD_GPU_BYTES_PER_PARAM
        plan.host_bytes = optimized * offload * OFFLOAD_HOST_BYTES_PER_PARAM
    else:
        plan.gpu_bytes["optimizer"] = optimized * _optimizer_bytes_per_param(a)

    tokens = a.seq_length * layout.micro_batch / layout.cp  # per GPU (sequence split by CP)
    layers = math.ceil(a.num_layers / layout.pp)
    attention, mlp = _layer_activation_bytes_per_token(a, layout.moe_act)
    per_layer = tokens * (attention / layout.tp + mlp)  # experts see whole tokens (expert-TP 1)
    layer_input = 2 * tokens * a.hidden_size / layout.tp
    if not layout.recompute:
        stored = layers * per_layer
    elif layout.recompute_method == "uniform":  # every group's input, one group in flight
        group = min(layout.recompute_layers, layers)
        stored = math.ceil(layers / group) * layer_input + group * per_layer
    else:  # block: the first N layers' inputs and the others whole; the block's backward comes last
        block = min(layout.recompute_layers, layers)
        stored = block * layer_input + max(layers - block, 1 if block else 0) * per_layer
    if a.num_experts:  # the experts rebuild their stacked weights in backward: one layer's copy in flight
        local_experts = a.num_experts // layout.ep
        stored += 2 * local_experts * 3 * a.hidden_size * (a.moe_ffn_hidden_size or a.ffn_hidden_size)
    # the first pipeline stage keeps the micro-batches in flight: up to PP of them
    plan.gpu_bytes["activations"] = stored * min(layout.pp, micro_batches(a, layout, gpus))
    if a.num_experts and layout.ep > 1:
        plan.gpu_bytes["dispatch"] = 2 * 2 * tokens * a.moe_router_topk * a.hidden_size
    vocab_local = a.padded_vocab_size / layout.tp
    if loss == "fused":  # the chunk block and its row buffers (the op's own budget), and the dummy wgrad
        wgrad = 2 * vocab_local * a.hidden_size
        row = triton_row_bytes(int(vocab_local), a.hidden_size, kd_topk, itemsize=2)
        block = min(triton_block_budget(int(wgrad), tokens, kd_topk, row_bytes=row), tokens * row)
        plan.gpu_bytes["loss"] = block + wgrad
    elif loss == "ce":
        plan.gpu_bytes["loss"] = tokens * vocab_local * (2 + 4)
    else:  # dense KD: bf16 logits and four fp32 [s, V/TP] tensors at its peak
        plan.gpu_bytes["loss"] = tokens * vocab_local * (2 + 4 * 4)
    if loss != "ce":
        plan.gpu_bytes["kd batch"] = tokens * kd_topk * 8
    # a negative term is a bug in a formula (or a layout layout_error should have refused)
    assert all(v >= 0 for v in plan.gpu_bytes.values()) and plan.host_bytes >= 0, plan
    return plan


def step_cost(args, layout: Layout, gpus: int) -> float:
    """Relative step time of a layout (lower is faster): see the module docstring."""
    cost = 1.0 / gpus
    if layout.recompute:
        layers = math.ceil(args.num_layers / layout.pp)
        whole = layers if layout.recompute_method == "uniform" else min(layout.recompute_layers, layers)
        cost *= 1 + whole / layers / 3
    if layout.moe_act:
        cost *= 1.01
    cost *= 1 + 0.1 * math.log2(layout.tp)
    return cost * (1 + (layout.pp - 1) / micro_batches(args, layout, gpus))


def recompute_choices(args, pp: int):
    """(recompute, method, layers) choices of --search: none, every layer, and block recompute of a
    quarter, half and three quarters of a stage's layers."""
    layers = math.ceil(args.num_layers / pp)
    yield False, "uniform", 1
    yield True, "uniform", 1
    for block in sorted({max(1, layers * q // 4) for q in (1, 2, 3)} - {layers}):
        yield True, "block", block


def candidate_layouts(args, gpus: int, *, local_spec: bool):
    """The layouts --search tries: each one Megatron accepts (``layout_error``)."""
    moe_act = (False, True) if args.num_experts else (False,)
    for tp, pp, ep, cp, mbs, act in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8), (1, 2), (1, 2), moe_act):
        # without TE: megatron-core refuses MoE training under TP without sequence parallelism, which its
        # local spec lacks, and its local attention (ours included) has no context parallelism; with
        # TE the layouts assume --sequence-parallel under TP
        if local_spec and cp > 1:
            continue
        for recompute, method, recompute_layers in recompute_choices(args, pp):
            layout = Layout(tp=tp, pp=pp, ep=ep, cp=cp, recompute=recompute, micro_batch=mbs,
                            recompute_method=method, recompute_layers=recompute_layers, moe_act=act)
            if layout_error(args, layout, gpus, sequence_parallel=not local_spec) is None:
                yield layout


def search(args, gpus: int, *, gpu_memory: float, host_memory: float | None = None, loss: str = "fused",
           kd_topk: int = 100) -> list[Plan]:
    """``--search``: the plans of the candidate layouts that fit ``gpu_memory`` per GPU (and
    ``host_memory`` per node), fastest first by ``step_cost`` (then the smaller)."""
    local = args.transformer_impl == "local"
    fits = [p for p in (estimate(args, layout, gpus=gpus, loss=loss, kd_topk=kd_topk)
                        for layout in candidate_layouts(args, gpus, local_spec=local))
            if p.total <= gpu_memory and (host_memory is None or p.host_bytes * gpus <= host_memory)]
    return sorted(fits, key=lambda p: (step_cost(args, p.layout, gpus), p.total))


def format_plan(plan: Plan, gpu_memory: float, host_memory: float | None, gpus: int) -> str:
    lines = [f"layout {plan.layout.describe()} on {gpus} GPUs; per GPU (most loaded rank):",
             f"  parameters      {plan.params['non-expert'] / 1e9:8.2f} B non-expert + "
             f"{plan.params['expert'] / 1e9:.2f} B expert"]
    for name, value in plan.gpu_bytes.items():
        lines.append(f"  {name:14s}  {value / GIB:8.1f} GiB")
    headroom = gpu_memory - plan.total
    lines.append(f"  {'total':14s}  {plan.total / GIB:8.1f} GiB of {gpu_memory / GIB:.1f} GiB -> "
                 + (f"fits, {headroom / GIB:.1f} GiB headroom" if headroom >= 0 else
                    f"DOES NOT FIT by {-headroom / GIB:.1f} GiB"))
    if plan.host_bytes:
        need = plan.host_bytes * gpus
        lines.append(f"  host memory     {plan.host_bytes / GIB:8.1f} GiB per GPU, {need / GIB:.0f} GiB per node "
                     "(offloaded optimizer)"
                     + ("" if host_memory is None else (" -> fits" if need <= host_memory else
                                                         f" -> DOES NOT FIT the {host_memory / GIB:.0f} GiB given")))
    return "\n".join(lines)


def plan_args(flags: list[str], gpus: int) -> tuple[argparse.Namespace, Layout]:
    """A run's Megatron-LM (and --kd-*) flags -> (its arguments with the derived sizes the estimate
    needs, its layout). Mistakes, and layouts Megatron would refuse, are one ``FlagError``."""
    from megatron_kd.errors import FlagError
    from megatron_kd.megatron.args import check_kd_flags
    from megatron_kd.megatron.flags import parse_flags

    args = parse_flags(expand_optimizer_flags(flags), prog="megatron-kd plan")  # with --kd-optimizer's flags
    for flag, value in (("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                        ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length)):
        if value is None:
            raise FlagError(f"plan needs the run's {flag}")
    check_kd_flags(args)
    check_model_sizes(args)
    vocab = args.vocab_size
    if vocab is None and args.kd_student_hf:
        from megatron_kd.megatron.hf_check import check_hf_dir
        from megatron_kd.models.hf import hf_vocab_rows

        check_hf_dir(args.kd_student_hf, "--kd-student-hf", tokenizer=False)
        vocab = hf_vocab_rows(args.kd_student_hf)
    if vocab is None:
        raise FlagError("plan needs the vocabulary: --vocab-size N (or --kd-student-hf DIR)")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-vocab // multiple) * multiple
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    if args.num_experts:  # as Megatron-LM's validation defaults it
        args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    args.global_batch_size = args.global_batch_size or gpus
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    ep=args.expert_model_parallel_size, cp=args.context_parallel_size,
                    recompute=args.recompute_granularity == "full", micro_batch=args.micro_batch_size or 1,
                    recompute_method=args.recompute_method or "uniform", recompute_layers=args.recompute_num_layers or 1,
                    moe_act=args.recompute_granularity is not None and "moe_act" in (args.recompute_modules or ()))
    problem = layout_error(args, layout, gpus)
    if problem:
        raise FlagError(f"Megatron cannot run this layout: {problem}")
    return args, layout
