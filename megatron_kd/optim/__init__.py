"""Optimizer state small enough for a full-size GPT-OSS-120B student on one 8-GPU node.

- ``adam.py``: ``Bf16Adam``, Adam(W) on bf16 parameters with no fp32 master copy (stochastic
  rounding) and 8-bit blockwise moments: ~2 bytes of state per parameter instead of 12.
- ``quantize.py``: the 8-bit moment format; ``rounding.py``: stochastic rounding to bf16 with
  position-keyed random bits (nothing to checkpoint, the same under any data-parallel sharding).
- ``megatron.py``: the ``--kd-optimizer`` choices, the Megatron-LM flags each implies, the opt-in
  patch that makes megatron-core's optimizer construction build ``Bf16Adam`` where it would build
  Transformer Engine's FusedAdam (so its distributed optimizer shards it and its checkpoints hold it),
  and the bytes per parameter the memory plan counts.
"""

from megatron_kd.optim.adam import Bf16Adam

__all__ = ["Bf16Adam"]
