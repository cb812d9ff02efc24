"""``megatron-kd plan`` refuses what Megatron cannot run, one line each, and never prints a negative term.

1. each of Megatron's layout rules (positive sizes, TP x PP x CP | GPUs, EP | experts,
   expert-TP x EP x PP | GPUs, heads and query groups by TP, layers by PP, global batch by
   micro-batch x DP, sequence by 2 x CP, sequence by TP under sequence parallelism, MoE under TP
   needs sequence parallelism) and the model sizes: one FlagError line, exit 2
2. where Megatron-LM's own validate_args runs on CPU (TP = CP = 1), it accepts and refuses the
   same layouts as layout_error
3. every layout --search lists passes layout_error, and every term of every estimate is >= 0
"""

import contextlib
import copy
import io
import warnings

import pytest

from megatron_kd.cli import main
from megatron_kd.megatron.plan import Layout, candidate_layouts, estimate, layout_error, plan_args
from megatron_kd.megatron.flags import parse_flags

RUN = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096",
       "--vocab-size", "32000", "--global-batch-size", "8"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2"]


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--gpus", "-8"], "--gpus must be >= 1, got -8"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1, got 0"),
    (["--seq-length", "-4096"], "--seq-length must be >= 1, got -4096"),
    (["--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
    (["--num-layers", "0"], "--num-layers must be >= 1, got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--hidden-size", "250"], "--num-attention-heads 8 does not divide --hidden-size 250"),
    (["--gpu-memory", "0GB"], "--gpu-memory must be > 0"),
    (["--gpu-memory", "1.2.3GB"], "not a size: '1.2.3GB'"),
    (["--kd-topk", "0"], "--kd-topk must be an integer >= 1, got 0"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (["--tensor-model-parallel-size", "2", "--gpus", "3"],
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 x --context-parallel-size 1 = 2 does not "
     "divide --gpus 3"),
    (["--context-parallel-size", "3", "--gpus", "6", "--global-batch-size", "2"],
     "--seq-length 4096 is not a multiple of 2 x --context-parallel-size 3"),
    (["--tensor-model-parallel-size", "3", "--gpus", "3", "--global-batch-size", "3"],
     "--tensor-model-parallel-size 3 does not divide --num-attention-heads 8"),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "2"],
     "--tensor-model-parallel-size 4 does not divide --num-query-groups 2"),
    (["--pipeline-model-parallel-size", "8"], "--pipeline-model-parallel-size 8 does not divide --num-layers 4"),
    (["--global-batch-size", "12"],
     "--global-batch-size 12 is not a multiple of --micro-batch-size 1 x data-parallel size 8 (= --gpus 8 / 1)"),
    (["--tensor-model-parallel-size", "8", "--sequence-parallel", "--seq-length", "4100"],
     "--seq-length 4100 (per context-parallel rank 4100) is not a multiple of --tensor-model-parallel-size 8"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    ([*MOE, "--expert-model-parallel-size", "3", "--gpus", "6", "--global-batch-size", "6"],
     "--expert-model-parallel-size 3 does not divide --num-experts 8"),
    ([*MOE, "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"],
     "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 8 x --pipeline-model-parallel-size 2 = 16 does "
     "not divide --gpus 8"),
    ([*MOE, "--tensor-model-parallel-size", "2"], "MoE under --tensor-model-parallel-size 2 needs --sequence-parallel"),
    ([*MOE, "--moe-router-topk", "9"], "--moe-router-topk 9 is more than --num-experts 8"),
])
def test_plan_refuses_what_megatron_cannot_run(flags, message, capsys):
    assert main(["plan", *RUN, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megatron-kd: error: ") and message in err, err


def _megatron_refuses(flags: list[str], gpus: int) -> bool:
    from megatron.training.arguments import validate_args

    args = parse_flags(["--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--train-iters", "1",
                        "--max-position-embeddings", "4096", *flags])
    args.rank, args.world_size = 0, gpus
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_args(copy.deepcopy(args), {})
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("flags, gpus", [
    ([], 8), (["--global-batch-size", "6"], 8), (["--pipeline-model-parallel-size", "2"], 8),
    (["--pipeline-model-parallel-size", "3"], 6), (["--pipeline-model-parallel-size", "2"], 6),
    ([*MOE, "--expert-model-parallel-size", "8"], 8), ([*MOE, "--expert-model-parallel-size", "3"], 6),
    ([*MOE, "--expert-model-parallel-size", "16"], 8), (["--micro-batch-size", "2"], 8),
])
def test_layout_rules_agree_with_megatron_validation(flags, gpus):
    run = [*RUN, *flags]  # later flags win
    try:
        plan_args(run, gpus)
        ours = False
    except ValueError:
        ours = True
    assert ours == _megatron_refuses(run, gpus), (flags, gpus)


@pytest.mark.parametrize("extra, gpus, local", [([], 8, False), (MOE, 8, False), (MOE, 8, True), (MOE, 6, False)])
def test_search_lists_only_valid_layouts_and_terms_are_never_negative(extra, gpus, local):
    args, layout = plan_args([*RUN, *extra, "--global-batch-size", str(gpus * 2)], gpus)
    layouts = list(candidate_layouts(args, gpus, local_spec=local))
    assert layouts and layout in layouts
    for lay in layouts:
        assert layout_error(args, lay, gpus, sequence_parallel=not local) is None, lay
        for loss in ("fused", "ce", "dense"):
            plan = estimate(args, lay, gpus=gpus, loss=loss)
            assert all(v >= 0 for v in plan.gpu_bytes.values()) and plan.host_bytes >= 0, (lay, plan)
    if local and extra:  # megatron-core's local spec: MoE only without TP (no sequence parallelism there)
        assert all(lay.tp == 1 for lay in layouts)


def test_layout_error_names_the_first_broken_rule():
    args, _ = plan_args(RUN, 8)
    assert layout_error(args, Layout(tp=2, pp=2), 8) is None
    assert layout_error(args, Layout(tp=3), 8).startswith("--tensor-model-parallel-size 3 x")
