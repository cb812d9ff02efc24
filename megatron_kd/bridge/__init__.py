"""Offline KD inside Megatron-Bridge: a Bridge recipe distilled from a megatron_kd teacher cache.

A recipe's ``ConfigContainer`` gets a ``kd`` block and Bridge's ``pretrain`` / ``finetune`` get the
KD forward step; every other field of the recipe stays Bridge's::

    from megatron.bridge.recipes.gpt_oss import gpt_oss_20b_pretrain_config
    from megatron_kd.bridge import KDConfig, pretrain, with_kd

    cfg = gpt_oss_20b_pretrain_config()
    cfg.dataset.data_path = "/data/corpus"        # the data the cache was built from
    pretrain(with_kd(cfg, KDConfig(cache="/data/cache", ce_weight=0.1)))

Modules, one concern each:

- ``compat``: which megatron-bridge (an extra: ``pip install 'megatron_kd[bridge]'``), checked before
  Bridge is imported; megatron-core's prebuilt dataset helpers for Bridge's start-up;
- ``config``: ``KDConfigContainer`` / ``with_kd``, the ``kd`` block (``KDConfig``, the ``--kd-*`` flags
  of ``megatron-kd train``);
- ``data``: Bridge's training samples found in the cache by their tokens (``KDDataset``), the batch
  function that carries them to the loss;
- ``step``: ``BridgeKDForwardStep`` (``KDForwardStep``: the fused loss through GPTModel's
  ``output_processor``), ``pretrain`` / ``finetune``;
- ``model``: ``use_local_spec``, the student on megatron_kd's local spec where Transformer Engine is
  absent;
- ``flags``: the Megatron-LM data flags of a Bridge config, for ``megatron-kd cache build``;
- ``cli``: ``python -m megatron_kd.bridge pretrain | finetune | data-flags RECIPE``.

This package imports nothing of Bridge until one of the names below is used: a missing or
unsupported megatron-bridge is then one ``BridgeError`` line (``compat.require_bridge``).
"""

from __future__ import annotations

# public name -> the module that defines it (each imports megatron.bridge)
_EXPORTS = {
    "KDConfigContainer": "config", "with_kd": "config", "BridgeKDForwardStep": "step", "pretrain": "step",
    "finetune": "step", "use_local_spec": "model", "megatron_data_flags": "flags",
}

__all__ = ["KDConfig", *_EXPORTS]


def __getattr__(name: str):
    if name == "KDConfig":
        from megatron_kd.megatron.args import KDConfig

        return KDConfig
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron_kd.bridge.compat import import_bridge_module

    return getattr(import_bridge_module(f"{__name__}.{_EXPORTS[name]}"), name)
