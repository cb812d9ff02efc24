"""The student's loss inside Megatron: GPTModel's ``output_processor`` runs the fused KD loss.

``GPTModel.forward(..., output_processor=kd_output_processor, output_processor_context=ctx)``
hands us the final hidden states ([s, b, h], sequence-sharded under sequence parallelism) and the
output layer (its weight is this rank's vocabulary shard, or the shared embedding when tied)
instead of computing logits; the fused op turns them into the loss and its gradients chunk by
chunk. ``loss_func`` returns Megatron's (loss_sum, num_tokens, report) triple, reporting KD loss,
CE loss, teacher mass (the cached entries' share of the teacher's probability: 1 by construction
for a sampled cache) and teacher entries (per token: K, or a sampled cache's distinct draws, which
tell how spread the teacher is) as [sum, tokens] pairs that Megatron averages over micro-batches
and DP.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial

import torch

from megatron_kd.megatron.args import KDConfig
from megatron_kd.megatron.kd_data import get_kd_batch
from megatron_kd.megatron.packing import DocumentPacking
from megatron_kd.ops import fused_topk_kl, topk_kl_reference


@dataclass
class KDContext:
    config: KDConfig
    teacher_ids: torch.Tensor  # [b, s, K]
    teacher_logprobs: torch.Tensor  # [b, s, K]


def kd_output_processor(hidden_states, output_layer, output_weight, labels, loss_mask, context: KDContext, **_):
    """Replaces the output layer + cross-entropy: returns (loss_sum, stats [kd, ce, mass, tokens,
    entries]), each a sum over the trained tokens but ``tokens``, their count."""
    cfg = context.config
    weight = output_layer.weight if output_weight is None else output_weight
    kwargs = dict(
        loss_mask=loss_mask.t(), labels=labels.t(), kd_weight=cfg.weight, ce_weight=cfg.ce_weight,
        temperature=cfg.temperature, tail=cfg.tail, divergence=cfg.divergence, jsd_beta=cfg.jsd_beta,
        tp_group=output_layer.tp_group,
        sequence_parallel=output_layer.sequence_parallel, chunk_size=cfg.chunk_size, reduction="sum",
    )
    if cfg.impl == "fused":
        # main_grad fusion needs the loss backpropagated with gradient 1: bf16 with per-token loss
        fuse = getattr(output_layer.config, "calculate_per_token_loss", False) and hasattr(weight, "main_grad") \
            and weight.dtype == torch.bfloat16
        loss, stats = fused_topk_kl(hidden_states, weight, context.teacher_ids.transpose(0, 1),
                                    context.teacher_logprobs.transpose(0, 1), impl=cfg.op_impl,
                                    gradient_accumulation_fusion=fuse, **kwargs)
    else:
        loss, stats = topk_kl_reference(hidden_states, weight, context.teacher_ids.transpose(0, 1),
                                        context.teacher_logprobs.transpose(0, 1), **kwargs)
    # the teacher's entries per trained token (a sampled cache's distinct draws: its spread; its mass is 1)
    entries = ((context.teacher_ids >= 0).sum(-1).float() * loss_mask.float()).sum()
    return loss, torch.stack([stats["kd"], stats["ce"], stats["teacher_mass"], stats["tokens"], entries]).float()


def loss_func(output):
    """(loss_sum, num_tokens, report) for Megatron's schedules and logging."""
    loss, stats = output
    tokens = stats[3]
    num_tokens = tokens.detach().to(torch.int)
    pair = lambda x: torch.stack([x.detach().float(), tokens.float()])  # noqa: E731
    report = {"lm loss": pair(loss), "kd loss": pair(stats[0]), "ce loss": pair(stats[1]),
              "teacher mass": pair(stats[2]), "teacher entries": pair(stats[4])}
    return loss, num_tokens, report


def fused_ce_loss_func(output):
    """Cross-entropy batches through the fused op (``--kd-ce-impl fused``): loss and CE report."""
    loss, stats = output
    tokens = stats[3]
    pair = torch.stack([loss.detach().float(), tokens.float()])
    return loss, tokens.detach().to(torch.int), {"lm loss": pair, "ce loss": pair}


def ce_loss_func(loss_mask, per_token_loss):
    """Batches without teacher tensors (validation): the student's cross-entropy."""
    mask = loss_mask.reshape(-1).float()
    loss = (per_token_loss.reshape(-1).float() * mask).sum()
    tokens = mask.sum()
    pair = torch.stack([loss.detach(), tokens])
    return loss, tokens.detach().to(torch.int), {"lm loss": pair, "ce loss": pair}


class KDForwardStep:
    """Megatron ``forward_step_func``: batch (with teacher tensors) -> model -> fused KD loss.

    Used as is by ``megatron-kd train`` (megatron.training.pretrain) and by the CPU demo's loop.
    Batches without teacher tensors (training without a cache, validation) get the plain
    cross-entropy: through the same fused op (``ce_impl="fused"``: no [tokens x vocabulary] logits)
    or Megatron's output layer + cross-entropy (``"megatron"``). Counts tokens between calls to
    report tokens/s. ``packing`` (``--reset-attention-mask`` / ``--reset-position-ids``) keeps the
    documents of a sample apart: the model gets their ``packed_seq_params`` (packing.py).
    """

    def __init__(self, config: KDConfig, *, tp_group=None, cp_group=None, device=None,
                 is_first_stage=lambda: True, is_last_stage=lambda: True, packing: DocumentPacking | None = None):
        self.config = config
        self.packing = packing or DocumentPacking()
        # cross-entropy alone through the same fused op (batches without a teacher)
        self._ce_config = dataclasses.replace(config, weight=0.0, ce_weight=1.0, tail="none", divergence="forward",
                                              temperature=1.0, impl="fused")
        self.tp_group, self.cp_group, self.device = tp_group, cp_group, device
        self.is_first_stage, self.is_last_stage = is_first_stage, is_last_stage
        self.tokens_seen, self._t0 = 0, time.perf_counter()

    def tokens_per_second(self, reset: bool = True) -> float:
        now = time.perf_counter()
        rate = self.tokens_seen / max(now - self._t0, 1e-9)
        if reset:
            self.tokens_seen, self._t0 = 0, now
        return rate

    def __call__(self, data_iterator, model):
        first, last = self.is_first_stage(), self.is_last_stage()
        if not (first or last):  # middle pipeline stages take their input from the previous stage
            return model(None, None, None), partial(loss_func)
        batch = get_kd_batch(data_iterator, tp_group=self.tp_group, cp_group=self.cp_group, device=self.device)
        batch, packed = self.packing.apply(batch)  # under TE's THD path, [b, s] tensors become [1, b·s]
        self.tokens_seen += batch["tokens"].numel()
        if not last:
            return model(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed), partial(loss_func)
        if "teacher_ids" not in batch:
            if self.config.ce_impl == "megatron":
                per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                                  loss_mask=batch["loss_mask"], packed_seq_params=packed)
                return per_token, partial(ce_loss_func, batch["loss_mask"])
            # the fused op with no teacher: one padded teacher entry per token, KD weight 0
            b, s = batch["tokens"].shape
            no_teacher = torch.full((b, s, 1), -1, dtype=torch.int32, device=batch["tokens"].device)
            context = KDContext(self._ce_config, no_teacher, torch.full((b, s, 1), float("-inf"),
                                                                         device=batch["tokens"].device))
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           loss_mask=batch["loss_mask"], output_processor=kd_output_processor,
                           output_processor_context=context, packed_seq_params=packed)
            return output, fused_ce_loss_func
        context = KDContext(self.config, batch["teacher_ids"], batch["teacher_logprobs"])
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], output_processor=kd_output_processor,
                       output_processor_context=context, packed_seq_params=packed)
        return output, partial(loss_func)
