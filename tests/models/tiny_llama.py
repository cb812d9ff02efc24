"""Tiny random Llama 3 and Qwen3 models in Hugging Face format, and the Megatron flags that build them.

Every feature of each architecture changes the logits at these sizes: Llama's RoPE at θ 500,000
with Llama 3's scaling (factor 8: channels whose wavelength exceeds 2,048 positions are slowed, and
the test's 128 positions turn them far enough to see it), grouped-query attention (4 query heads
on 2 key/value groups), head dimension 16 ≠ hidden / heads, intermediate size ≠ hidden, untied
embeddings with more rows (1000) than the tokenizer has tokens (990); Qwen3's RMSNorm over each
head's queries and keys, with weights far from one. The flags come from ``llama.megatron_flags``,
the function users run, plus the CPU settings the GPT-OSS tests use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_gpt_oss import CPU_FLAGS, LOCAL_IMPL, VOCAB_ROWS, save_word_tokenizer

SEQ = 128
KINDS = ("llama", "qwen3")


def tiny_config(kind: str, **overrides):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB_ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=2,
                  # weights of std 0.8/√hidden keep every layer's outputs of order one
                  initializer_range=0.8 / 64 ** 0.5)
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return LlamaConfig(**{**common, "rope_parameters": rope, **overrides})
    if kind == "qwen3":
        return Qwen3Config(**{**common, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                              **overrides})
    raise ValueError(f"kind is one of {KINDS}, got {kind!r}")


def make_tiny(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a random fp32 ``kind`` model (LlamaForCausalLM / Qwen3ForCausalLM) and a word-level
    tokenizer into ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # q_norm / k_norm and the layer norms: scales of order one, not ones
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return Path(path)


def tiny_flags(hf_dir: Path, *extra: str) -> list[str]:
    """What a user passes to train a student from ``hf_dir`` on CPU: the flags describing its
    architecture (``megatron_flags``), the local spec, and ``--kd-student-hf``."""
    from transformers import AutoConfig

    from megatron_kd.models.llama import megatron_flags

    cpu = [f for f in CPU_FLAGS]
    cpu[cpu.index("--seq-length") + 1] = str(SEQ)
    return [*megatron_flags(AutoConfig.from_pretrained(hf_dir)), *LOCAL_IMPL, *cpu,
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--kd-student-hf", str(hf_dir), *extra]
