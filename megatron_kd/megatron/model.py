"""GPT models for teachers and students: megatron-core's GPTModel with the right layer spec.

With Transformer Engine importable the TE layer spec is used (what Megatron-LM recipes train with);
without it, megatron-core's local spec with ``SDPADotProductAttention`` as core attention, so long
contexts (torch's flash / cuDNN attention) and CPU runs work without TE.
"""

from __future__ import annotations

import importlib.util

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(config: TransformerConfig, *, use_te: bool | None = None):
    """The transformer layer spec: TE when available (or asked for), local + SDPA otherwise."""
    use_te = have_transformer_engine() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_kd.megatron.sdpa_attention import SDPADotProductAttention

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


def build_gpt_model(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int,
                    position_embedding_type: str = "rope", share_embeddings_and_output_weights: bool = False,
                    pre_process: bool = True, post_process: bool = True, use_te: bool | None = None) -> GPTModel:
    return GPTModel(
        config=config, transformer_layer_spec=gpt_layer_spec(config, use_te=use_te), vocab_size=vocab_size,
        max_sequence_length=max_sequence_length, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
    )
