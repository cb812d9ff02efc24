"""The fused top-K KL loss: ``fused_topk_kl`` and its materializing reference ``topk_kl_reference``.

``loss.py`` is the public entry point, ``function.py`` its chunk loop and autograd.Function,
``options.py`` the keyword options (``TopKKLOptions``, with their defaults, which make both public
signatures) and the input checks, ``reference.py`` the plain-torch ground truth. The passes over
each logits block are plain torch in ``chunk_torch.py`` (reverse KL / JSD in ``divergences.py``)
or Triton kernels in ``chunk_triton.py``; ``value_checks.py`` reads the inputs' values without
stalling the GPU. Everything this package shares with the teacher's ops is one level up
(``ops/common.py``, ``ops/comm.py``, ``ops/triton_lse.py``).
"""

from megatron_kd.ops.kl.loss import fused_topk_kl
from megatron_kd.ops.kl.options import DIVERGENCES, REDUCTIONS, TAILS, TopKKLOptions
from megatron_kd.ops.kl.reference import topk_kl_reference

__all__ = ["DIVERGENCES", "REDUCTIONS", "TAILS", "TopKKLOptions", "fused_topk_kl", "topk_kl_reference"]
