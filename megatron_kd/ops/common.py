"""What both ops (the loss in ``kl/``, the teacher's top-K and sampler in ``teacher/``) share.

Both project hidden states onto this rank's vocabulary shard a chunk of tokens at a time, never
holding [tokens, V] logits: ``auto_chunk_size`` picks the chunk from V_local and a memory budget,
``chunk_logits`` is the projection GEMM (mixed precision on CUDA, see ``mixed_gemms``) and
``accumulation_dtype`` the dtype its blocks are computed in. ``IMPLS`` / ``resolve_impl`` turn the
``impl`` argument both take ("auto", "torch", "triton") into an implementation. The collectives are
in ``comm.py`` and the Triton log-sum-exp pieces in ``triton_lse.py``, beside this module; nothing
here imports either op's package.
"""

from __future__ import annotations

import os

import torch

IMPLS = ("auto", "torch", "triton")

_MiB = 1 << 20
# Default budget for the fp32 logits block (the teacher passes its own). On CUDA this keeps the loss
# within ~0.5 GiB of its inputs and gradients while a chunk stays large enough (>= a few hundred rows
# at V = 201K) for full-rate GEMMs.
_CUDA_BLOCK_BYTES = 256 * _MiB
_CPU_BLOCK_BYTES = 32 * _MiB


def resolve_impl(impl: str, hidden: torch.Tensor) -> str:
    """"auto" -> "triton" for bf16/fp16/fp32 CUDA tensors when Triton imports, else "torch"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    triton_ok = hidden.dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    )
    if impl == "triton" and not triton_ok:
        raise ValueError(
            f"impl='triton' needs bf16/fp16/fp32 CUDA tensors (or TRITON_INTERPRET=1 on CPU), got "
            f"{hidden.dtype} on {hidden.device}; use impl='torch' or 'auto'"
        )
    if impl == "auto":
        if not (triton_ok and hidden.is_cuda):
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return impl


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def auto_chunk_size(
    num_tokens: int,
    vocab_local: int,
    *,
    device: torch.device,
    block_dtype: torch.dtype,
    gemm_dtype: torch.dtype,
    extra_block: bool,
    budget_bytes: int | None = None,
    row_extra_bytes: int = 0,
) -> int:
    """Tokens per chunk such that the chunk's [c, V_local] buffers fit the block budget.

    Per row: the fp32 (fp64) logits/gradient block, its copy in the GEMM dtype when that differs,
    one more block when temperature != 1 with labels (softmax at τ and at 1 both needed), and
    ``row_extra_bytes``.
    """
    row_bytes = vocab_local * block_dtype.itemsize * (2 if extra_block else 1)
    if gemm_dtype != block_dtype:
        row_bytes += vocab_local * gemm_dtype.itemsize
    row_bytes += row_extra_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget_bytes or _CUDA_BLOCK_BYTES, free // 8)
    else:
        budget = _CPU_BLOCK_BYTES
    chunk = max(1, budget // max(row_bytes, 1))
    if chunk >= 128:
        chunk -= chunk % 64  # whole tensor-core tiles
    chunk = min(chunk, num_tokens)
    # As many chunks, of (nearly) equal length: a short last chunk runs its GEMMs at a fraction of
    # the tensor cores' rate (H200, GPT-OSS shape: a 1,088-row remainder after 11 x 2,880 took
    # 3.5 ms for its logits where 2,880 rows take 5.0). Whole tiles again where that keeps the last
    # chunk at least half as long as the others.
    n_chunks = -(-num_tokens // chunk)
    even = -(-num_tokens // n_chunks)
    tiled = min(chunk, -(-even // 64) * 64)
    if chunk >= 128 and num_tokens - (n_chunks - 1) * tiled >= tiled // 2:
        even = tiled
    return int(max(1, even))


def mixed_gemms(t: torch.Tensor) -> bool:
    # cuBLAS multiplies bf16/fp16 operands into fp32 outputs; CPU kernels cannot (no out_dtype),
    # so there everything runs in the accumulation dtype on upcast operands.
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def chunk_logits(h_chunk: torch.Tensor, w_gemm: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """[c, h] · [V_local, h]ᵀ -> [c, V_local] in the accumulation dtype: one mixed-precision GEMM
    on CUDA, or a plain GEMM of operands already in ``acc`` (see ``mixed_gemms``)."""
    if h_chunk.dtype != acc:
        return torch.mm(h_chunk, w_gemm.t(), out_dtype=acc)
    return h_chunk @ w_gemm.t()
