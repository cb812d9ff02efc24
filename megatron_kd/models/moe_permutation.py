"""The MoE token permutation's row sums without atomics: megatron-core's ``permute`` / ``unpermute``
with their sums done as gathers.

Without Transformer Engine megatron-core permutes a micro-batch's T tokens into expert-sorted rows
with ``index_select`` and combines the experts' outputs back with ``scatter_add_``; the backward of
the first is ``index_add_``. Both sums run as atomic adds on bf16 rows (a compare-and-swap loop per
element) and were, after the GEMMs and attention, among the largest kernels of a GPT-OSS layer pair
at 32K (``index_add_`` 7.2 ms, ``scatter_add_`` 3.1 ms of 190). Sorting the row → token map once
(``rows_by_token``: the rows in token order and each token's offsets, no host sync) turns them into
gathers:

    combine:   out[t]  = Σ_{i: token_of_row[i] = t} rows[i]      (unpermute; permute's backward)
    spread:    rows[i] = out[token_of_row[i]]                     (permute; unpermute's backward)

``gather_sum`` adds a token's rows (any number: top-k over all experts, or the local ones of an
all-gather dispatcher) in fp32 and rounds once, one Triton program per token and column block,
where the atomics round after every add. The row order and the permuted probabilities stay
megatron-core's own: ``permute`` below calls megatron-core's ``permute`` on a zero-width view of the
tokens for them, so only the row copy is ours.

``install_moe_permutation`` points megatron-core's token dispatchers at these two functions; they
take CUDA tensors without TE fusion or drop-and-pad and hand every other call (and ``unpermute``
with probabilities to apply) to megatron-core's. Tested against megatron-core's functions
(``tests/models/test_moe_permutation.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _gather_sum_kernel(rows_ptr, order_ptr, offsets_ptr, out_ptr, hidden, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    i = tl.load(offsets_ptr + token)
    end = tl.load(offsets_ptr + token + 1)
    while i < end:  # the token's rows, as many as it has
        row = tl.load(order_ptr + i).to(tl.int64)
        acc += tl.load(rows_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        i += 1
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def rows_by_token(token_of_row: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows grouped by token: (order [N], rows in token order; offsets [T + 1], token t's rows are
    order[offsets[t]:offsets[t + 1]]), on the device without a host sync."""
    order = torch.sort(token_of_row, stable=True).indices
    bounds = torch.arange(tokens + 1, device=token_of_row.device, dtype=token_of_row.dtype)
    return order, torch.searchsorted(token_of_row[order], bounds)


def gather_sum(rows: torch.Tensor, token_of_row: torch.Tensor, tokens: int, *,
               use_triton: bool | None = None) -> torch.Tensor:
    """out[t] = Σ of rows[i] over the rows i of token t (token_of_row[i] = t), [T, h] in rows' dtype,
    each sum in fp32 rounded once. Triton: one program per token and column block, no atomics."""
    rows = rows.contiguous()
    if not (use_triton if use_triton is not None else rows.is_cuda):
        out = torch.zeros((tokens, rows.shape[1]), dtype=torch.float32, device=rows.device)
        return out.index_add_(0, token_of_row, rows.float()).to(rows.dtype)
    order, offsets = rows_by_token(token_of_row, tokens)
    out = torch.empty((tokens, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    _gather_sum_kernel[(tokens, triton.cdiv(rows.shape[1], BLOCK_H))](
        rows, order, offsets, out, rows.shape[1], BLOCK=BLOCK_H, num_warps=4)
    return out


class _Spread(torch.autograd.Function):
    """rows = x[token_of_row]; backward sums each token's row gradients."""

    @staticmethod
    def forward(ctx, x, token_of_row):
        ctx.save_for_backward(token_of_row)
        ctx.tokens = x.shape[0]
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return gather_sum(grad, token_of_row, ctx.tokens), None


class _Combine(torch.autograd.Function):
    """out[t] = Σ of token t's rows; backward copies each token's gradient to its rows."""

    @staticmethod
    def forward(ctx, rows, token_of_row, tokens):
        ctx.save_for_backward(token_of_row)
        return gather_sum(rows, token_of_row, tokens)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, token_of_row), None, None


@functools.lru_cache(maxsize=None)
def _megatron():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.permute, moe_utils.unpermute


def covered(on_cuda: bool, fused: bool, drop_and_pad: bool) -> bool:
    """Whether ``permute`` / ``unpermute`` take a call: on CUDA, without TE's fused kernels or
    drop-and-pad (whose padded rows megatron-core's own functions handle)."""
    return on_cuda and not fused and not drop_and_pad


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
            tokens_per_expert=None, align_size=0):
    """megatron-core's ``permute``, the rows copied by ``_Spread`` where it applies."""
    megatron_permute = _megatron()[0]
    if num_out_tokens is None or not covered(tokens.is_cuda, fused, drop_and_pad):
        return megatron_permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert, align_size=align_size)
    # megatron-core's row order and permuted probabilities, from a zero-width view: its row copy is free
    _, permuted_probs, token_of_row, pad_offsets, tokens_per_expert = megatron_permute(
        tokens.detach()[:, :0], routing_map, probs=probs, num_out_tokens=num_out_tokens,
        tokens_per_expert=tokens_per_expert, align_size=align_size)
    return _Spread.apply(tokens, token_of_row), permuted_probs, token_of_row, pad_offsets, tokens_per_expert


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
              drop_and_pad=False, pad_offsets=None):
    """megatron-core's ``unpermute``, the rows summed by ``_Combine`` where it applies (no probabilities
    to apply: the experts have applied them)."""
    if (probs is not None or pad_offsets is not None or permuted_tokens.shape[0] != sorted_indices.numel()
            or not covered(permuted_tokens.is_cuda, fused, drop_and_pad)):
        return _megatron()[1](permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                              fused=fused, drop_and_pad=drop_and_pad, pad_offsets=pad_offsets)
    return _Combine.apply(permuted_tokens, sorted_indices, restore_shape[0])


def install_moe_permutation() -> None:
    """Route megatron-core's token dispatchers (which imported ``permute`` / ``unpermute`` by name)
    through the functions above; idempotent. megatron-core's own stay in ``moe_utils``."""
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.permute, token_dispatcher.unpermute = permute, unpermute
