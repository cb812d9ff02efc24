"""The teacher's side: the top-K, or a sample, of softmax(hidden · Wᵀ / τ) without full logits.

``topk.py`` holds ``vocab_parallel_topk`` and the logits blocks both walk (``logits_chunks``),
``sample.py`` the sampler (``vocab_parallel_sample``, its counter-based uniforms
``sample_row_keys`` / ``draw_uniforms``); ``topk_triton.py`` and ``sample_triton.py`` are their
CUDA kernels. Nothing here imports the loss (``ops/kl``): what the two share is one level up
(``ops/common.py``, ``ops/comm.py``, ``ops/triton_lse.py``).
"""

from megatron_kd.ops.teacher.sample import (
    SAMPLE_TILE,
    draw_uniforms,
    sample_row_keys,
    splitmix64,
    vocab_parallel_sample,
)
from megatron_kd.ops.teacher.topk import vocab_parallel_topk

__all__ = [
    "SAMPLE_TILE", "draw_uniforms", "sample_row_keys", "splitmix64", "vocab_parallel_sample", "vocab_parallel_topk",
]
