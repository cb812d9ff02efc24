"""The documents packed into a micro-batch, as the model's attention and RoPE see them.

Megatron's GPTDataset packs documents back to back into each sample, every document ending with
the EOD token; megatron-core's ``_get_ltor_masks_and_position_ids`` defines the boundaries: a
document ends AT its EOD token and the next one starts right after it. Here a micro-batch's
boundaries are ``Documents.starts``, the position of each token's document's first token (int32
[b, s]: a per-token document id), computed on the device in O(s) from the tokens; no [s, s] mask
is ever built.

- ``PackedDocuments``: the local spec's ``packed_seq_params`` (a megatron-core ``PackedSeqParams``
  with qkv_format "sbhd"). GPTModel hands it to every layer's core attention as is;
  ``CoreAttention`` masks by its ``documents`` on every path (``attention.py``).
- ``install_document_positions``: megatron-core's local spec rotates q and k by sequence index (its
  rope and yarn embeddings take no per-token positions), so a forward pre-hook on the decoder
  replaces the rotary table [s, 1, 1, d] by its rows at each token's position in its document,
  [s, b, 1, d] (``_apply_rotary_pos_emb_bshd`` broadcasts that over the heads).

Which flags ask for what, and Transformer Engine's THD path, are the training layer's
(``megatron_kd.megatron.packing``); this module is what the model needs of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_kd.ops.kl.value_checks import HostCopy


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
