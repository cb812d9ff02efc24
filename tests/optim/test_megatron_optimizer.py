"""--kd-optimizer bf16-sr-8bit inside megatron-core's own optimizer stack, on CPU with gloo.

1. a DistributedOptimizer over 2 ranks (both fed the same batches, so the reduced gradient is the
   single rank's exactly) holds Bf16Adam sharded: each rank the state of its half, no fp32 master
   copy; its steps equal the single-rank steps bit for bit with fp32 moments (the stochastic-rounding
   bits do not depend on the sharding), and the first step with 8-bit moments too (later 8-bit steps
   differ by the quantization blocks, which start at each shard's first element)
2. checkpoints through megatron-core's distributed checkpointing (Megatron-LM's default
   dp_reshardable format and fully_reshardable) resume bit for bit: a run saved after 2 steps and
   loaded into a freshly built model and optimizer takes the same next 2 steps as one never stopped
3. install/uninstall: idempotent, and megatron-core's own names come back
4. the flags a choice implies, and the ones that contradict it
"""


import pytest
import torch

from megatron_kd.errors import FlagError
from megatron_kd.optim import Bf16Adam
from megatron_kd.optim import megatron as kd_optimizer
from megatron_kd.optim.quantize import moment_bytes
from tests.fixtures.dist_utils import spawn
from tests.fixtures.megatron_cpu import megatron_optimizer_cpu_patches
from tests.fixtures.megatron_student import wrap_for_training

VOCAB, SEQ, BATCH = 128, 16, 2


def _student(seed=0):
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0)
    return build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                           position_embedding_type="learned_absolute", use_te=False)


def _train(ddp, optimizer, steps, first=0):
    """``steps`` steps on batches that depend on the step only (every rank gets the same ones)."""
    for step in range(first, first + steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens).float().mean().backward()
        ddp.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok


def _params(ddp):
    return {name: p.detach().clone() for name, p in ddp.named_parameters()}


def _inner(optimizer) -> Bf16Adam:
    (part,) = optimizer.chained_optimizers
    assert isinstance(part.optimizer, Bf16Adam)
    return part.optimizer


def _worker(rank, world, out):
    from megatron.core import parallel_state

    with megatron_optimizer_cpu_patches():
        parallel_state.initialize_model_parallel()
        _steps(rank, world, out)
        if world == 2:
            for sharding in ("dp_reshardable", "fully_reshardable"):
                _checkpoint_round_trip(rank, out, sharding)


def _steps(rank, world, out):
    results = {}
    for moments in ("fp32", "8bit"):
        # no clipping: megatron-core's fallback (no TE, no Apex) norm of bf16 gradients rounds
        # differently on 1 and 2 ranks
        ddp, optimizer = wrap_for_training(_student(), "bf16-sr-8bit", lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                                           moments=moments, seed=7)
        inner = _inner(optimizer)
        total = sum(p.numel() for p in ddp.parameters())
        held = sum(p.numel() for group in inner.param_groups for p in group["params"])
        assert held == pytest.approx(total / world, rel=0.02), (held, total)  # this rank's shard only
        assert all(getattr(p, "main_param", None) is None for p in ddp.parameters())  # no fp32 master
        _train(ddp, optimizer, 1)
        after_one = _params(ddp)
        _train(ddp, optimizer, 2, first=1)
        quantized = sum(p.numel() for p in inner.state if inner.state[p]["exp_avg"].dtype == torch.uint8)
        if moments == "8bit":  # the plan's accounting, tensor by tensor
            assert inner.state_bytes() == sum(2 * moment_bytes(p.numel()) for p in inner.state)
        results[moments] = {"step1": after_one, "step3": _params(ddp), "held": held, "quantized": quantized}
    torch.save(results, out / f"world{world}-rank{rank}.pt")


def test_distributed_optimizer(tmp_path):
    """Sharding and steps against one rank (1), checkpoint round trips (2): two launches in all,
    megatron-core's import is most of their time."""
    spawn(_worker, tmp_path, world_size=1)
    spawn(_worker, tmp_path, world_size=2)
    one = torch.load(tmp_path / "world1-rank0.pt")
    for rank in (0, 1):
        two = torch.load(tmp_path / f"world2-rank{rank}.pt")
        for name in one["fp32"]["step3"]:
            assert torch.equal(one["fp32"]["step3"][name], two["fp32"]["step3"][name]), name
            assert torch.equal(one["8bit"]["step1"][name], two["8bit"]["step1"][name]), name
            assert not torch.equal(one["8bit"]["step1"][name], one["8bit"]["step3"][name]), name  # it trains
        r = two["8bit"]
        assert r["quantized"] > 0.9 * r["held"]  # all but the small shards in 8 bits
        assert one["8bit"]["held"] == pytest.approx(2 * r["held"], rel=0.02)


def _checkpoint_round_trip(rank, out, sharding):
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": sharding}
    ddp, optimizer = wrap_for_training(_student(), "bf16-sr-8bit", lr=1e-3, weight_decay=0.1, seed=3)
    _train(ddp, optimizer, 2)
    ckpt = out / f"ckpt-{sharding}"
    if rank == 0:
        ckpt.mkdir()
    torch.distributed.barrier()
    model_sd = ddp.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, is_loading=False, metadata=metadata)}, str(ckpt))
    _train(ddp, optimizer, 2, first=2)
    uninterrupted, inner = _params(ddp), _inner(optimizer)

    # a new process would build the model from another initialization, then load
    ddp2, optimizer2 = wrap_for_training(_student(seed=1), "bf16-sr-8bit", lr=1e-3, weight_decay=0.1, seed=3)
    model_sd = ddp2.module.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optimizer2.sharded_state_dict(
        model_sd, is_loading=True, metadata=metadata)}, str(ckpt))
    ddp2.module.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optimizer"])
    inner2 = _inner(optimizer2)
    assert [g["step"] for g in inner2.param_groups] == [2] * len(inner2.param_groups)
    _train(ddp2, optimizer2, 2, first=2)
    resumed = _params(ddp2)
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], resumed[name]), name
    for p, p2 in zip((p for g in inner.param_groups for p in g["params"]),
                     (p for g in inner2.param_groups for p in g["params"])):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(inner.state[p][key], inner2.state[p2][key]), key


def test_install_is_idempotent_and_reversible():
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    own = (mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER, distrib_optimizer.Adam,
           distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER, OptimizerConfig.__post_init__)
    try:
        kd_optimizer.install("bf16-sr-8bit", seed=5)
        cls = mcore_optimizer.Adam
        assert issubclass(cls, Bf16Adam) and distrib_optimizer.Adam is cls
        kd_optimizer.install("bf16-sr-8bit", seed=5)
        assert mcore_optimizer.Adam is cls  # the same binding: nothing done
        # megatron-core's precision-aware config no longer needs Transformer Engine's FusedAdam
        config = OptimizerConfig(use_precision_aware_optimizer=True, use_distributed_optimizer=True, bf16=True,
                                 exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, main_grads_dtype=torch.bfloat16)
        assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        kd_optimizer.install("bf16-sr-8bit", seed=6)
        assert mcore_optimizer.Adam is not cls and issubclass(mcore_optimizer.Adam, Bf16Adam)
    finally:
        kd_optimizer.install("megatron")
    assert (mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER, distrib_optimizer.Adam,
            distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER,
            OptimizerConfig.__post_init__) == own


def test_implied_and_contradicting_flags():
    base = ["--num-layers", "2", "--kd-optimizer", "bf16-sr-8bit"]
    out = kd_optimizer.expand_optimizer_flags(base)
    assert out[:len(base)] == base
    assert out[len(base):] == ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                               "--main-grads-dtype", "bf16", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8"]
    # given already: not repeated
    assert kd_optimizer.expand_optimizer_flags([*base, "--bf16", "--exp-avg-dtype", "fp8"]).count("--bf16") == 1
    assert kd_optimizer.expand_optimizer_flags(["--num-layers", "2"]) == ["--num-layers", "2"]
    with pytest.raises(FlagError, match="--main-grads-dtype fp32 contradicts --kd-optimizer bf16-sr-8bit"):
        kd_optimizer.expand_optimizer_flags([*base, "--main-grads-dtype", "fp32"])
    with pytest.raises(FlagError, match="--optimizer-cpu-offload contradicts"):
        kd_optimizer.expand_optimizer_flags([*base, "--optimizer-cpu-offload"])
    with pytest.raises(FlagError, match="--kd-fused-adam contradicts"):
        kd_optimizer.expand_optimizer_flags([*base, "--kd-fused-adam"])
    with pytest.raises(FlagError, match="--optimizer sgd contradicts"):
        kd_optimizer.expand_optimizer_flags([*base, "--optimizer", "sgd"])
    with pytest.raises(FlagError, match="--kd-optimizer must be one of megatron, bf16-sr-8bit, got 'adam8'"):
        kd_optimizer.expand_optimizer_flags(["--kd-optimizer=adam8"])
    # they are Megatron-LM's own flags
    from megatron.training.arguments import add_megatron_arguments

    args, unknown = add_megatron_arguments(__import__("argparse").ArgumentParser()).parse_known_args(out[len(base):])
    assert not unknown
    assert args.bf16 and args.use_distributed_optimizer and args.use_precision_aware_optimizer
    assert (args.main_grads_dtype, args.exp_avg_dtype, args.exp_avg_sq_dtype) == ("bf16", "fp8", "fp8")
