"""Bridge's training samples joined to the teacher cache, and the batch function that carries them.

Bridge builds its datasets itself (``pretrain`` calls the provider registered for ``cfg.dataset``'s
type: for ``GPTDatasetConfig``, megatron-core's GPTDataset through BlendedMegatronDatasetBuilder) and
its DataLoader yields their items collated: tokens, labels, loss mask, positions, nothing that names
a sample (its own batch function keeps only those keys). The cache is keyed by content: each cached
sample records the digest of the tokens its teacher read (``megatron_kd.cache.tokens``). So:

- ``bridge_train_split(cfg)``: Bridge's train split built again by Bridge's own provider with Bridge's
  own sample counts, hence the very windows its DataLoader reads (a GPTDataset is a function of its
  config; the index files Bridge wrote are read back). Collective: megatron-core's builder builds on
  rank 0 first, then every rank after a barrier.
- ``TeacherRows``: that split joined to the cache by ``KDDataset``, with ``megatron-kd train``'s
  start-up check (every sample the run consumes found by its tokens, else one line: "this run needs N
  samples; the cache holds M of them ...") and the chat loss mask joined where the data has one
  (``with_loss_masks``). ``batch`` takes Bridge's micro-batch, names each row by its token digest (the
  run's sample with those tokens: its sample id) and returns those samples as ``KDDataset`` reads them
  (tokens, labels, loss mask, positions, teacher ids and log-probs; the digest checked again),
  collated: the batch ``KDForwardStep`` reads.
- ``WithTeacherRows``: the data iterator handed to ``KDForwardStep``: Bridge's, each micro-batch
  mapped through ``TeacherRows.batch`` when it is read (``get_kd_batch`` reads on tensor-parallel rank
  0 and broadcasts, as in ``megatron-kd train``).

Rows are read on the training thread when the micro-batch is (Bridge's DataLoader workers read
Bridge's own items): one cache read of a sample per trained sample.
"""

from __future__ import annotations

import torch

from megatron_kd.cache.tokens import sample_digest
from megatron_kd.megatron.kd_data import BATCH_KEYS, KDDataError, KDDataset
from megatron_kd.megatron.loss_mask import with_loss_masks
from megatron_kd.megatron.packing import DocumentPacking


def bridge_train_split(cfg):
    """(Bridge's train split, the samples the run consumes) for ``cfg`` as Bridge's ``pretrain`` sizes
    and builds it; needs ``cfg.dataset`` finalized with its tokenizer (Bridge's setup does both)."""
    from megatron.bridge.data.loaders import get_train_valid_test_num_samples
    from megatron.bridge.data.utils import get_dataset_provider

    counts = get_train_valid_test_num_samples(cfg)
    train, _, _ = get_dataset_provider(cfg.dataset)(counts, cfg.dataset)
    return train, counts[0]


def document_packing(cfg) -> DocumentPacking:
    """The packing ``cfg.dataset``'s flags ask for, as ``DocumentPacking.from_args`` reads Megatron-LM's:
    megatron-core's THD path under Transformer Engine's spec, megatron_kd's otherwise."""
    from megatron_kd.models.gpt import have_transformer_engine

    dataset = cfg.dataset
    thd = cfg.model.transformer_impl == "transformer_engine" and have_transformer_engine()
    return DocumentPacking(documents=bool(dataset.reset_attention_mask), positions=bool(dataset.reset_position_ids),
                           eod=dataset.tokenizer.eod, thd=thd)


class TeacherRows:
    """The cache's rows for Bridge's training samples (module docstring)."""

    def __init__(self, train, cache: str, *, tokenizer, required_samples: int, packing: DocumentPacking):
        self.dataset = KDDataset(with_loss_masks(train), cache, tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                                 required_samples=required_samples, packing=packing.mode)
        # each matched cache row's recorded digest is its run sample's: the sample id by content
        entries = self.dataset.reader.token_entries(self.dataset.rows)
        self._sample_of: dict[str, int] = {}
        for sample, entry in enumerate(entries):
            self._sample_of.setdefault(entry[0], sample)

    def sample_of(self, tokens: torch.Tensor) -> int:
        """The run's sample (an index of Bridge's train split) whose tokens ``tokens`` [s] are."""
        sample = self._sample_of.get(sample_digest(tokens))
        if sample is None:
            raise KDDataError(f"--kd-cache {self.dataset.cache_path}: a sample of Bridge's micro-batch (token digest "
                              f"{sample_digest(tokens)}) is none of the {len(self.dataset.rows)} training samples this "
                              f"run was sized and checked for")
        return sample

    def batch(self, bridge_batch: dict) -> dict:
        """Bridge's micro-batch ([b, s] tokens ...) as the same samples with their teacher rows."""
        items = [self.dataset[self.sample_of(tokens)] for tokens in bridge_batch["tokens"]]
        return {key: torch.stack([item[key] for item in items]) for key in BATCH_KEYS}


class WithTeacherRows:
    """Bridge's data iterator with each micro-batch read through ``rows.batch``."""

    def __init__(self, rows: TeacherRows, iterator):
        self.rows, self.iterator = rows, iterator

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.rows.batch(next(self.iterator))
