"""The ``kd`` block of a Bridge ``ConfigContainer``: how a Bridge recipe becomes an offline-KD run.

``with_kd(cfg, kd)`` returns the recipe's container as a ``KDConfigContainer``: every field the
recipe set, the same objects, plus ``kd``, megatron_kd's ``KDConfig`` (the teacher cache and the
loss: what ``megatron-kd train``'s ``--kd-*`` flags set). Bridge handles it as any ConfigContainer
(its validation, the run config it logs, where ``kd`` is one more dataclass); the forward step
(``step.py``) reads ``state.cfg.kd``.

It also refuses what the adapter cannot distill, in one line, before Bridge starts: a dataset that is
not a Megatron GPT dataset (the cache holds windows of ``GPTDatasetConfig`` data: an indexed dataset
from ``megatron-kd data text`` / ``data chat`` or Megatron-LM's preprocessing; mock data has no
files a cache could have been built from), and a ``KDConfig`` without a cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.bridge.training.config import ConfigContainer, GPTDatasetConfig

from megatron_kd.bridge.compat import BridgeError, use_prebuilt_dataset_helpers
from megatron_kd.megatron.args import KDConfig


@dataclass(kw_only=True)
class KDConfigContainer(ConfigContainer):
    """Bridge's ConfigContainer with megatron_kd's distillation settings."""

    kd: KDConfig
    """The teacher cache (``kd.cache``) and the loss: weight, CE weight, temperature, tail,
    divergence, chunk size, implementation (``megatron_kd.megatron.args.KDConfig``)."""


def check_distillable(cfg: ConfigContainer, kd: KDConfig) -> None:
    """One ``BridgeError`` line for a run the cache cannot serve (module docstring)."""
    if not kd.cache:
        raise BridgeError("KDConfig.cache is not set: give the teacher cache to distill from "
                          "(KDConfig(cache=PATH), --kd-cache PATH)")
    dataset = cfg.dataset
    if not isinstance(dataset, GPTDatasetConfig):
        raise BridgeError(f"cfg.dataset is a {type(dataset).__name__}: the teacher cache holds windows of Megatron GPT "
                          f"datasets; use a GPTDatasetConfig over an indexed dataset (megatron-kd data text / "
                          f"data chat)")
    if dataset.mock or (dataset.blend is None and dataset.blend_per_split is None and not dataset.data_path):
        raise BridgeError("cfg.dataset is mock data (no blend, blend_per_split or data_path): the teacher cache holds "
                          "windows of an indexed dataset; set cfg.dataset.data_path (or blend) to the data the cache "
                          "was built from")


def with_kd(cfg: ConfigContainer, kd: KDConfig) -> KDConfigContainer:
    """``cfg`` (a Bridge recipe's ConfigContainer) with ``kd`` added, its own fields untouched."""
    check_distillable(cfg, kd)
    use_prebuilt_dataset_helpers()  # before Bridge's initialize_megatron runs
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init and f.name != "kd"}
    out = KDConfigContainer(**fields, kd=kd)
    for f in dataclasses.fields(cfg):
        if not f.init:  # Bridge's own run state (finetune sets _checkpoint_load_required)
            setattr(out, f.name, getattr(cfg, f.name))
    return out
