"""GPT-OSS as megatron-core builds it from Megatron-LM flags, and its Hugging Face config.

The architecture lives in Megatron-LM flags (``examples/gpt_oss/gpt_oss_{20b,120b}.sh``); this
module maps a parsed flag namespace to the ``transformers.GptOssConfig`` that computes the same
function (for export) and checks a published config against the flags (for import). The mapping,
with megatron-core 0.19's conventions:

| GPT-OSS                                   | Megatron-LM flag                                         |
|-------------------------------------------|----------------------------------------------------------|
| sliding window of W keys, current included | ``--window-size W-1,0`` (Megatron's (w, 0) spans w + 1)  |
| window on even 0-based layers             | ``--window-attn-skip-freq 2`` (1-based odd layers)        |
| one learnable sink per head               | ``--softmax-type learnable`` (``softmax_offset``)         |
| YaRN θ, factor, original length, β, no truncation | ``--position-embedding-type yarn --rotary-base θ --rotary-scaling-factor f --yarn-original-max-position-embeddings n --yarn-beta-fast --yarn-beta-slow --no-yarn-correction-range-round-to-int`` |
| attention scaling 0.1·ln f + 1            | ``--mscale 1 --mscale-all-dim 0`` (Megatron-LM's defaults) |
| SwiGLU: gate ≤ 7, linear ∈ [−7, 7], gate·σ(1.702·gate)·(linear + 1) | ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7`` |
| top-k router, softmax over the chosen k   | ``--moe-router-topk k`` (no ``--moe-router-pre-softmax``) |
| biases on q/k/v/o, router, experts        | Megatron's default ``add_bias_linear``                    |
"""

from __future__ import annotations

from megatron_kd.errors import ModelConfigError


def is_gpt_oss(args) -> bool:
    """Whether the flags describe a GPT-OSS-style model (sinks + clamped quick-GeGLU + MoE)."""
    return (getattr(args, "softmax_type", "vanilla") == "learnable" and getattr(args, "quick_geglu", False)
            and bool(getattr(args, "num_experts", None)))


def gpt_oss_hf_config(args, *, vocab_size: int):
    """The ``transformers.GptOssConfig`` computing what the Megatron model built from ``args`` computes.

    ``vocab_size`` is the tokenizer's (unpadded) vocabulary; Megatron's padded rows are not exported.
    """
    from megatron.core.transformer.utils import is_layer_window_attention
    from transformers import GptOssConfig

    if not is_gpt_oss(args):
        raise ModelConfigError("the model flags are not GPT-OSS (need --softmax-type learnable, --quick-geglu and "
                               "--num-experts); only GPT-OSS students are exported to Hugging Face")
    if args.position_embedding_type != "yarn":
        raise ModelConfigError(f"--position-embedding-type: GPT-OSS uses yarn, got {args.position_embedding_type}")
    if args.activation_func_clamp_value is None:
        raise ModelConfigError("--activation-func-clamp-value: GPT-OSS clamps its SwiGLU (at 7), none is set")
    window = tuple(args.window_size) if args.window_size else None
    if window is not None and window[1] != 0:
        raise ModelConfigError(f"--window-size: GPT-OSS windows look back only, expected W-1,0, got {window}")
    layer_types = ["sliding_attention" if is_layer_window_attention(window, args.window_attn_skip_freq, i + 1)
                   else "full_attention" for i in range(args.num_layers)]
    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        head_dim=args.kv_channels, num_local_experts=args.num_experts, num_experts_per_tok=args.moe_router_topk,
        sliding_window=window[0] + 1 if window else None, layer_types=layer_types,
        rms_norm_eps=args.layernorm_epsilon, max_position_embeddings=args.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": float(args.rotary_base), "factor": float(args.rotary_scaling_factor),
            "original_max_position_embeddings": args.yarn_original_max_position_embeddings or 4096,
            "beta_fast": float(args.yarn_beta_fast or 32.0), "beta_slow": float(args.yarn_beta_slow or 1.0),
            "truncate": bool(args.yarn_correction_range_round_to_int
                             if args.yarn_correction_range_round_to_int is not None else True),
        },
        swiglu_limit=float(args.activation_func_clamp_value),
        tie_word_embeddings=not args.untie_embeddings_and_output_weights, attention_bias=args.add_bias_linear,
        architectures=["GptOssForCausalLM"],
    )


# Fields a checkpoint and the flags must agree on (num_hidden_layers may be smaller in the student:
# it then starts from the first layers of the checkpoint).
_MATCHED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "num_local_experts", "num_experts_per_tok", "sliding_window", "rms_norm_eps", "swiglu_limit",
                   "tie_word_embeddings", "attention_bias")


def check_hf_config(hf_config, args, *, source: str) -> None:
    """Refuse a Hugging Face GPT-OSS checkpoint whose architecture differs from the flags."""
    if getattr(hf_config, "model_type", None) != "gpt_oss":
        raise ModelConfigError(f"{source}/config.json: model_type is {getattr(hf_config, 'model_type', None)!r}, "
                               f"expected 'gpt_oss'")
    ours = gpt_oss_hf_config(args, vocab_size=hf_config.vocab_size)
    for field in _MATCHED_FIELDS:
        # transformers < 5.2x hard-codes the SwiGLU limit (7) instead of reading it from the config
        theirs = getattr(hf_config, field, 7.0 if field == "swiglu_limit" else None)
        if theirs != getattr(ours, field):
            raise ModelConfigError(f"{source}/config.json: {field} is {theirs!r}, the flags give {getattr(ours, field)!r}")
    if hf_config.num_hidden_layers < ours.num_hidden_layers:
        raise ModelConfigError(f"{source}/config.json: num_hidden_layers is {hf_config.num_hidden_layers}, "
                               f"--num-layers asks for {ours.num_hidden_layers}")
    if hf_config.layer_types[:ours.num_hidden_layers] != ours.layer_types:
        raise ModelConfigError(f"{source}/config.json: layer_types {hf_config.layer_types[:4]}... differ from "
                               f"--window-size/--window-attn-skip-freq {ours.layer_types[:4]}...")
    theirs_rope, our_rope = dict(hf_config.rope_parameters), ours.rope_parameters
    for key, value in our_rope.items():
        if theirs_rope.get(key, True if key == "truncate" else None) != value:
            raise ModelConfigError(f"{source}/config.json: rope_parameters.{key} is {theirs_rope.get(key)!r}, the "
                                   f"flags give {value!r}")
