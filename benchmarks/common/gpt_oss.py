"""The GPT-OSS benchmarks' model: megatron-core's local spec without Transformer Engine, examples/gpt_oss's
20B recipe at a cut depth (bench_gptoss, bench_layer; ``--tiny``: toy sizes for the CPU), and the matmul
FLOPs of a step of such a model or a dense one (bench_gptoss, bench_node).
"""

from __future__ import annotations


# megatron-core without Transformer Engine: the local spec and none of its fused kernels
LOCAL_SPEC_FLAGS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
                    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"]


def model_flags(opts) -> list[str]:
    from tests.fixtures.tiny_gpt_oss import recipe_flags

    flags = [*recipe_flags("20b", layout=False), "--num-layers", str(opts.layers), "--seq-length", str(opts.seq),
             "--micro-batch-size", "1", "--global-batch-size", str(opts.ep), "--train-iters", "10",
             "--expert-model-parallel-size", str(opts.ep), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "201088", *LOCAL_SPEC_FLAGS, "--calculate-per-token-loss", "--bf16", "--lr", "1e-5"]
    if opts.tiny:
        flags += ["--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
                  "--moe-ffn-hidden-size", "48", "--ffn-hidden-size", "48", "--num-experts", "4",
                  "--window-size", "7,0", "--vocab-size", "1000", "--moe-token-dispatcher-type", "allgather",
                  "--use-cpu-initialization", "--max-position-embeddings", "4096"]
    return flags


def mlp_flops_per_token(args) -> float:
    """Forward matmul FLOPs of one layer's MLP per token: the router and the top-k experts (gated:
    three matrices each) of an MoE layer; a dense MLP's three matrices when gated (``--swiglu``),
    else two."""
    h = args.hidden_size
    if args.num_experts:
        return 2 * h * args.num_experts + args.moe_router_topk * 2 * 3 * h * args.moe_ffn_hidden_size
    return 2 * (3 if args.swiglu else 2) * h * args.ffn_hidden_size


def model_flops(args, seq: int, document: int | None = None) -> float:
    """Matmul FLOPs of forward + backward for one sequence of ``seq`` tokens (3x forward), of an
    MoE or a dense model; ``document``: packed documents of that many tokens kept apart, each
    query attending within its own document (the causal half of a document, not of the sequence)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    h, n, d = args.hidden_size, args.num_attention_heads, args.kv_channels
    g = args.num_query_groups if args.group_query_attention else n
    per_token = 0.0
    for layer in range(1, args.num_layers + 1):
        window = is_layer_window_attention(args.window_size, args.window_attn_skip_freq, layer)
        span = min(document or seq, seq)  # the keys a query can reach at most
        keys = min(args.window_size[0] + 1, span) if window else (span + 1) / 2  # average keys per query
        per_token += 2 * h * (n * d + 2 * g * d) + 2 * n * d * h  # q/k/v and output projections
        per_token += 2 * 2 * n * d * keys  # scores and values
        per_token += mlp_flops_per_token(args)
    per_token += 2 * h * args.padded_vocab_size  # logits
    return 3 * per_token * seq
