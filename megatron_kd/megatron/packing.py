"""Packed documents: Megatron-LM's ``--reset-attention-mask`` / ``--reset-position-ids`` in the model.

Megatron's GPTDataset packs documents back to back into each sample, every document ending with
the EOD token. The two flags keep them apart as megatron-core's ``_get_ltor_masks_and_position_ids``
defines it: ``--reset-attention-mask`` stops attention from crossing a document's end,
``--reset-position-ids`` restarts positions there. We never build that function's [s, s] mask (the
dataset is built with ``create_attention_mask=False``): the model side, a micro-batch's boundaries
as ``Documents`` and the local spec's ``PackedDocuments``, is ``megatron_kd.models.documents``.

Where they go (``DocumentPacking.apply`` makes both from a batch; one call per forward):
- local spec (``CoreAttention``): ``PackedDocuments`` (qkv_format "sbhd"), which every layer's
  core attention masks by, and whose per-document positions the decoder's rotary pre-hook
  (``install_document_positions``, installed by ``build_gpt_model``) rotates q and k by.
- Transformer Engine: megatron-core's own packed-sequence path. The micro-batch becomes one row
  of b·s tokens ([1, b·s]: tokens, labels, loss mask, positions, teacher tensors), with
  ``PackedSeqParams(qkv_format="thd", cu_seqlens_q = cu_seqlens_kv = int32 [n + 1] over the
  flattened tokens, max_seqlen_q = max_seqlen_kv = the longest document)``. TE's attention runs
  each document as its own sequence and megatron-core restarts RoPE at every cu_seqlens entry
  (TE's fused THD rope, or its unfused per-sequence loop). TE needs the longest length as a
  Python int: that path waits for the device once per micro-batch, as Megatron-LM's does. THD
  always restarts positions with the documents, so under TE only both flags together are allowed.

Modes (``megatron_kd.cache.meta.PACKING_MODES``: the teacher cache records them): "none"; "documents" (attention kept
apart, positions run on through the sample); "positions" (positions restart, attention crosses:
what Megatron-LM computes with ``--reset-position-ids`` alone); "documents+positions".

``--eod-mask-loss`` needs nothing here: ``train`` passes it to GPTDataset's config, whose loss mask
then zeroes the prediction made at each EOD token (its label is the next document's first token),
as Megatron-LM defines it.

Not supported with packing (``check_packing_flags``, one line each): context parallelism (the
documents would have to be split with the sequence), more than two pipeline stages (middle
stages read no batch to find the boundaries in), and under THD pipeline stages with micro-batches
of more than one sample (the stages exchange [s, b, h] activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_kd.errors import FlagError
from megatron_kd.models.documents import Documents, PackedDocuments
from megatron_kd.models.gpt import have_transformer_engine

FLAGS = {"documents": "--reset-attention-mask", "positions": "--reset-position-ids"}


@dataclass(frozen=True)
class DocumentPacking:
    """How a run treats the documents packed into its samples (Megatron-LM's two flags).

    ``eod``: the tokenizer's end-of-document id; ``thd``: the model runs Transformer Engine's
    attention (megatron-core's THD path) instead of the local spec's ``CoreAttention``.
    """

    documents: bool = False
    positions: bool = False
    eod: int | None = None
    thd: bool = False

    def __post_init__(self):
        if self.mode != "none" and self.eod is None:
            raise ValueError("packed documents need the tokenizer's EOD id (eod=)")
        if self.thd and self.mode not in ("none", "documents+positions"):
            raise FlagError(f"{self.flags()} with Transformer Engine: its packed-sequence (THD) path keeps documents "
                            f"apart and restarts positions together; pass both --reset-attention-mask and "
                            f"--reset-position-ids, or --transformer-impl local")

    @classmethod
    def from_args(cls, args, *, eod: int | None) -> DocumentPacking:
        """The packing Megatron-LM's flags in ``args`` ask for; ``eod``: the tokenizer's EOD id."""
        # the layer spec gpt_model_from_args builds
        thd = args.transformer_impl == "transformer_engine" and have_transformer_engine()
        return cls(documents=bool(args.reset_attention_mask), positions=bool(args.reset_position_ids), eod=eod,
                   thd=thd)

    @property
    def mode(self) -> str:
        """One of the cache's ``PACKING_MODES``."""
        names = [name for name in ("documents", "positions") if getattr(self, name)]
        return "+".join(names) or "none"

    def flags(self) -> str:
        """The Megatron-LM flags that ask for this mode ("no packing flags" for "none")."""
        return " ".join(FLAGS[name] for name in ("documents", "positions") if getattr(self, name)) \
            or "no packing flags"

    def describe(self) -> str:
        return f"'{self.mode}' ({self.flags()})"

    def documents_of(self, tokens: torch.Tensor) -> Documents:
        return Documents.from_tokens(tokens, self.eod)

    def apply(self, batch: dict) -> tuple[dict, PackedSeqParams | None]:
        """(batch, packed_seq_params) for ``GPTModel.forward``: the batch as is and None without
        packing; for the local spec the batch (its "position_ids" per document when positions
        restart: what learned absolute embeddings read) and ``PackedDocuments``; under THD every
        [b, s, ...] tensor of the batch as [1, b·s, ...] (positions per document) and THD params."""
        if self.mode == "none":
            return batch, None
        tokens = batch["tokens"]
        b, s = tokens.shape
        documents = self.documents_of(tokens)
        if not self.thd:
            if self.positions:
                batch = {**batch, "position_ids": documents.positions}
            return batch, PackedDocuments(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s,
                                          documents=documents if self.documents else None,
                                          position_ids=documents.positions if self.positions else None)
        cu_seqlens, longest = documents.varlen()
        flat = {key: value.reshape(1, b * s, *value.shape[2:])
                if torch.is_tensor(value) and tuple(value.shape[:2]) == (b, s) else value
                for key, value in batch.items()}
        flat["position_ids"] = documents.positions.reshape(1, b * s)
        return flat, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                     max_seqlen_q=longest, max_seqlen_kv=longest)


def check_packing_flags(args) -> None:
    """Parsed Megatron-LM flags that packed documents cannot run with: one ``FlagError`` line."""
    packing = DocumentPacking.from_args(args, eod=0)  # refuses THD with one flag alone
    if packing.mode == "none":
        return
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        raise FlagError(f"{packing.flags()} with --context-parallel-size {cp}: packed documents are not split for "
                        f"context parallelism; use --context-parallel-size 1")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 2:
        raise FlagError(f"{packing.flags()} with --pipeline-model-parallel-size {pp}: middle pipeline stages read no "
                        f"batch to find the document boundaries in; use at most 2 pipeline stages")
    mbs = getattr(args, "micro_batch_size", 1) or 1
    if packing.thd and pp > 1 and mbs > 1:
        raise FlagError(f"{packing.flags()} with Transformer Engine, --pipeline-model-parallel-size {pp} and "
                        f"--micro-batch-size {mbs}: pipeline stages exchange [s, b, h] activations, THD's are "
                        f"[b·s, 1, h]; use --micro-batch-size 1")
    if packing.positions and not packing.thd and getattr(args, "position_embedding_type", "rope") == "rope" \
            and getattr(args, "apply_rope_fusion", False):
        raise FlagError(f"{packing.flags()} with rope fusion: the local spec restarts positions through "
                        f"megatron-core's unfused RoPE; pass --no-rope-fusion")
