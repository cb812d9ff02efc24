"""A tiny megatron-core GPT teacher and dataset for the teacher-pass tests (CPU, gloo)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_kd.megatron.data import ByteTokenizer, build_gpt_datasets, write_indexed_dataset

SEQ, K, PADDED_VOCAB = 24, 6, 264  # Megatron pads the 258-token byte vocabulary for TP


def make_dataset(tmp, num_samples=10, seed=0):
    """A GPTDataset over random byte documents. The first call (the test's own process) writes the
    documents and builds the index caches; workers' calls only read them: a worker rewriting docs.bin
    while another rank has it memory-mapped kills that rank with SIGBUS."""
    rng = np.random.default_rng(seed)
    tok = ByteTokenizer()
    prefix = Path(f"{tmp}/data/docs")
    if not Path(f"{prefix}.idx").exists():
        docs = [list(rng.integers(0, 256, rng.integers(20, 80))) + [tok.eod] for _ in range(60)]
        write_indexed_dataset(prefix, docs, tok.vocab_size)
    train, _, _ = build_gpt_datasets([str(prefix)], split="100,0,0", seq_length=SEQ, seed=seed, tokenizer=tok,
                                     num_samples=(num_samples, 0, 0), cache_dir=f"{tmp}/data/cache")
    return train


def tiny_model(tp: int, seed: int = 0):
    """Identical weights for any TP size: megatron initializes the full matrix on CPU, then splits."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: F401
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
                            tensor_model_parallel_size=tp, init_method_std=0.3)
    model = build_gpt_model(cfg, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                            position_embedding_type="learned_absolute", use_te=False)
    return model.eval()
