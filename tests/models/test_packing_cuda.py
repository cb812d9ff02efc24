"""Packed documents on the GPU paths of ``core_attention`` (skipped without CUDA).

1. flex (window and full layers, with and without sinks) and varlen (flash's variable-length
   kernels; full and window layers, with and without sinks), bf16, at 4K, 16K and 32K tokens with
   documents shorter than, as long as and longer than GPT-OSS's 128-key window: the packed output
   and the gradients of q, k, v and the sink equal those of each document run alone in the fp32
   math path, within a relative error (Frobenius norm) of 2e-2, the bound the unpacked bf16 paths
   meet at these shapes (test_attention.py)
2. a second micro-batch with other documents reuses the compiled flex kernels (no recompilation)

    python -m pytest -q tests/models/test_packing_cuda.py
"""

import random

import pytest
import torch

from megatron_kd.models.attention import core_attention
from megatron_kd.models.documents import Documents
from tests.fixtures.kd_inputs import rel_err

pytestmark = [pytest.mark.cuda, pytest.mark.xdist_group("gpu_memory")]  # fp32 [s, s] references

WINDOW = (127, 0)  # GPT-OSS's 128 keys
BOUND = 2e-2
EOD = 1


@pytest.fixture(autouse=True)
def _room_for_every_shape():
    """flex compiles once per (shape, window) (dynamic=False); this file's 3 shapes x 2 kinds of
    mask, after test_attention.py's, pass dynamo's default of 8 compilations per function, beyond
    which it would run flex eagerly (materialized scores). A training run compiles two."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def layout(seq: int, seed: int) -> list[int]:
    """Document lengths filling ``seq``: the window's edge cases first (1, 57, 127, 128 and 129
    tokens), then lengths drawn around seq/8; the last one cut by the sample's end."""
    rng = random.Random(seed)
    lengths = [1, 57, 127, 128, 129, 300]
    while sum(lengths) < seq:
        lengths.append(max(1, int(rng.expovariate(8 / seq))))
    lengths[-1] -= sum(lengths) - seq
    return [n for n in lengths if n > 0]


def documents_of(lengths: list[int], device) -> Documents:
    tokens = torch.full((1, sum(lengths)), 5, dtype=torch.int64, device=device)
    ends = torch.tensor(lengths, device=device).cumsum(0) - 1
    tokens[0, ends] = EOD
    return Documents.from_tokens(tokens, EOD)


def _inputs(seq, heads, groups, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # megatron's layout: [s, b, n, d] permuted to [b, n, s, d] views, as CoreAttention passes them
    q, k, v = (torch.randn(seq, 1, n, 64, device="cuda", generator=g, dtype=torch.bfloat16).permute(1, 2, 0, 3)
               for n in (heads, groups, groups))
    sink = torch.randn(heads, device="cuda", generator=g, dtype=torch.bfloat16)
    d_out = torch.randn(1, heads, seq, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, sink, d_out


@pytest.mark.parametrize("impl, window, sinks", [
    ("flex", WINDOW, True), ("flex", None, True), ("flex", None, False), ("flex", WINDOW, False),
    ("varlen", None, True), ("varlen", WINDOW, True), ("varlen", None, False)],
    ids=["flex-window-sinks", "flex-full-sinks", "flex-causal", "flex-window", "varlen-full-sinks",
         "varlen-window-sinks", "varlen-causal"])
@pytest.mark.parametrize("seq, heads, groups", [(4096, 8, 1), (16384, 8, 2), (32768, 2, 1)])
def test_packed_equals_each_document_alone(seed, impl, window, sinks, seq, heads, groups):
    q, k, v, sink, d_out = _inputs(seq, heads, groups, seed)
    lengths = layout(seq, seed)
    docs = documents_of(lengths, "cuda")
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
    out = core_attention(*inputs[:3], scale=0.125, window=window, sink=inputs[3] if sinks else None, impl=impl,
                         documents=docs)
    out.backward(d_out)
    ours = [out.detach().float()] + [t.grad.float() if t.grad is not None else None for t in inputs]
    del out
    # the definition: each document alone, fp32 math
    ref = [torch.zeros_like(t, dtype=torch.float32) for t in (q, q, k, v, sink)]
    full = [t.detach().float().requires_grad_() for t in (q, k, v, sink)]
    start = 0
    for n in lengths:
        part = [t[:, :, start:start + n] for t in full[:3]]
        out = core_attention(*part, scale=0.125, window=window, sink=full[3] if sinks else None, impl="math")
        grads = torch.autograd.grad(out, full if sinks else full[:3], d_out[:, :, start:start + n].float())
        ref[0][:, :, start:start + n] = out.detach()
        for total, grad in zip(ref[1:], grads):
            total += grad
        start += n
        del out, grads
    names = ["out", "dq", "dk", "dv"] + (["dsink"] if sinks else [])
    for name, a, b in zip(names, ours, ref):
        assert rel_err(a, b) < BOUND, (name, rel_err(a, b), f"{len(lengths)} documents")


def test_flex_reuses_its_kernels_across_micro_batches(seed):
    import torch._dynamo

    seq = 4096
    q, k, v, sink, d_out = _inputs(seq, 8, 1, seed)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
    for i, lengths in enumerate([layout(seq, seed), layout(seq, seed + 1), [seq]]):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = core_attention(*leaves[:3], scale=0.125, window=WINDOW, sink=leaves[3], impl="flex",
                                 documents=documents_of(lengths, "cuda"))
            out.backward(d_out)
