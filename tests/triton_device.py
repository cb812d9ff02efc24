"""Where a test of a Triton kernel runs: compiled on the GPU where there is one (marked ``cuda``, so
`pytest -m cuda` selects it), else in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1 without a GPU), else skipped. A module sets ``pytestmark = TRITON_DEVICE_MARKS``
and builds its tensors on ``DEVICE``."""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_DEVICE_MARKS = [
    pytest.mark.cuda if DEVICE == "cuda" else pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton needs CUDA or its interpreter"),
]
