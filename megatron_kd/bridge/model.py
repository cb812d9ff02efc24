"""A Bridge recipe's student on megatron_kd's local spec: the model ``megatron-kd train`` builds
where Transformer Engine is absent.

Bridge's GPT providers build megatron-core's GPTModel from the provider's ``transformer_layer_spec``,
Transformer Engine's in every GPT-OSS and Llama recipe. ``use_local_spec(provider)`` swaps in the
spec ``megatron_kd.models.gpt.build_gpt_model`` builds without TE (megatron-core's local layers with
megatron_kd's ``CoreAttention``: sliding windows and sinks; its grouped-GEMM experts) and what that
function adds around it: ``correct_config`` when the spec is built, and, before Bridge wraps the model
(a pre-wrap hook), the packed documents' rotary positions on each model chunk and the CUDA kernels for
RoPE and the MoE permutation. The provider's other fields, the recipe's, stay as they are; with TE
installed the recipe's own spec is the one to keep.
"""

from __future__ import annotations


def local_layer_spec(config, vp_stage: int | None = None):
    """``transformer_layer_spec`` for a Bridge provider (Bridge calls it with the provider itself)."""
    from megatron_kd.models.gpt import correct_config, gpt_layer_spec

    return gpt_layer_spec(correct_config(config), use_te=False)


def _local_model_hooks(model_chunks: list) -> list:
    """What ``build_gpt_model`` installs on a local-spec GPTModel, for Bridge's model chunks."""
    from megatron_kd.models.gpt import install_local_spec_extras

    for chunk in model_chunks:
        install_local_spec_extras(chunk)
    return model_chunks


def use_local_spec(provider) -> None:
    """Build ``provider``'s GPTModel on megatron_kd's local spec (module docstring); idempotent. A setting
    only Transformer Engine's layers implement (``megatron-kd train`` refuses the same flags) is one
    ``BridgeError`` line."""
    from megatron_kd.bridge.compat import BridgeError
    from megatron_kd.megatron.flags import TRANSFORMER_ENGINE_FLAGS

    given = [f"cfg.model.{field} = {getattr(provider, field)!r}" for field in TRANSFORMER_ENGINE_FLAGS
             if getattr(provider, field, None)]
    if given:
        raise BridgeError(f"{', '.join(given)}: only Transformer Engine's layers implement "
                          f"{'it' if len(given) == 1 else 'them'} and the local spec is megatron-core's: turn "
                          f"{'it' if len(given) == 1 else 'them'} off (False / None) to build the local spec")
    if provider.transformer_layer_spec is local_layer_spec:
        return
    provider.transformer_layer_spec = local_layer_spec
    provider.transformer_impl = "local"
    provider.register_pre_wrap_hook(_local_model_hooks)
