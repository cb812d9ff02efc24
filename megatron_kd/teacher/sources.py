"""Teachers: a model that maps token ids to final hidden states plus its output projection.

Both adapters return ``(hidden [s, b, h] over the full sequence, weight [V_local, h])`` so the
top-K is taken chunk by chunk from hidden states (``ops.teacher.topk``), never from full logits.
"""

from __future__ import annotations

import torch

from megatron_kd.cache import CacheError
from megatron_kd.megatron.packing import DocumentPacking
from megatron_kd.ops.comm import gather_first_dim
from megatron_kd.teacher.fingerprint import module_fingerprint

LOGITS_CHECK_TOKENS = 1024  # HFTeacher's check of its logits against lm_head(hidden states)


def _hidden_and_weight(hidden_states, output_layer, output_weight, **_):
    # GPTModel's output_processor hook: stop before the output layer, hand back what it would use
    # (the output layer's weight shard, or the shared embedding when weights are tied).
    return hidden_states, output_layer.weight if output_weight is None else output_weight


class MegatronTeacher:
    """A megatron-core GPTModel (this rank's TP shard; the last pipeline stage). ``packing``: the
    documents of a sample kept apart as the student keeps them (packing.py)."""

    def __init__(self, model, *, tp_group=None, sequence_parallel: bool = False, vocab_size: int | None = None,
                 fingerprint: str = "", packing: DocumentPacking | None = None):
        self.model = model
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.packing = packing or DocumentPacking()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor):
        b, s = tokens.shape
        batch, packed = self.packing.apply({"tokens": tokens, "position_ids": position_ids})
        hidden, weight = self.model(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed,
                                    output_processor=_hidden_and_weight)
        if self.sequence_parallel:
            hidden = gather_first_dim(hidden, self.tp_group)
        if packed is not None and packed.qkv_format == "thd":  # one row of b·s tokens: [b·s, 1, h] -> [s, b, h]
            hidden = hidden.view(b, s, hidden.shape[-1]).transpose(0, 1)
        return hidden, weight


class HFTeacher:
    """A Hugging Face transformers causal LM whose logits are ``lm_head(final hidden states)``.

    ``fingerprint``: the digest of the files it was loaded from (``fingerprint.hf_fingerprint``);
    without one, the digest of the model's tensors. ``packing``: with documents kept apart and
    positions restarted, the model gets the per-document positions and no cache; the masks of
    transformers models that hand position_ids to ``masking_utils`` then keep the documents apart
    (``find_packed_sequence_indices``: a position that is not the previous one plus 1 starts a
    sequence). Not every model does (transformers 5.24's GptOssModel does not), so the first
    micro-batch with a document after a sample's first is checked: the tokens from that document
    on, run alone, must get the hidden states they got in the sample. transformers has no way to
    keep documents apart without restarting positions or the reverse: one flag alone is refused."""

    def __init__(self, model, *, fingerprint: str | None = None, packing: DocumentPacking | None = None):
        self.packing = packing or DocumentPacking()
        if self.packing.mode not in ("none", "documents+positions"):
            raise CacheError(f"--kd-teacher-hf with {self.packing.flags()}: a Hugging Face teacher keeps documents "
                             f"apart only with their positions restarted; pass both --reset-attention-mask and "
                             f"--reset-position-ids, or neither")
        self.model = model.eval()
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            raise ValueError(f"HF teacher: the output layer must be a bias-free nn.Linear, got {head!r}")
        self.head = head
        self.tp_group = None
        self.vocab_size = int(model.config.vocab_size)
        self.fingerprint = fingerprint or module_fingerprint(model)
        self._checked = False
        self._packing_checked = self.packing.mode == "none"

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None):
        packed = {}
        if self.packing.mode != "none":
            packed = {"position_ids": self.packing.documents_of(tokens).positions, "use_cache": False}
        hidden = self.model.base_model(input_ids=tokens, **packed).last_hidden_state  # [b, s, h], final norm applied
        if not self._checked:
            # Models that scale or soft-cap logits after lm_head would be cached wrongly: refuse them. On
            # the first sample's first tokens, since the logits of a whole long sample do not fit (128K x
            # 128,256 in fp32: 63 GiB), and both from one forward of them: hidden states of the whole
            # sample differ from the short run's by bf16 rounding (other kernels), not by the model
            n = min(tokens.shape[1], LOGITS_CHECK_TOKENS)
            first = {key: value[:1, :n] if torch.is_tensor(value) else value for key, value in packed.items()}
            logits = self.model(input_ids=tokens[:1, :n], **first).logits[0].float()
            short = self.model.base_model(input_ids=tokens[:1, :n], **first).last_hidden_state[0]
            ours = (short @ self.head.weight.t()).float()
            err = (logits - ours).norm() / logits.norm().clamp_min(1e-30)
            if err > 1e-3:
                raise ValueError(f"HF teacher: logits differ from lm_head(last hidden state) by {err:.2e} "
                                 f"(logit scaling or soft-capping?); this model is not supported")
            self._checked = True
        if not self._packing_checked:
            self._check_documents_apart(tokens, packed["position_ids"], hidden)
        return hidden.transpose(0, 1), self.head.weight

    def _check_documents_apart(self, tokens, positions, hidden) -> None:
        later = torch.nonzero(positions[:, 1:] == 0)  # (row, index - 1) of documents after a sample's first
        if not len(later):
            return  # one document per sample: nothing to tell apart yet
        row, start = (int(x) for x in later[0])
        start += 1
        tail = self.model.base_model(input_ids=tokens[row:row + 1, start:], position_ids=positions[row:row + 1, start:],
                                     use_cache=False).last_hidden_state[0].float()
        err = float((tail - hidden[row, start:].float()).norm() / tail.norm().clamp_min(1e-30))
        if err > 5e-2:
            raise CacheError(f"--kd-teacher-hf with --reset-attention-mask: {type(self.model).__name__} lets documents "
                             f"attend to each other (a document run alone differs by {err:.2e}: its masks ignore "
                             f"position_ids); run it without packing, or as a Megatron teacher")
        self._packing_checked = True
