"""Tensor-parallel fused_topk_kl (2 ranks, megatron-core's own TP group) equals TP=1.

On CPU with gloo (in CI), and on two GPUs with NCCL where a machine has them.

Each rank holds its half of the vocabulary (weight rows) and, under sequence parallelism, its
slice of the sequence; every rank draws the same full inputs from the shared seed and checks
its loss, stats and gradients against the single-process result on the full vocabulary.
"""

import contextlib
import functools
import itertools
import os

import pytest
import torch

from megatron_kd.ops import TAILS, fused_topk_kl, topk_kl_reference
from tests.fixtures.dist_utils import init_tensor_parallel, megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import loss_and_grads, make_inputs, rel_err

CASES = list(itertools.product(TAILS, [1.0, 2.0], [0.0, 0.5]))
# reverse / jsd: the per-row sums over the teacher entries are partial sums per rank (an all-reduce);
# each divergence x tail once, renorm without CE (the sparse-only gradient) and with it
SUPPORT_CASES = [("reverse", "renorm", 1.0, 0.0), ("reverse", "ghost", 2.0, 0.5), ("jsd", "renorm", 2.0, 0.5),
                 ("jsd", "ghost", 1.0, 0.0)]


def _tp_worker(rank, world, seed, sequence_parallel, dtype, tol, device, impl, cases="forward"):
    with megatron_cpu_patches() if device == "cpu" else contextlib.nullcontext():
        group = init_tensor_parallel(world)
        torch.manual_seed(seed)
        cases = [("forward", *c) for c in CASES] if cases == "forward" else SUPPORT_CASES
        for divergence, tail, temperature, ce_weight in cases:
            # reverse / jsd: fewer tokens (the Triton interpreter's time is per row)
            s = 6 * world if divergence == "forward" else 2 * world
            x = make_inputs(s=s, b=2, h=16, vocab=37 * world, k=9, dtype=dtype)
            x = x.to(device=torch.device(device, rank) if device == "cuda" else device)
            kw = dict(loss_mask=x.loss_mask, labels=x.labels, ce_weight=ce_weight, temperature=temperature,
                      tail=tail, reduction="mean", chunk_size=5)
            if divergence != "forward":
                kw.update(divergence=divergence, jsd_beta=0.3)
            fused = functools.partial(fused_topk_kl, impl=impl)
            single = loss_and_grads(fused, x, **kw)
            weight_shard = x.weight.chunk(world, dim=0)[rank]
            hidden_in = x.hidden.chunk(world, dim=0)[rank] if sequence_parallel else x.hidden
            for fn in (fused, topk_kl_reference):
                loss, stats, gh, gw = loss_and_grads(
                    fn, x, hidden=hidden_in, weight=weight_shard, tp_group=group,
                    sequence_parallel=sequence_parallel, **kw,
                )
                where = (f"{getattr(fn, '__name__', impl)} rank {rank} {divergence} tail={tail} tau={temperature} "
                         f"ce={ce_weight}")
                assert rel_err(loss, single[0]) <= tol, where
                for key in stats:
                    assert rel_err(stats[key], single[1][key]) <= tol, (where, key)
                expect_gh = single[2].chunk(world, dim=0)[rank] if sequence_parallel else single[2]
                assert gh.shape == hidden_in.shape
                assert rel_err(gh, expect_gh) <= tol, where
                assert rel_err(gw, single[3].chunk(world, dim=0)[rank]) <= tol, where


two_gpus = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]
# Triton kernels on CPU tensors run in the interpreter (conftest sets it on machines without a GPU).
cpu_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize(
    "device, dtype, tol, impl",
    [
        ("cpu", torch.float64, 1e-12, "torch"),
        ("cpu", torch.float32, 1e-5, "torch"),
        pytest.param("cpu", torch.float32, 1e-5, "triton", marks=cpu_triton),
        pytest.param("cuda", torch.float32, 1e-5, "triton", marks=two_gpus),
        pytest.param("cuda", torch.bfloat16, 2e-2, "triton", marks=two_gpus),
        pytest.param("cuda", torch.bfloat16, 2e-2, "torch", marks=two_gpus),
    ],
    ids=["gloo-fp64", "gloo-fp32", "gloo-fp32-triton", "nccl-fp32-triton", "nccl-bf16-triton", "nccl-bf16-torch"],
)
def test_tensor_parallel_matches_single_rank(seed, sequence_parallel, device, dtype, tol, impl):
    backend = "nccl" if device == "cuda" else "gloo"
    spawn(_tp_worker, seed, sequence_parallel, dtype, tol, device, impl, world_size=2, backend=backend)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize(
    "device, dtype, tol, impl",
    [
        ("cpu", torch.float64, 1e-12, "torch"),
        pytest.param("cpu", torch.float32, 1e-5, "triton", marks=cpu_triton),
        pytest.param("cuda", torch.float32, 1e-5, "triton", marks=two_gpus),
        pytest.param("cuda", torch.bfloat16, 2e-2, "triton", marks=two_gpus),
    ],
    ids=["gloo-fp64", "gloo-fp32-triton", "nccl-fp32-triton", "nccl-bf16-triton"],
)
def test_tensor_parallel_reverse_and_jsd_match_single_rank(seed, sequence_parallel, device, dtype, tol, impl):
    backend = "nccl" if device == "cuda" else "gloo"
    spawn(_tp_worker, seed, sequence_parallel, dtype, tol, device, impl, "support", world_size=2, backend=backend)
