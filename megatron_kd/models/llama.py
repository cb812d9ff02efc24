"""Llama 3.x and Qwen3 as megatron-core builds them from Megatron-LM flags, and their Hugging Face configs.

Both are dense decoders (RMSNorm, SwiGLU, RoPE, grouped-query attention); Qwen3 adds an RMSNorm
over each head's queries and keys. The architecture lives in Megatron-LM flags
(``examples/llama``); this module maps a parsed flag namespace to the ``transformers`` config that
computes the same function (for export), checks a checkpoint's config against the flags (for
import), and gives the flags that describe a checkpoint (``megatron_flags``). Weights move through
nvidia-modelopt's importer and exporter (``models/hf.py``), which know both layouts.

| Hugging Face                                    | Megatron-LM flag                                    |
|-------------------------------------------------|-----------------------------------------------------|
| ``rms_norm_eps``                                | ``--normalization RMSNorm --norm-epsilon``          |
| ``hidden_act: silu``, gate / up / down          | ``--swiglu``                                        |
| ``attention_bias``, ``mlp_bias`` (both off)     | ``--disable-bias-linear``                           |
| ``num_key_value_heads``, ``head_dim``           | ``--group-query-attention --num-query-groups``, ``--kv-channels`` |
| ``rope_theta``                                  | ``--position-embedding-type rope --rotary-base``    |
| ``rope_type: llama3`` with ``factor`` f         | ``--use-rope-scaling --rope-scaling-factor f``      |
| Qwen3's ``q_norm`` / ``k_norm``                 | ``--qk-layernorm``                                  |
| ``tie_word_embeddings: false``                  | ``--untie-embeddings-and-output-weights``           |

megatron-core fixes the rest of Llama 3's RoPE scaling (low / high frequency factors 1 and 4,
original context 8192; ``RotaryEmbedding._apply_scaling``), which every Llama 3.1-3.3 release
uses; a checkpoint with other values is refused rather than computed differently.
"""

from __future__ import annotations

from megatron_kd.errors import ModelConfigError

# architectures[0] of each model type's config.json (nvidia-modelopt's importer keys on it)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the Llama 3 RoPE scaling values megatron-core hard-codes; only the factor is a flag
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def is_dense_decoder(args) -> bool:
    """Whether the flags describe a Llama-style dense decoder: RMSNorm, SwiGLU, RoPE, no experts."""
    return (getattr(args, "normalization", None) == "RMSNorm" and getattr(args, "swiglu", False)
            and getattr(args, "position_embedding_type", None) == "rope" and not getattr(args, "num_experts", None))


def model_type(args) -> str:
    """The Hugging Face model type the flags describe: Qwen3 normalizes queries and keys, Llama not."""
    return "qwen3" if args.qk_layernorm else "llama"


def dense_hf_config(args, *, vocab_size: int):
    """The ``transformers`` LlamaConfig / Qwen3Config computing what the Megatron model built from
    ``args`` computes. ``vocab_size`` is the tokenizer's (unpadded) vocabulary."""
    from transformers import LlamaConfig, Qwen3Config

    if not is_dense_decoder(args):
        raise ModelConfigError("the model flags are not a Llama / Qwen3 decoder (need --normalization RMSNorm, "
                               "--swiglu, --position-embedding-type rope and no --num-experts)")
    if args.rotary_percent != 1.0 or args.rotary_interleaved:
        raise ModelConfigError(f"--rotary-percent {args.rotary_percent} / --rotary-interleaved: Llama and Qwen3 "
                               f"rotate every channel, halves not interleaved")
    if args.add_qkv_bias and not args.add_bias_linear:
        raise ModelConfigError("--add-qkv-bias: Llama and Qwen3 have no q/k/v-only biases (that is Qwen2)")
    rope = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if args.use_rope_scaling:
        rope.update(rope_type="llama3", factor=float(args.rope_scaling_factor), **LLAMA3_ROPE_FIXED)
    kind = model_type(args)
    common = dict(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        head_dim=args.kv_channels, hidden_act="silu", rms_norm_eps=args.layernorm_epsilon,
        max_position_embeddings=args.max_position_embeddings, rope_parameters=rope,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights, attention_bias=args.add_bias_linear,
        architectures=[ARCHITECTURES[kind]],
    )
    if kind == "qwen3":
        if args.use_rope_scaling:
            raise ModelConfigError("--use-rope-scaling is Llama 3's RoPE scaling; Qwen3 (--qk-layernorm) has none")
        return Qwen3Config(**common, use_sliding_window=False)
    return LlamaConfig(**common, mlp_bias=args.add_bias_linear)


# Fields a checkpoint and the flags must agree on (num_hidden_layers may be smaller in the student:
# it then starts from the first layers of the checkpoint).
_MATCHED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_bias")


def check_dense_hf_config(hf_config, args, *, source: str) -> None:
    """Refuse a Hugging Face Llama / Qwen3 checkpoint whose architecture differs from the flags."""
    theirs_type = getattr(hf_config, "model_type", None)
    if not is_dense_decoder(args):
        raise ModelConfigError(f"{source}/config.json: a {theirs_type} checkpoint needs Llama-style model flags "
                               f"(--normalization RMSNorm --swiglu --position-embedding-type rope, no --num-experts)")
    ours = dense_hf_config(args, vocab_size=hf_config.vocab_size)
    if theirs_type != ours.model_type:
        raise ModelConfigError(f"{source}/config.json: model_type is {theirs_type!r}, the flags describe "
                               f"{ours.model_type!r} ({'with' if args.qk_layernorm else 'without'} --qk-layernorm)")
    fields = _MATCHED_FIELDS + (("mlp_bias",) if ours.model_type == "llama" else ("use_sliding_window",))
    for field in fields:
        theirs = getattr(hf_config, field, None)
        if theirs != getattr(ours, field):
            raise ModelConfigError(f"{source}/config.json: {field} is {theirs!r}, the flags give "
                                   f"{getattr(ours, field)!r}")
    if hf_config.num_hidden_layers < ours.num_hidden_layers:
        raise ModelConfigError(f"{source}/config.json: num_hidden_layers is {hf_config.num_hidden_layers}, "
                               f"--num-layers asks for {ours.num_hidden_layers}")
    theirs_rope = dict(hf_config.rope_parameters)
    if theirs_rope.get("rope_type", "default") != ours.rope_parameters["rope_type"]:
        raise ModelConfigError(f"{source}/config.json: rope_parameters.rope_type is {theirs_rope.get('rope_type')!r}, "
                               f"the flags give {ours.rope_parameters['rope_type']!r} (--use-rope-scaling)")
    for key, value in ours.rope_parameters.items():
        if key != "rope_type" and theirs_rope.get(key) != value:
            raise ModelConfigError(f"{source}/config.json: rope_parameters.{key} is {theirs_rope.get(key)!r}, "
                                   + (f"megatron-core computes Llama 3 scaling with {value!r} only"
                                      if key in LLAMA3_ROPE_FIXED else f"the flags give {value!r}"))


# the sizes hf-flags prints that transformers' config classes would otherwise fill with their own
# defaults (LlamaConfig's: Llama-2-7B's 32 layers of 4096), which describe some other model
REQUIRED_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
_ROPE_TYPES = ("default", "llama3")


def _rope_types(config: dict) -> list[str]:
    """The RoPE types a config.json as written asks for: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (4.x; ``type`` in older files), possibly one dict per attention type."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return [repr(rope)]
    parts = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    return [str(part.get("rope_type") or part.get("type") or "default") for part in parts]


def check_raw_config(config: dict, source: str) -> None:
    """What ``megatron_flags`` needs of a config.json as written, before transformers reads it (and
    fills in defaults, or warns, or asks for remote code): one ``ModelConfigError`` naming ``source``
    (the file) and the field. A Llama / Qwen3 of transformers' own code, its sizes given, default or
    Llama 3 RoPE."""
    if config.get("auto_map"):
        raise ModelConfigError(f"{source}: auto_map names the model's own code ({', '.join(sorted(config['auto_map']))}"
                               f", run only with trust_remote_code); megatron_kd builds transformers' own "
                               f"{', '.join(ARCHITECTURES)} architectures")
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise ModelConfigError(f"{source}: model_type {kind!r}: megatron_kd builds {', '.join(ARCHITECTURES)} (and "
                               f"gpt_oss from examples/gpt_oss)")
    missing = [name for name in REQUIRED_FIELDS if config.get(name) is None]
    if missing:
        raise ModelConfigError(f"{source}: no {', '.join(missing)} (each a positive integer; transformers would put "
                               f"its own defaults in their place, another model's sizes)")
    for name in REQUIRED_FIELDS:
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
    for rope_type in _rope_types(config):
        if rope_type not in _ROPE_TYPES:
            raise ModelConfigError(f"{source}: rope_type {rope_type!r}; megatron_kd builds default and llama3 RoPE "
                                   f"for Llama / Qwen3 (YaRN: GPT-OSS only)")


def megatron_flags(hf_config) -> list[str]:
    """The Megatron-LM model flags that build ``hf_config``'s architecture (Llama or Qwen3), for
    ``--kd-student-hf`` / ``--kd-teacher-hf`` runs; ``check_dense_hf_config`` accepts them."""
    kind = hf_config.model_type
    if kind not in ARCHITECTURES:
        raise ModelConfigError(f"model_type {kind!r}: megatron_kd builds {', '.join(ARCHITECTURES)} (and gpt_oss "
                               f"from examples/gpt_oss)")
    if hf_config.hidden_act != "silu":
        raise ModelConfigError(f"hidden_act is {hf_config.hidden_act!r}; Megatron's --swiglu is silu")
    rope = dict(hf_config.rope_parameters)
    flags = ["--num-layers", str(hf_config.num_hidden_layers), "--hidden-size", str(hf_config.hidden_size),
             "--ffn-hidden-size", str(hf_config.intermediate_size),
             "--num-attention-heads", str(hf_config.num_attention_heads),
             "--group-query-attention", "--num-query-groups", str(hf_config.num_key_value_heads),
             "--kv-channels", str(hf_config.head_dim or hf_config.hidden_size // hf_config.num_attention_heads),
             "--normalization", "RMSNorm", "--norm-epsilon", repr(hf_config.rms_norm_eps), "--swiglu",
             "--position-embedding-type", "rope", "--rotary-base", _integer(rope["rope_theta"], "rope_theta"),
             "--max-position-embeddings", str(hf_config.max_position_embeddings)]
    if rope.get("rope_type", "default") == "llama3":
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{rope['factor']:g}"]
    elif rope.get("rope_type", "default") != "default":
        raise ModelConfigError(f"rope_parameters.rope_type is {rope['rope_type']!r}; megatron_kd builds default and "
                               f"llama3 RoPE for Llama / Qwen3")
    if kind == "qwen3":
        flags.append("--qk-layernorm")
    if not hf_config.attention_bias:
        flags.append("--disable-bias-linear")
    if not hf_config.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def _integer(value, field: str) -> str:
    """Megatron-LM's --rotary-base is an integer flag."""
    if not float(value).is_integer():
        raise ModelConfigError(f"{field} is {value!r}; Megatron-LM's --rotary-base takes an integer")
    return str(int(value))
