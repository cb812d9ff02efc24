"""Activation-based importance of a megatron-core GPTModel's layers, experts, FFN channels, attention
heads and hidden channels.

One calibration pass of the teacher over the run's data (``megatron-kd prune``) with forward hooks
on megatron-core's own modules, so it is the same for every architecture the model spec builds
(GPT-OSS, Llama, Qwen3) and every layout (the statistics are summed over data-parallel ranks and
gathered over tensor-parallel ones):

- a group of ``g`` consecutive layers: its block influence, 1 − the mean over tokens of
  cos(hidden state into its first layer, hidden state out of its last) (ShortGPT, Men et al. 2024):
  a group that hardly turns the residual stream is the one to drop. ``g`` = 2 for GPT-OSS, whose
  window / full-attention layers alternate: dropping pairs keeps the alternation;
- an expert: its routing mass, the sum over tokens of the router's weight on it (the probabilities
  the expert outputs are multiplied by; zero where it is not among the token's top k);
- an FFN channel (dense MLP layers): the L2 norm over tokens of its activation, the input of
  ``linear_fc2`` (Minitron, Muralidharan et al. 2024);
- an attention head: the L2 norm over tokens of its context, its slice of ``linear_proj``'s input
  (Minitron's head score);
- an expert's FFN channel: the L2 norm over the tokens routed to that expert of its activation at
  the expert's fc2 input (Minitron's activation importance, per layer and expert; megatron-core
  multiplies the activation by the token's routing probability before fc2, so a channel counts as
  much as the expert's output weighs). The local spec's experts compute that activation in two
  places: ``GroupedGemmExperts`` for all experts at once over expert-sorted rows, read through its
  ``fc2_input`` tap (``ExpertActivationTap``, called with the rows per expert), and megatron-core's
  ``SequentialMLP`` loop (CPU fp32), read at each local expert's ``linear_fc2``; statistics are
  gathered over expert-tensor- and expert-parallel ranks and summed over expert-data-parallel ones,
  with the groups the experts module holds;
- a hidden channel: the sum over every norm (each layer's input and pre-MLP norm, and the final
  norm) of the L2 norm over tokens of that norm's output channel (Minitron's embedding-channel score).
  Only norms that are modules of their own are read (the local spec's); Transformer Engine's spec
  fuses the layers' norms into the next linear, so no hidden scores come from it.

Token-split statistics (layers, routing mass, norms) are summed over tensor-parallel ranks too where
sequence parallelism splits the tokens over them.

nvidia-modelopt's Minitron pruning (``modelopt.torch.prune``, mode ``mcore_minitron``) computes the
same kind of scores, but imports Transformer Engine at module load and converts TE modules; the
local spec this project runs without TE is not among them, so these hooks are our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


SCORE_FIELDS = ("layer_groups", "experts", "ffn", "heads", "expert_ffn", "hidden")


@dataclass
class ImportanceScores:
    """Scores of the teacher's parts, larger = more important (fp64 on the CPU)."""

    layer_groups: torch.Tensor  # [L / g] block influence of each group of g layers
    group_size: int
    experts: torch.Tensor | None  # [L, E] routing mass, or None without MoE
    ffn: torch.Tensor | None  # [L, F] channel L2 norms, or None without dense MLP layers
    tokens: int  # calibration tokens seen (all data-parallel ranks)
    heads: torch.Tensor | None = None  # [L, heads] context L2 norms, or None where no attention was seen
    expert_ffn: torch.Tensor | None = None  # [L, E, moe FFN] experts' channel L2 norms, or None without experts
    hidden: torch.Tensor | None = None  # [hidden] norms' channel L2 norms summed over the norms, or None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every score held, by field name (GPT-OSS-120B's experts' channels alone are 36 × 128 × 2,880
        numbers: written as arrays, not JSON)."""
        return {name: getattr(self, name) for name in SCORE_FIELDS if getattr(self, name) is not None}


def block_influence(h_in: torch.Tensor, h_out: torch.Tensor) -> tuple[float, int]:
    """(sum over tokens of cos(h_in, h_out), tokens) for hidden states [..., h]."""
    a, b = h_in.reshape(-1, h_in.shape[-1]).double(), h_out.reshape(-1, h_out.shape[-1]).double()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).sum()), a.shape[0]


def _device_of(group) -> str:
    """Where a collective over ``group`` takes its tensors: NCCL reduces device tensors only."""
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


class ImportanceCollector:
    """Accumulates the statistics of ``model``'s forward passes while in a ``with`` block.

    ``group_size``: layers per droppable group (a divisor of the layer count). ``tp_group`` /
    ``dp_group``: the model's tensor- and data-parallel groups (None: one process);
    ``sequence_parallel``: the tokens are split over ``tp_group`` between the layers.
    """

    def __init__(self, model, *, group_size: int = 1, tp_group=None, dp_group=None, sequence_parallel: bool = False):
        while not hasattr(model, "decoder") and hasattr(model, "module"):  # Float16Module, DDP wrappers
            model = model.module
        self.final_norm = getattr(model.decoder, "final_layernorm", None)
        layers = list(model.decoder.layers)
        if len(layers) % group_size:
            raise ValueError(f"{len(layers)} layers do not split into groups of {group_size}")
        self.layers, self.group_size = layers, group_size
        self.tp_group, self.dp_group = tp_group, dp_group
        self.token_groups = [g for g in (dp_group, tp_group if sequence_parallel else None) if g is not None]
        n = len(layers)
        self.cos_sum = torch.zeros(n // group_size, dtype=torch.float64)
        self.tokens = 0
        self.expert_mass: list[torch.Tensor | None] = [None] * n
        self.ffn_sq: list[torch.Tensor | None] = [None] * n
        self.head_sq: list[torch.Tensor | None] = [None] * n
        self.expert_ffn_sq: list[torch.Tensor | None] = [None] * n  # [local experts, local channels]
        self.expert_groups: list[tuple | None] = [None] * n  # (expert-TP, EP, expert-DP) groups
        self.norm_sq: dict[int, torch.Tensor] = {}  # by the norm's position in ``norms()``
        self._group_input: torch.Tensor | None = None
        self._handles = []

    # hooks --------------------------------------------------------------------------------------
    def _layer_pre(self, index):
        def hook(module, args, kwargs):
            if index % self.group_size == 0:
                self._group_input = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
        return hook

    def _layer_post(self, index):
        def hook(module, args, kwargs, output):
            if index % self.group_size == self.group_size - 1:
                out = output[0] if isinstance(output, tuple) else output
                cos, tokens = block_influence(self._group_input, out.detach())
                self.cos_sum[index // self.group_size] += cos
                if index == self.group_size - 1:
                    self.tokens += tokens
        return hook

    def _router_post(self, index):
        def hook(module, args, output):
            probs = output[0].detach().double().sum(0).cpu()
            self.expert_mass[index] = probs if self.expert_mass[index] is None else self.expert_mass[index] + probs
        return hook

    def _fc2_pre(self, index):
        def hook(module, args):
            act = args[0].detach()
            sq = act.reshape(-1, act.shape[-1]).double().square().sum(0).cpu()
            self.ffn_sq[index] = sq if self.ffn_sq[index] is None else self.ffn_sq[index] + sq
        return hook

    def _proj_pre(self, index, head_dim: int):
        def hook(module, args):
            context = args[0].detach()
            sq = context.reshape(-1, context.shape[-1] // head_dim, head_dim).double().square().sum((0, 2)).cpu()
            self.head_sq[index] = sq if self.head_sq[index] is None else self.head_sq[index] + sq
        return hook

    def _expert_fc2_pre(self, index, width: int, expert: int | None = None):
        """fc2's input of one layer's experts: with ``expert`` one expert's rows (the sequential path),
        else the grouped path's tap, called with (rows of every expert in expert order, rows per expert)."""
        def hook(module, args):
            act = args[0].detach()[:, :width].double()  # the grouped input's bias column and padding go
            sq = self.expert_ffn_sq[index]
            if expert is not None:
                sq[expert] += act.square().sum(0).cpu()
            else:
                counts = torch.as_tensor(args[1], device=act.device)
                rows = torch.repeat_interleave(torch.arange(len(counts), device=act.device), counts)
                sq += act.new_zeros(len(counts), width).index_add_(0, rows, act.square()).cpu()
        return hook

    def _norm_post(self, position):
        def hook(module, args, output):
            out = (output[0] if isinstance(output, tuple) else output).detach()
            sq = out.reshape(-1, out.shape[-1]).double().square().sum(0).cpu()
            self.norm_sq[position] = sq if position not in self.norm_sq else self.norm_sq[position] + sq
        return hook

    def norms(self) -> list:
        """The norms whose outputs score the hidden channels: each layer's input and pre-MLP norm,
        then the final norm; [] where any of them is fused into the next linear (Transformer Engine's
        spec: an ``IdentityOp`` in its place), which leaves its output unseen."""
        from megatron.core.transformer.identity_op import IdentityOp

        found = [getattr(layer, name, None) for layer in self.layers
                 for name in ("input_layernorm", "pre_mlp_layernorm")] + [self.final_norm]
        return [] if any(m is None or isinstance(m, IdentityOp) for m in found) else found

    def _hook_experts(self, index, experts) -> None:
        local = list(getattr(experts, "local_experts", ()))
        if not local:
            return  # Transformer Engine's grouped experts: not read
        width = local[0].linear_fc2.weight.shape[1]
        if self.expert_ffn_sq[index] is None:
            self.expert_ffn_sq[index] = torch.zeros(len(local), width, dtype=torch.float64)
        self.expert_groups[index] = tuple(getattr(experts, g, None) for g in ("tp_group", "ep_group", "dp_group"))
        for e, expert in enumerate(local):
            self._handles.append(expert.linear_fc2.register_forward_pre_hook(self._expert_fc2_pre(index, width, e)))
        if hasattr(experts, "fc2_input"):
            self._handles.append(experts.fc2_input.register_forward_pre_hook(self._expert_fc2_pre(index, width)))

    def __enter__(self) -> "ImportanceCollector":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_pre(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._layer_post(i), with_kwargs=True))
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._router_post(i)))
                if getattr(layer.mlp, "experts", None) is not None:
                    self._hook_experts(i, layer.mlp.experts)
            elif hasattr(layer.mlp, "linear_fc2"):
                self._handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(self._fc2_pre(i)))
            attention = getattr(layer, "self_attention", None)
            if attention is not None and hasattr(attention, "linear_proj"):
                self._handles.append(attention.linear_proj.register_forward_pre_hook(
                    self._proj_pre(i, attention.hidden_size_per_attention_head)))
        for position, norm in enumerate(self.norms()):
            self._handles.append(norm.register_forward_hook(self._norm_post(position)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._group_input = None

    # result -------------------------------------------------------------------------------------
    def _sum_over(self, t: torch.Tensor, group) -> torch.Tensor:
        if group is None or dist.get_world_size(group) == 1:
            return t
        t = t.to(_device_of(group), copy=True)
        dist.all_reduce(t, group=group)
        return t.cpu()

    def _sum_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """A per-token statistic summed over every rank's tokens (data parallel; tensor parallel under
        sequence parallelism)."""
        for group in self.token_groups:
            t = self._sum_over(t, group)
        return t

    def _gather(self, t: torch.Tensor, group, dim: int) -> torch.Tensor:
        """``t`` of every rank of ``group`` concatenated along ``dim`` in rank order."""
        if group is None or dist.get_world_size(group) == 1:
            return t
        t = t.to(_device_of(group)).contiguous()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim).cpu()

    def scores(self) -> ImportanceScores:
        """The scores over every rank's calibration tokens (collective over ``dp_group`` and ``tp_group``,
        and the experts' groups)."""
        tokens = int(self._sum_tokens(torch.tensor([float(self.tokens)], dtype=torch.float64)))
        if tokens == 0:
            raise ValueError("no calibration tokens were seen: run the model's forward inside the collector")
        cos = self._sum_tokens(self.cos_sum)
        experts = None
        if any(m is not None for m in self.expert_mass):
            experts = torch.stack([self._sum_tokens(m) for m in self.expert_mass])
        ffn, heads = self._norms(self.ffn_sq), self._norms(self.head_sq)
        hidden = None
        if self.norm_sq:
            hidden = sum(self._sum_tokens(self.norm_sq[p]).sqrt() for p in sorted(self.norm_sq))
        return ImportanceScores(layer_groups=1 - cos / tokens, group_size=self.group_size, experts=experts,
                                ffn=ffn, tokens=tokens, heads=heads, expert_ffn=self._expert_norms(), hidden=hidden)

    def _expert_norms(self) -> torch.Tensor | None:
        """[L, E, I] from each layer's [local experts, local channels] sums of squares: channels
        gathered over expert-tensor-parallel ranks (contiguous blocks), experts over expert-parallel
        ones (contiguous blocks of local experts), tokens summed over expert-data-parallel ones."""
        if all(sq is None for sq in self.expert_ffn_sq):
            return None
        per_layer = []
        for sq, groups in zip(self.expert_ffn_sq, self.expert_groups):
            if sq is None:
                raise ValueError("the experts' activation was read in some MoE layers only")
            etp, ep, edp = groups
            sq = self._gather(self._gather(sq, etp, 1), ep, 0)
            per_layer.append(self._sum_over(sq, edp).sqrt())
        return torch.stack(per_layer)

    def _norms(self, sums: list[torch.Tensor | None]) -> torch.Tensor | None:
        """[L, N] L2 norms from per-layer sums of squares over this rank's tokens and its tensor-parallel
        share (linear_fc2's and linear_proj's inputs are split over TP ranks in contiguous blocks, rank
        order: FFN channels, attention heads)."""
        if all(sq is None for sq in sums):
            return None
        per_layer = []
        for sq in sums:
            sq = self._sum_over(sq, self.dp_group)
            if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
                sq = sq.to(_device_of(self.tp_group))
                parts = [torch.empty_like(sq) for _ in range(dist.get_world_size(self.tp_group))]
                dist.all_gather(parts, sq, group=self.tp_group)
                sq = torch.cat(parts).cpu()
            per_layer.append(sq.sqrt())
        return torch.stack(per_layer)


def calibrate(teacher, dataset, *, num_samples: int, micro_batch_size: int, group_size: int, dp_rank: int = 0,
              dp_size: int = 1, dp_group=None, device=None, progress: bool = True) -> ImportanceScores:
    """Importance scores of ``teacher``'s model (a ``MegatronTeacher``) over the first
    ``num_samples`` samples of ``dataset`` (Megatron's GPTDataset: dicts with "tokens" and
    "position_ids"), this data-parallel rank taking every ``dp_size``-th of them."""
    import time

    from tqdm import tqdm

    if not 0 < num_samples <= len(dataset):
        raise ValueError(f"calibration samples: between 1 and the dataset's {len(dataset)}, got {num_samples}")
    device = device or next(teacher.model.parameters()).device
    mine = list(range(dp_rank, num_samples, dp_size))
    bar = tqdm(total=len(mine), unit="sample", desc="calibration",
               disable=not (progress and (not dist.is_initialized() or dist.get_rank() == 0)))
    collector = ImportanceCollector(teacher.model, group_size=group_size, tp_group=teacher.tp_group,
                                    dp_group=dp_group, sequence_parallel=teacher.sequence_parallel)
    start, tokens = time.perf_counter(), 0
    with collector:
        for i in range(0, len(mine), micro_batch_size):
            items = [dataset[s] for s in mine[i:i + micro_batch_size]]
            batch = torch.stack([torch.as_tensor(x["tokens"]) for x in items]).to(device)
            teacher(batch, torch.stack([torch.as_tensor(x["position_ids"]) for x in items]).to(device))
            tokens += batch.numel()
            bar.update(len(items))
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}")
    bar.close()
    return collector.scores()
