"""A tiny random GPT-OSS in Hugging Face format, and the examples/gpt_oss recipe flags shrunk to it.

The model has every GPT-OSS feature switched on at sizes where each one changes the logits: a
sliding window (8 keys) shorter than the test sequence (32 tokens), sinks, router and expert biases
of order one, expert pre-activations large enough that the ±7 clamps bite, YaRN at factor 32,
intermediate size ≠ hidden size (a transposed expert weight cannot load), and an embedding with
more rows (1000) than the tokenizer has tokens (990), as GPT-OSS has (201,088 vs its tokenizer).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]
VOCAB_ROWS = 1000
TOKENIZER_TOKENS = 990
SEQ = 32
WINDOW = 8

# The recipe's architecture, shrunk: later flags win over the recipe's, as users override them.
TINY_ARCH = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--kv-channels", "16", "--moe-ffn-hidden-size", "48", "--ffn-hidden-size", "48", "--num-experts", "4",
    "--moe-router-topk", "2", "--window-size", f"{WINDOW - 1},0", "--max-position-embeddings", "4096",
    "--make-vocab-size-divisible-by", "8",
    "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--calculate-per-token-loss",
]
CPU_FLAGS = [
    # megatron-core's alltoall dispatcher creates a CUDA stream; allgather computes the same
    "--moe-token-dispatcher-type", "allgather", "--use-cpu-initialization",
    "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
    "--lr", "1e-4",
]


def recipe_flags(size: str, *, layout: bool = True) -> list[str]:
    """The flags examples/gpt_oss/distill.sh passes for ``size``: architecture, size and (with
    ``layout``) the one-node parallel layout."""
    arrays = '"${GPT_OSS_ARCH[@]}" "${GPT_OSS_SIZE[@]}"' + (' "${GPT_OSS_LAYOUT[@]}"' if layout else "")
    script = (f'source "{ROOT}/examples/gpt_oss/gpt_oss.sh"; source "{ROOT}/examples/gpt_oss/{size}.sh"; '
              f'printf "%s\\n" {arrays}')
    return subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]


def tiny_flags(hf_dir: Path, *extra: str) -> list[str]:
    """The 20B recipe's architecture shrunk to the tiny model on CPU, initialized from ``hf_dir``."""
    return [*recipe_flags("20b", layout=False), *TINY_ARCH, *CPU_FLAGS, "--kd-student-hf", str(hf_dir), *extra]


def make_tiny_gpt_oss(path: Path, seed: int = 0) -> Path:
    """Save a random fp32 GptOssForCausalLM and a word-level tokenizer into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=VOCAB_ROWS, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=4096,
                          initializer_range=0.1, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    model = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias", ".bias")):
                p.normal_(0.0, 1.0)
            elif name.endswith("gate_up_proj"):
                p.normal_(0.0, 0.6)  # pre-activations of a few units: the clamps at ±7 bite
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, TOKENIZER_TOKENS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                            unk_token="w3").save_pretrained(path)
    return path
