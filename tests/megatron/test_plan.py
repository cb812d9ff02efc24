"""``megatron-kd plan`` against memory measured on H200s (benchmarks/memory_measurements.json), and
what it says of the GPT-OSS recipes on one 8-GPU node.

1. every full-depth peak measured (one rank of the 20B node, optimizer step included) is within 10%
   of the plan of the flags the benchmark passed
2. the 20B recipe fits one 8 x 141 GB node with the fused loss; its dense-KD variant does not fit
   there without recompute
3. the optimizer's CPU offload: host and GPU memory within 10% of a measured run (Megatron's hybrid
   optimizer keeps fp32 state on the host whatever the precision-aware dtypes say)
4. the 120B recipe fits one node with its optimizer on the GPUs (--kd-optimizer bf16-sr-8bit: bf16
   gradients, 2.03 bytes of state per parameter, the non-expert part sharded over DP 8) and no host
   memory; with Megatron's default state it does not fit, and --search finds no one-node layout
5. the CLI prints the table; bad flags are one line
6. the parameter count of the whole model (``model_parameters``, which the CPU demo asks too): the
   released GPT-OSS sizes from each recipe, whatever its layout
"""

import json
from pathlib import Path

import pytest

from benchmarks.common.offload import MODEL_FLAGS, OFFLOAD_FLAGS
from megatron_kd.cli import main
from megatron_kd.megatron.flags import megatron_parser
from megatron_kd.megatron.plan import GIB, Layout, estimate, model_parameters, plan_args
from megatron_kd.optim.megatron import expand_optimizer_flags, optimizer_memory
from tests.fixtures.tiny_gpt_oss import recipe_flags

ROOT = Path(__file__).parents[2]
NODE = 141e9


def _args(*flags):
    args, unknown = megatron_parser().parse_known_args(expand_optimizer_flags(list(flags)))
    assert not unknown
    args.padded_vocab_size = 201088 if args.tensor_model_parallel_size == 1 else 201728
    return args


@pytest.mark.parametrize("record", json.loads((ROOT / "benchmarks" / "memory_measurements.json").read_text())["full_depth"],
                         ids=lambda r: f"{r['size']}-{r.get('seq', 32768)}-{r['loss']}-{r['recompute']}-{r['optimizer']}")
def test_full_depth_peaks_within_10_percent(record):
    """One rank of the 20B or 120B node at full depth (bench_node --rank-of 8), or the one-GPU Llama
    student: the plan of the very flags the benchmark passed, optimizer step included, against the
    measured peak."""
    from benchmarks.common import node

    argv = ["--size", record["size"], "--recompute", record["recompute"], "--optimizer", record["optimizer"]]
    if record.get("rank_of", 8):
        argv += ["--rank-of", str(record.get("rank_of", 8))]
    if "seq" in record:
        argv += ["--seq", str(record["seq"])]
    if record["recompute_modules"]:
        argv += ["--recompute-modules", ",".join(record["recompute_modules"])]
    opts = node.parse([*argv, "--out", "/nonexistent/plan-check"])
    (config,) = opts.configs
    flags = [*node.train_flags(opts, "/nonexistent/data"), *node.layout_flags(config),
             *node.loss_flags(record["loss"], Path("/nonexistent/cache"))]
    planned = node.plan_gib(flags, opts.gpus, record["loss"])
    assert abs(planned - record["peak_gib"]) <= 0.10 * record["peak_gib"], (planned, record)


def _recipe(size, *extra):
    return _args(*recipe_flags(size), "--global-batch-size", "64", "--bf16", *extra)


def _layout(args):
    return Layout(tp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
                  recompute=args.recompute_granularity == "full")


def test_20b_recipe_fits_one_node():
    args = _recipe("20b")
    fused = estimate(args, _layout(args), gpus=8)
    assert fused.total < NODE and fused.host_bytes == 0
    no_recompute = Layout(ep=8)
    assert estimate(args, no_recompute, gpus=8, loss="dense").total > NODE


def test_optimizer_offload_matches_measured():
    measured = json.loads((ROOT / "benchmarks" / "memory_measurements.json").read_text())["optimizer_offload"]
    base, offloaded = measured["runs"]
    for flags, run in (([], base), (OFFLOAD_FLAGS, offloaded)):
        args, unknown = megatron_parser().parse_known_args([*MODEL_FLAGS, *flags])
        assert not unknown
        args.padded_vocab_size, args.kv_channels = 32768, args.hidden_size // args.num_attention_heads  # as validated
        plan = estimate(args, Layout(), gpus=1)
        assert sum(plan.params.values()) == pytest.approx(measured["parameters"], rel=0.01)
        state = plan.gpu_bytes["weights"] + plan.gpu_bytes["gradients"] + plan.gpu_bytes["optimizer"]
        assert state / GIB == pytest.approx(run["gpu_allocated_gib"], rel=0.10), flags
    host_growth = (offloaded["peak_rss_gib"] - base["peak_rss_gib"]) * GIB
    assert plan.host_bytes == pytest.approx(host_growth, rel=0.10)


def test_120b_recipe_fits_one_node_with_its_optimizer_on_the_gpus():
    args = _recipe("120b")
    assert args.kd_optimizer == "bf16-sr-8bit" and not args.optimizer_cpu_offload
    plan = estimate(args, _layout(args), gpus=8)
    assert plan.total < NODE and plan.host_bytes == 0
    dense, experts = plan.params["non-expert"], plan.params["expert"]
    memory = optimizer_memory("bf16-sr-8bit")
    assert plan.gpu_bytes["gradients"] == 2 * (dense + experts) == memory.gradient * (dense + experts)
    # the non-expert state sharded over the 8 data-parallel ranks, the experts' not (expert-DP 1)
    assert plan.gpu_bytes["optimizer"] == pytest.approx(memory.state * (dense / 8 + experts))
    assert memory.state == pytest.approx(2.03, abs=0.01)
    # Megatron's default state (fp32 master weights and moments, fp32 gradients) does not fit
    default = _recipe("120b", "--kd-optimizer", "megatron")
    assert estimate(default, _layout(default), gpus=8).total > NODE


def test_120b_with_megatrons_default_optimizer_has_no_one_node_layout(capsys):
    flags = [*recipe_flags("120b"), "--global-batch-size", "64", "--bf16", "--vocab-size", "201088",
             "--kd-optimizer", "megatron"]
    assert main(["plan", *flags, "--search"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "no layout fits" in out


def test_plan_cli(capsys):
    flags = [*recipe_flags("120b"), "--global-batch-size", "64", "--bf16", "--vocab-size", "201088"]
    assert main(["plan", *flags, "--gpus", "8", "--gpu-memory", "141GB", "--host-memory", "2TB"]) == 0
    out = capsys.readouterr().out
    assert "-> fits" in out and "DOES NOT FIT" not in out and "optimizer" in out and "loss paths" in out
    assert main(["plan", *flags, "--no-optimizer-cpu-offload-flag"]) == 2
    assert main(["plan", "--num-layers", "2"]) == 2
    assert "plan needs" in capsys.readouterr().err


@pytest.mark.parametrize("size, global_batch, experts", [("120b", 64, 128), ("120b_e64", 16, 64)])
def test_120b_recipes_are_the_layout_plan_search_ranks_first(size, global_batch, experts):
    """examples/gpt_oss/120b.sh and 120b_e64.sh (64 of the teacher's 128 experts) fit one node with
    the optimizer on the GPUs, each in the layout --search lists first for its flags."""
    from megatron_kd.megatron.plan import candidate_layouts, step_cost

    flags = [*recipe_flags(size), "--global-batch-size", str(global_batch), "--bf16", "--vocab-size", "201088"]
    args, layout = plan_args(flags, 8)
    plan = estimate(args, layout, gpus=8)
    assert args.num_experts == experts and args.num_layers == 36 and plan.total < NODE and plan.host_bytes == 0
    fits = [p for p in (estimate(args, lay, gpus=8) for lay in candidate_layouts(args, 8, local_spec=True))
            if p.total <= NODE]
    best = min(fits, key=lambda p: (step_cost(args, p.layout, 8), p.total))
    assert best.layout == layout, (best.layout.describe(), layout.describe())


@pytest.mark.parametrize("size, released", [("20b", 20.91e9), ("120b", 116.83e9)])
def test_model_parameters_are_the_released_gpt_oss_sizes(size, released):
    """The whole model of a recipe laid out over 8 GPUs (EP 8): GPT-OSS as released (OpenAI's model
    card: 20.91 B and 116.83 B parameters). Megatron-LM's estimator leaves out the linear biases:
    the count is a little under."""
    args, layout = plan_args([*recipe_flags(size), "--global-batch-size", "64", "--bf16", "--vocab-size", "201088"], 8)
    assert layout.ep == 8
    assert model_parameters(args) == pytest.approx(released, rel=1e-3) and model_parameters(args) < released
