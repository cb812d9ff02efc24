"""A tiny random GPT-OSS in Hugging Face format (dense or the release's MXFP4 layout), and the
examples/gpt_oss recipe flags shrunk to it.

The model has every GPT-OSS feature switched on at sizes where each one changes the logits: a
sliding window (8 keys) shorter than the test sequence (32 tokens), sinks, router and expert biases
of order one, expert pre-activations large enough that the ±7 clamps bite, YaRN at factor 32,
intermediate size ≠ hidden size (a transposed expert weight cannot load), and an embedding with
more rows (1000) than the tokenizer has tokens (990), as GPT-OSS has (201,088 vs its tokenizer).
``GptOssShape`` also describes wider models (``HEAD_SHAPE``: GPT-OSS's 64 query / 8 KV heads of
dimension 64 and its 128-key window) built the same way.

Expert weights are rounded to MXFP4-representable values, so one model is saved exactly in either
layout. The MXFP4 layout is the one of the published checkpoints (transformers'
``integrations/mxfp4.py`` reads it): per expert projection ``{proj}_blocks`` uint8
[E, rows, cols/32, 16] and ``{proj}_scales`` uint8 [E, rows, cols/32], where a weight is stored
[rows = outputs, cols = inputs] (``gate_up_proj``: [E, 2I, hidden], gate/linear rows interleaved;
``down_proj``: [E, hidden, I]); each block of 32 inputs shares one E8M0 scale 2^(byte − 127) and
holds 32 FP4 E2M1 codes (sign bit 3, magnitude index bits 0-2 into ``FP4_E2M1``), two per byte,
element 2j in the low nibble and 2j+1 in the high one. ``*_bias`` stay dense; config.json gets the
release's ``quantization_config``.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]
VOCAB_ROWS = 1000
TOKENIZER_TOKENS = 990
SEQ = 32
MXFP4_BLOCK = 32
# FP4 E2M1 values by code (transformers' FP4_VALUES): codes 8-15 are the negatives of 0-7
FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_FP4_MIDPOINTS = (FP4_E2M1[1:8] + FP4_E2M1[:7]) / 2
# config.json's quantization_config of openai/gpt-oss-20b and -120b
RELEASE_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}


@dataclass(frozen=True)
class GptOssShape:
    """The sizes of one GPT-OSS architecture: its HF config and its Megatron flags come from here."""
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96  # ≠ hidden, and both multiples of MXFP4's block of 32
    experts: int = 4
    topk: int = 2
    window: int = 8

    def arch_flags(self) -> list[str]:
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--num-query-groups", str(self.kv_heads),
                "--kv-channels", str(self.head_dim), "--moe-ffn-hidden-size", str(self.intermediate),
                "--ffn-hidden-size", str(self.intermediate), "--num-experts", str(self.experts),
                "--moe-router-topk", str(self.topk), "--window-size", f"{self.window - 1},0",
                "--max-position-embeddings", "4096"]


TINY = GptOssShape()
WINDOW = TINY.window
# GPT-OSS's attention shape (64 query / 8 KV heads of dimension 64, 128-key window) at a width and
# depth that a test affords; ``hidden`` is replaced per test
HEAD_SHAPE = GptOssShape(hidden=2880, heads=64, kv_heads=8, head_dim=64, intermediate=2880, window=128)

# megatron-core's local spec on a machine without TE / Apex fusions
LOCAL_IMPL = ["--make-vocab-size-divisible-by", "8", "--transformer-impl", "local", "--no-rope-fusion",
              "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
              "--calculate-per-token-loss"]
# The recipe's architecture, shrunk: later flags win over the recipe's, as users override them.
TINY_ARCH = [*TINY.arch_flags(), *LOCAL_IMPL]
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


# ------------------------------------------------------------------------------------------- MXFP4
def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] -> (blocks uint8 [..., cols/32, 16], scales uint8 [..., cols/32]), each block's
    scale the smallest power of two that brings its largest magnitude to ≤ 6, values rounded to
    the nearest FP4 E2M1 value."""
    *lead, cols = w.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 blocks of {MXFP4_BLOCK}: {cols} columns do not divide")
    blocks = w.float().contiguous().reshape(*lead, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    magnitude = torch.bucketize(scaled.abs(), _FP4_MIDPOINTS)  # code 0-7 of the nearest value
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of ``mxfp4_quantize``: [..., cols/32, 16] codes and [..., cols/32] scales -> fp32 [..., cols]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2).long()  # low nibble first
    values = FP4_E2M1[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def mxfp4_round(w: torch.Tensor) -> torch.Tensor:
    """The MXFP4-representable tensor nearest ``w`` (blocks along the last dim)."""
    return mxfp4_dequantize(*mxfp4_quantize(w)).to(w.dtype)


def write_mxfp4_layout(path: Path) -> None:
    """Rewrite a ``save_pretrained`` GPT-OSS directory's experts in the release's MXFP4 layout
    (see the module docstring); the expert weights must be MXFP4-representable (exactly stored)."""
    from safetensors.torch import load_file, save_file

    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{path}: expected one model.safetensors, found {[f.name for f in files]}")
    dense = load_file(str(files[0]))
    out = {}
    for key, t in dense.items():
        if not key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[key] = t
            continue
        stored = t.transpose(1, 2).contiguous()  # save_pretrained's [E, in, out] -> the release's [E, out, in]
        blocks, scales = mxfp4_quantize(stored)
        if not torch.equal(mxfp4_dequantize(blocks, scales), stored.float()):
            raise ValueError(f"{key} is not MXFP4-representable; round it with mxfp4_round first")
        out[key + "_blocks"], out[key + "_scales"] = blocks, scales
    save_file(out, str(files[0]), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = RELEASE_QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))


# -------------------------------------------------------------------------------------- the model
def tiny_gpt_oss_config(shape: GptOssShape = TINY):
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=VOCAB_ROWS, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                        num_local_experts=shape.experts, num_experts_per_tok=shape.topk,
                        sliding_window=shape.window, max_position_embeddings=4096,
                        # weights of std 0.8/√hidden keep every layer's outputs of order one at any width
                        initializer_range=0.8 / shape.hidden ** 0.5, eos_token_id=1, pad_token_id=0,
                        bos_token_id=2)


def make_tiny_gpt_oss(path: Path, seed: int = 0, *, shape: GptOssShape = TINY, layout: str = "dense") -> Path:
    """Save a random fp32 GptOssForCausalLM of ``shape`` and a word-level tokenizer into ``path``,
    its experts in the ``layout`` "dense" (``save_pretrained``'s) or "mxfp4" (the release's); the
    same ``seed`` and ``shape`` give the same numbers in both."""
    from transformers import GptOssForCausalLM

    if layout not in ("dense", "mxfp4"):
        raise ValueError(f"layout is 'dense' or 'mxfp4', got {layout!r}")
    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_gpt_oss_config(shape)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias", ".bias")):
                p.normal_(0.0, 1.0)
            elif name.endswith("gate_up_proj"):
                p.normal_(0.0, 4.8 / shape.hidden ** 0.5)  # pre-activations of a few units: the clamps at ±7 bite
            if name.endswith(("gate_up_proj", "down_proj")):
                p.copy_(mxfp4_round(p.transpose(1, 2)).transpose(1, 2))  # blocks along the inputs, as stored
    model.save_pretrained(path)
    if layout == "mxfp4":
        write_mxfp4_layout(Path(path))
    save_word_tokenizer(path)
    return path


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer of TOKENIZER_TOKENS tokens (<pad>, <eos>, <bos>, w3 ...) into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, TOKENIZER_TOKENS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                            unk_token="w3").save_pretrained(path)
