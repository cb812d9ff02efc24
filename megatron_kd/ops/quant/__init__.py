"""FP4 fake quantization of weights, for quantization-aware distillation.

``fp4.py`` holds ``fake_quantize`` (MXFP4 / NVFP4 quantize-dequantize along the last dim, with
the straight-through gradient) and MXFP4's release layout (``mxfp4_encode`` / ``mxfp4_decode``);
``reference.py`` the float64 ground truth, ``fp4_qdq_reference``.
"""

from megatron_kd.ops.quant.fp4 import FORMATS, fake_quantize, mxfp4_decode, mxfp4_encode
from megatron_kd.ops.quant.reference import fp4_qdq_reference

__all__ = ["FORMATS", "fake_quantize", "fp4_qdq_reference", "mxfp4_decode", "mxfp4_encode"]
