"""Activation-based importance of a megatron-core GPTModel's layers, experts and FFN channels.

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
  (Minitron's head score).

nvidia-modelopt's Minitron pruning (``modelopt.torch.prune``, mode ``mcore_minitron``) computes the
same kind of scores, but imports Transformer Engine at module load and converts TE modules; the
local spec this project runs without TE is not among them, so these hooks are our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ImportanceScores:
    """Scores of the teacher's parts, larger = more important (fp64 on the CPU)."""

    layer_groups: torch.Tensor  # [L / g] block influence of each group of g layers
    group_size: int
    experts: torch.Tensor | None  # [L, E] routing mass, or None without MoE
    ffn: torch.Tensor | None  # [L, F] channel L2 norms, or None without dense MLP layers
    tokens: int  # calibration tokens seen (all data-parallel ranks)
    heads: torch.Tensor | None = None  # [L, heads] context L2 norms, or None where no attention was seen

    def to_dict(self) -> dict:
        out = {"group_size": self.group_size, "tokens": self.tokens, "layer_groups": self.layer_groups.tolist()}
        if self.experts is not None:
            out["experts"] = self.experts.tolist()
        if self.ffn is not None:
            out["ffn"] = self.ffn.tolist()
        if self.heads is not None:
            out["heads"] = self.heads.tolist()
        return out


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
    ``dp_group``: the model's tensor- and data-parallel groups (None: one process).
    """

    def __init__(self, model, *, group_size: int = 1, tp_group=None, dp_group=None):
        while not hasattr(model, "decoder") and hasattr(model, "module"):  # Float16Module, DDP wrappers
            model = model.module
        layers = list(model.decoder.layers)
        if len(layers) % group_size:
            raise ValueError(f"{len(layers)} layers do not split into groups of {group_size}")
        self.layers, self.group_size = layers, group_size
        self.tp_group, self.dp_group = tp_group, dp_group
        n = len(layers)
        self.cos_sum = torch.zeros(n // group_size, dtype=torch.float64)
        self.tokens = 0
        self.expert_mass: list[torch.Tensor | None] = [None] * n
        self.ffn_sq: list[torch.Tensor | None] = [None] * n
        self.head_sq: list[torch.Tensor | None] = [None] * n
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

    def __enter__(self) -> "ImportanceCollector":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_pre(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._layer_post(i), with_kwargs=True))
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._router_post(i)))
            elif hasattr(layer.mlp, "linear_fc2"):
                self._handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(self._fc2_pre(i)))
            attention = getattr(layer, "self_attention", None)
            if attention is not None and hasattr(attention, "linear_proj"):
                self._handles.append(attention.linear_proj.register_forward_pre_hook(
                    self._proj_pre(i, attention.hidden_size_per_attention_head)))
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

    def scores(self) -> ImportanceScores:
        """The scores over every rank's calibration tokens (collective over ``dp_group`` and ``tp_group``)."""
        tokens = int(self._sum_over(torch.tensor([float(self.tokens)], dtype=torch.float64), self.dp_group))
        if tokens == 0:
            raise ValueError("no calibration tokens were seen: run the model's forward inside the collector")
        cos = self._sum_over(self.cos_sum, self.dp_group)
        experts = None
        if any(m is not None for m in self.expert_mass):
            experts = torch.stack([self._sum_over(m, self.dp_group) for m in self.expert_mass])
        ffn, heads = self._norms(self.ffn_sq), self._norms(self.head_sq)
        return ImportanceScores(layer_groups=1 - cos / tokens, group_size=self.group_size, experts=experts,
                                ffn=ffn, tokens=tokens, heads=heads)

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
                                    dp_group=dp_group)
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
