"""Packed documents: Megatron-LM's ``--reset-attention-mask`` / ``--reset-position-ids`` in the model.

Megatron's GPTDataset packs documents back to back into each sample, every document ending with
the EOD token. The two flags keep them apart as megatron-core's ``_get_ltor_masks_and_position_ids``
defines it: a document ends AT its EOD token and the next one starts right after it;
``--reset-attention-mask`` stops attention from crossing that boundary, ``--reset-position-ids``
restarts positions there. We never build that function's [s, s] mask (the dataset is built with
``create_attention_mask=False``). A micro-batch's boundaries are carried as ``Documents.starts``,
the position of each token's document's first token (int32 [b, s]: a per-token document id),
computed on the device in O(s) from the tokens.

Where they go (``DocumentPacking.apply`` makes both from a batch; one call per forward):
- local spec (``CoreAttention``): ``PackedDocuments``, a megatron-core ``PackedSeqParams`` with
  qkv_format "sbhd". GPTModel hands ``packed_seq_params`` to every layer's core attention as is;
  ``core_attention(..., documents=)`` masks by document on every path (attention.py). RoPE / YaRN:
  megatron-core's local spec rotates q and k by sequence index (its rope and yarn embeddings take
  no per-token positions), so ``install_document_positions`` puts a forward pre-hook on the
  decoder that replaces the rotary table [s, 1, 1, d] by its rows at each token's position in
  its document, [s, b, 1, d] (``_apply_rotary_pos_emb_bshd`` broadcasts that over the heads).
- Transformer Engine: megatron-core's own packed-sequence path. The micro-batch becomes one row
  of b·s tokens ([1, b·s]: tokens, labels, loss mask, positions, teacher tensors), with
  ``PackedSeqParams(qkv_format="thd", cu_seqlens_q = cu_seqlens_kv = int32 [n + 1] over the
  flattened tokens, max_seqlen_q = max_seqlen_kv = the longest document)``. TE's attention runs
  each document as its own sequence and megatron-core restarts RoPE at every cu_seqlens entry
  (TE's fused THD rope, or its unfused per-sequence loop). TE needs the longest length as a
  Python int: that path waits for the device once per micro-batch, as Megatron-LM's does. THD
  always restarts positions with the documents, so under TE only both flags together are allowed.

Modes (``PACKING_MODES``; recorded in the teacher cache): "none"; "documents" (attention kept
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

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_kd.errors import FlagError
from megatron_kd.ops.value_checks import HostCopy

PACKING_MODES = ("none", "documents", "positions", "documents+positions")
FLAGS = {"documents": "--reset-attention-mask", "positions": "--reset-position-ids"}


def document_starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """int32 [b, s]: for each token, the position of its document's first token. A document ends
    at its EOD token (included); the token after an EOD, and the first token of a sample, begin one."""
    b, s = tokens.shape
    begins = torch.ones_like(tokens, dtype=torch.bool)
    begins[:, 1:] = tokens[:, :-1] == eod
    index = torch.arange(s, dtype=torch.int32, device=tokens.device).expand(b, s)
    return torch.where(begins, index, 0).cummax(dim=1).values


class Documents:
    """The documents of one micro-batch: ``starts`` int32 [b, s] (``document_starts``) and what
    the attention paths derive from it, each computed once (``memo``) and shared by the layers.

    ``varlen()`` gives the variable-length form of the flattened micro-batch (b·s tokens, sample
    after sample): cu_seqlens int32 [n + 1] and the longest document. Its count and maximum are
    queued for the host when the object is made (``HostCopy``), so reading them later waits for
    that copy alone, not for the layers queued in between.
    """

    def __init__(self, starts: torch.Tensor):
        if starts.dim() != 2 or starts.dtype != torch.int32:
            raise ValueError(f"document starts are int32 [b, s], got {starts.dtype} {tuple(starts.shape)}")
        self.starts = starts
        b, s = starts.shape
        self.positions = torch.arange(s, device=starts.device).expand(b, s) - starts  # int64 [b, s]
        begun = (self.positions == 0).flatten().cumsum(0)  # documents begun up to each flattened token
        # entry i < n: the first token of document i (the first token at which i + 1 have begun);
        # entries n .. b·s: b·s, so [:n + 1] is cu_seqlens once n is known on the host
        self._cu_seqlens = torch.searchsorted(
            begun, torch.arange(1, b * s + 2, device=starts.device)).to(torch.int32)
        self._counts = HostCopy(torch.stack([begun[-1], self.positions.max() + 1]))
        self._memo = {}

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eod: int) -> Documents:
        return cls(document_starts(tokens, eod))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.starts.shape)

    def memo(self, key, build):
        """``build()`` the first time ``key`` is asked for, the same object afterwards."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def varlen(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens int32 [n + 1] over the flattened b·s tokens, longest document length)."""
        def build():
            count, longest = (int(x) for x in self._counts.get().tolist())
            return self._cu_seqlens[:count + 1], longest

        return self.memo("varlen", build)


@dataclass
class PackedDocuments(PackedSeqParams):
    """``packed_seq_params`` for the local spec: tokens stay [b, s] (qkv_format "sbhd").

    ``documents``: attention stays within each document (None: it crosses them);
    ``position_ids`` int64 [b, s]: RoPE / YaRN positions (None: the sequence index).
    ``max_seqlen_q`` / ``max_seqlen_kv`` hold s: megatron-core sizes the rotary table by them.
    """

    documents: Documents | None = None
    position_ids: torch.Tensor | None = field(default=None, repr=False)

    def rotary_at_positions(self, table: torch.Tensor) -> torch.Tensor:
        """The rotary table [S, 1, 1, d] at each token's position: [s, b, 1, d]."""
        if table.dim() != 4 or table.shape[1:3] != (1, 1):
            raise ValueError(f"per-document positions need a rotary table [S, 1, 1, d], got {tuple(table.shape)}")
        return table[:, 0, 0][self.position_ids.t()].unsqueeze(2)


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
        from megatron_kd.models.gpt import have_transformer_engine

        # the layer spec gpt_model_from_args builds
        thd = args.transformer_impl == "transformer_engine" and have_transformer_engine()
        return cls(documents=bool(args.reset_attention_mask), positions=bool(args.reset_position_ids), eod=eod,
                   thd=thd)

    @property
    def mode(self) -> str:
        """One of ``PACKING_MODES``."""
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


# --------------------------------------------------------------------------------- RoPE positions
def _document_rotary(decoder, args, kwargs):
    """Forward pre-hook of GPTModel's decoder: the rotary table at per-document positions."""
    params, table = kwargs.get("packed_seq_params"), kwargs.get("rotary_pos_emb")
    if not isinstance(params, PackedDocuments) or params.position_ids is None or table is None:
        return None
    if decoder.config.apply_rope_fusion:
        raise ValueError("per-document positions go through megatron-core's unfused RoPE: pass --no-rope-fusion")
    kwargs["rotary_pos_emb"] = params.rotary_at_positions(table)
    return args, kwargs


def install_document_positions(model) -> None:
    """Let ``model`` (a local-spec GPTModel) rotate q and k by ``PackedDocuments.position_ids``
    (see the module docstring); safe to call twice."""
    decoder = model.decoder
    if getattr(decoder, "_document_positions_hook", None) is None:
        decoder._document_positions_hook = decoder.register_forward_pre_hook(_document_rotary, with_kwargs=True)
