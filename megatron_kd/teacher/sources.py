"""Teachers: a model that maps token ids to final hidden states plus its output projection.

Both adapters return ``(hidden [s, b, h] over the full sequence, weight [V_local, h])`` so the
top-K is taken chunk by chunk from hidden states (``ops.topk``), never from full logits.
"""

from __future__ import annotations

import torch

from megatron_kd.ops.comm import gather_first_dim
from megatron_kd.teacher.fingerprint import module_fingerprint


def _hidden_and_weight(hidden_states, output_layer, output_weight, **_):
    # GPTModel's output_processor hook: stop before the output layer, hand back what it would use
    # (the output layer's weight shard, or the shared embedding when weights are tied).
    return hidden_states, output_layer.weight if output_weight is None else output_weight


class MegatronTeacher:
    """A megatron-core GPTModel (this rank's TP shard; the last pipeline stage)."""

    def __init__(self, model, *, tp_group=None, sequence_parallel: bool = False, vocab_size: int | None = None,
                 fingerprint: str = ""):
        self.model = model
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor):
        hidden, weight = self.model(tokens, position_ids, None, output_processor=_hidden_and_weight)
        if self.sequence_parallel:
            hidden = gather_first_dim(hidden, self.tp_group)
        return hidden, weight


class HFTeacher:
    """A Hugging Face transformers causal LM whose logits are ``lm_head(final hidden states)``.

    ``fingerprint``: the digest of the files it was loaded from (``fingerprint.hf_fingerprint``);
    without one, the digest of the model's tensors."""

    def __init__(self, model, *, fingerprint: str | None = None):
        self.model = model.eval()
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            raise ValueError(f"HF teacher: the output layer must be a bias-free nn.Linear, got {head!r}")
        self.head = head
        self.tp_group = None
        self.vocab_size = int(model.config.vocab_size)
        self.fingerprint = fingerprint or module_fingerprint(model)
        self._checked = False

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None):
        hidden = self.model.base_model(input_ids=tokens).last_hidden_state  # [b, s, h], final norm applied
        if not self._checked:
            # Models that scale or soft-cap logits after lm_head would be cached wrongly: refuse them.
            logits = self.model(input_ids=tokens[:1]).logits[0].float()
            ours = (hidden[0] @ self.head.weight.t()).float()
            err = (logits - ours).norm() / logits.norm().clamp_min(1e-30)
            if err > 1e-3:
                raise ValueError(f"HF teacher: logits differ from lm_head(last hidden state) by {err:.2e} "
                                 f"(logit scaling or soft-capping?); this model is not supported")
            self._checked = True
        return hidden.transpose(0, 1), self.head.weight
