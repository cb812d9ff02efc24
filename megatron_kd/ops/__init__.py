"""The ops of megatron_kd, and what they share.

``kl/``       the fused top-K KL loss (``fused_topk_kl``) and its materializing reference
              (``topk_kl_reference``): chunked, vocab-parallel, gradients formed in the forward pass.
``teacher/``  the teacher's top-K (``vocab_parallel_topk``) and sampler (``vocab_parallel_sample``)
              of softmax(hidden · Wᵀ / τ), which fill the cache the loss reads.
``quant/``    FP4 fake quantization of weights (``fake_quantize``: MXFP4, NVFP4) with a
              straight-through gradient, for quantization-aware distillation, and MXFP4's release
              layout; it shares nothing with the two above.

Below both: ``common.py`` (the ``impl`` choice, token chunks and the projection GEMMs),
``comm.py`` (collectives over an explicit tensor-parallel group) and ``triton_lse.py`` (the
Triton kernels' log-sum-exp pieces). Neither op's package imports the other. The loss's public
names are importable from here.
"""

from megatron_kd.ops.common import IMPLS
from megatron_kd.ops.kl import DIVERGENCES, REDUCTIONS, TAILS, TopKKLOptions, fused_topk_kl, topk_kl_reference

__all__ = ["DIVERGENCES", "IMPLS", "REDUCTIONS", "TAILS", "TopKKLOptions", "fused_topk_kl", "topk_kl_reference"]
