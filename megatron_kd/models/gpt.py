"""GPT models for teachers and students: megatron-core's GPTModel with the right layer spec.

With Transformer Engine importable the TE layer spec is used (what Megatron-LM recipes train with);
without it, megatron-core's local spec with our ``CoreAttention`` (``attention.py``: FlashAttention-4 /
flex / cuDNN attention with sliding windows and sinks), ``GroupedGemmExperts`` (``experts.py``),
RoPE / YaRN in one kernel per direction (``rope.py``) and the MoE permutation's sums as gathers
(``moe_permutation.py``), so long contexts, GPT-OSS and CPU runs work without TE.

``gpt_model_from_args`` is what ``megatron-kd train``, ``cache build`` and ``export-hf`` build:
the model Megatron-LM's ``pretrain_gpt`` builds from the same flags (rotary / YaRN settings
included), with megatron-core's known numerical traps for GPT-OSS-style models corrected
(``correct_config``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

logger = logging.getLogger(__name__)


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def correct_config(config: TransformerConfig) -> TransformerConfig:
    """Fix settings for which megatron-core 0.19 computes something other than the flags say.

    The fused bias + gated-activation kernel clamps the pre-activation *before* adding the fc1
    bias; GPT-OSS (``--activation-func-clamp-value``) clamps after it, as the unfused path does.
    """
    if config.activation_func_clamp_value is not None and config.bias_activation_fusion:
        logger.warning("megatron_kd: bias-activation fusion disabled: with --activation-func-clamp-value "
                       "megatron-core's fused kernel clamps before adding the bias (the unfused path is exact)")
        config.bias_activation_fusion = False
    return config


def gpt_layer_spec(config: TransformerConfig, *, use_te: bool | None = None):
    """The transformer layer spec: TE when available (or asked for), local + CoreAttention otherwise."""
    use_te = have_transformer_engine() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_kd.models.attention import CoreAttention
    from megatron_kd.models.experts import ExpertRowParallelLinear, GroupedGemmExperts

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = CoreAttention
    if config.num_moe_experts:
        moe = spec.submodules.mlp.keywords["submodules"]
        experts = moe.experts.keywords["submodules"]
        experts.linear_fc2 = ExpertRowParallelLinear
        moe.experts = functools.partial(GroupedGemmExperts, submodules=experts)
    return spec


def build_gpt_model(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int,
                    position_embedding_type: str = "rope", rotary_base: float = 10000, rotary_percent: float = 1.0,
                    seq_len_interpolation_factor: float | None = None, rope_scaling: bool = False,
                    rope_scaling_factor: float = 8.0, share_embeddings_and_output_weights: bool = False,
                    pre_process: bool = True, post_process: bool = True, use_te: bool | None = None, vp_stage: int | None = None) -> GPTModel:
    config = correct_config(config)
    use_te = have_transformer_engine() if use_te is None else use_te
    model = GPTModel(
        config=config, transformer_layer_spec=gpt_layer_spec(config, use_te=use_te), vocab_size=vocab_size,
        max_sequence_length=max_sequence_length, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type, rotary_base=rotary_base, rotary_percent=rotary_percent,
        seq_len_interpolation_factor=seq_len_interpolation_factor, rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor, vp_stage=vp_stage,
    )
    if not use_te:
        install_local_spec_extras(model)
    return model


def install_local_spec_extras(model: GPTModel) -> None:
    """What a GPTModel on the local spec gets besides its layers (``build_gpt_model``, and Bridge's
    providers through ``megatron_kd.bridge``)."""
    from megatron_kd.models.documents import install_document_positions
    from megatron_kd.models.rope import install_fused_rope

    # the local spec rotates by sequence index: packed documents bring their own positions
    install_document_positions(model)
    install_fused_rope()  # q and k rotated in one kernel per direction on CUDA (rope.py)
    if model.config.num_moe_experts:
        from megatron_kd.models.moe_permutation import install_moe_permutation

        install_moe_permutation()  # the token permutation's sums as gathers on CUDA (moe_permutation.py)


def gpt_model_from_args(args, config: TransformerConfig | None = None, *, pre_process: bool = True,
                        post_process: bool = True, vp_stage: int | None = None) -> GPTModel:
    """The GPTModel that Megatron-LM's flags (``args``) describe; ``config`` defaults to theirs."""
    if config is None:
        from megatron.training.argument_utils import core_transformer_config_from_args

        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine" and have_transformer_engine()
    return build_gpt_model(
        config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        pre_process=pre_process, post_process=post_process, use_te=use_te, vp_stage=vp_stage,
    )
