"""benchmarks/bench_node.py's pieces (benchmarks/common/node.py) on CPU (its runs need GPUs): reading
Megatron's log, one node's rank on one GPU, the two FLOP conventions, the memory layouts Megatron is
given (and accepts), run labels, and the summary of an allocator snapshot."""

import json

import pytest

from benchmarks.common.node import (cache_name, data_flags, layout_flags, loss_flags, megatron_flops_per_step,
                                    model_flops_per_step, parse, parse_log, rank_note, run_label, slug, student_flags,
                                    summarize_memory_snapshot, train_flags, unsharded_optimizer_gib)

# megatron.training's log lines, as printed by a 3-iteration run on an H200 (bench_offload.py)
LOG = """\
 [2026-11-30 11:56:58.358866] iteration        1/       3 | consumed samples:            1 | elapsed time per iteration (ms): 8951.9 | learning rate: 6.666667E-05 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 5440.89 | max allocated: 7168.52 | reserved: 7480.00 | max reserved: 7480.00
 [2026-11-30 11:56:59.263563] iteration        2/       3 | consumed samples:            2 | elapsed time per iteration (ms): 4928.2 | learning rate: 3.333333E-05 |
[Rank 0] (after 2 iterations) memory (MB) | allocated: 5440.89 | max allocated: 7268.52 | reserved: 7480.00 | max reserved: 7480.00
 [2026-11-30 11:57:00.224925] iteration        3/       3 | consumed samples:            3 | elapsed time per iteration (ms): 961.3 | learning rate: 0.000000E+00 |
"""


def test_step_time_skips_the_first_two_lines_and_peak_is_the_largest():
    r = parse_log(LOG)
    # line 1 includes start-up and line 2 averages iterations 1 and 2 (Megatron's first log line
    # does not reset its timers): only iteration 3 is a steady step
    assert r["step_s"] == pytest.approx(0.9613)
    assert r["iteration_s"] == pytest.approx([8.9519, 4.9282, 0.9613])
    assert r["peak_gib"] == pytest.approx(7268.52 / 1024)
    assert not r["oom"]


def test_out_of_memory_is_recognized():
    r = parse_log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 24.55 GiB")
    assert r["oom"] and r["step_s"] is None and r["peak_gib"] is None


def test_cache_and_training_share_the_data_flags(tmp_path):
    opts = parse(["--gpus", "8", "--out", str(tmp_path)])
    flags = data_flags(opts, "/data/random")
    assert flags[flags.index("--global-batch-size") + 1] == "16"  # two micro-batches per GPU
    assert flags[flags.index("--seq-length") + 1] == "32768"
    assert loss_flags("dense", tmp_path) == ["--kd-cache", str(tmp_path), "--kd-impl", "dense"]
    assert loss_flags("ce", None) == ["--kd-ce-impl", "megatron"]
    with pytest.raises(SystemExit):
        parse(["--losses", "fused,bogus"])


def test_packing_reaches_the_cache_build_and_every_run(tmp_path):
    packed = parse(["--packing", "documents", "--document-tokens", "2048", "--out", str(tmp_path),
                    "--also", "--losses ce"])
    plain = parse(["--out", str(tmp_path)])
    reset = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    for config in packed.configs:  # --also inherits the call's data and packing
        assert all(flag in data_flags(config, "/d") for flag in reset)
    assert not any(flag in data_flags(plain, "/d") for flag in reset)
    assert cache_name(packed) != cache_name(plain)  # a packed cache is never reused unpacked
    with pytest.raises(SystemExit):
        parse(["--also", "--packing documents"])  # the packing fixes the cache: one per call


def _last(flags, flag):
    """The value Megatron-LM's parser keeps: the last one given."""
    return flags[len(flags) - flags[::-1].index(flag)]


def test_rank_of_is_one_gpu_with_its_share_of_the_experts(tmp_path):
    opts = parse(["--rank-of", "8", "--out", str(tmp_path)])
    assert (opts.gpus, opts.experts, opts.global_batch_size) == (1, 4, 2)  # 4 of 32 experts, 2 micro-batches
    flags = student_flags(opts)
    assert _last(flags, "--expert-model-parallel-size") == "1" and _last(flags, "--num-experts") == "4"
    for bad in (["--rank-of", "8", "--gpus", "8"], ["--rank-of", "8", "--experts", "8"], ["--rank-of", "5"]):
        with pytest.raises(SystemExit):
            parse([*bad, "--out", str(tmp_path)])


def test_unsharded_optimizer_state_of_a_rank(tmp_path):
    from megatron_kd.megatron.plan import plan_args

    opts = parse(["--rank-of", "8", "--out", str(tmp_path)])
    args, _ = plan_args(train_flags(opts, "/data/random"), 1)
    # 20B: ~1.8 B non-expert parameters x 12 bytes, 7/8 of which the real rank's distributed optimizer shards away
    assert 16 < unsharded_optimizer_gib(args, opts) < 20
    assert "4 of 32 experts, no all-to-all" in rank_note({"rank_of": 8, "experts": 4, "unsharded_optimizer_gib": 17.6})


def test_both_flop_conventions(tmp_path):
    from megatron_kd.megatron.plan import plan_args

    opts = parse(["--rank-of", "8", "--out", str(tmp_path)])
    args, _ = plan_args(train_flags(opts, "/data/random"), 1)
    ours, megatron = model_flops_per_step(args, opts), megatron_flops_per_step(args, opts)
    # the baseline run: 8.03 s per step was 256 TFLOP/s in the benchmark's convention; Megatron counts full
    # causal attention on the window layers too (more) and the gated experts as two matrices (fewer)
    assert ours / 8.03 / 1e12 == pytest.approx(256, abs=1)
    assert megatron / 8.03 / 1e12 == pytest.approx(295, abs=1)
    assert args.num_layers == 24 and args.num_experts == 4  # megatron_flops_per_step left args alone


def test_packed_documents_count_attention_per_document(tmp_path):
    from megatron_kd.megatron.plan import plan_args

    unpacked = parse(["--rank-of", "8", "--out", str(tmp_path)])
    args, _ = plan_args(train_flags(unpacked, "/data/random"), 1)
    flops = {n: model_flops_per_step(args, parse(["--rank-of", "8", "--packing", "documents", "--document-tokens",
                                                  str(n), "--out", str(tmp_path)]))
             for n in (8192, 32768)}
    assert flops[32768] == model_flops_per_step(args, unpacked)  # one document per sample: the same count
    # 12 full layers attend over a quarter of the keys per query: (8192 + 1) / 2 instead of (32768 + 1) / 2
    n, d, seq = args.num_attention_heads, args.kv_channels, args.seq_length
    fewer = 3 * 2 * 2 * n * d * (32768 - 8192) / 2 * seq * 12 * unpacked.global_batch_size
    assert flops[32768] - flops[8192] == pytest.approx(fewer, rel=1e-9)


def test_layout_flags_replace_the_recipes_recompute(tmp_path):
    out = ["--out", str(tmp_path)]
    recipe = parse(out)
    assert "--recompute-granularity" not in student_flags(recipe)  # the recipe's own, replaced by:
    assert layout_flags(recipe) == ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"]
    block = parse([*out, "--recompute", "block:10", "--recompute-modules", "moe_act", "--optimizer", "fused",
                   "--extra", "--timing-log-level 2"])
    assert layout_flags(block) == ["--recompute-granularity", "full", "--recompute-method", "block",
                                   "--recompute-num-layers", "10", "--recompute-modules", "moe_act",
                                   "--kd-fused-adam", "--timing-log-level", "2"]
    selective = parse([*out, "--recompute", "selective", "--recompute-modules", "moe_act,layernorm"])
    assert layout_flags(selective) == ["--recompute-granularity", "selective", "--recompute-modules", "moe_act",
                                       "layernorm", "--moe-grouped-gemm"]
    assert layout_flags(parse([*out, "--recompute", "none"])) == []
    for bad in (["--recompute", "block:0"], ["--recompute", "partial"], ["--recompute", "none", "--recompute-modules",
                                                                          "moe_act"], ["--offload-modules", "moe_act"]):
        with pytest.raises(SystemExit):  # offloading: Megatron's needs Transformer Engine, absent here
            parse([*out, *bad])


def test_megatron_accepts_the_layouts(tmp_path, monkeypatch):
    """Megatron-LM's own validation and TransformerConfig take each layout, and the experts see moe_act."""
    import torch
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args

    from megatron_kd.megatron.flags import megatron_parser
    from megatron_kd.models.experts import recomputes_moe_act
    from tests.fixtures.dist_utils import megatron_cpu_patches
    from tests.fixtures.tiny_gpt_oss import CPU_FLAGS, TINY_ARCH

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # --moe-grouped-gemm asks
    cases = {("block:1", "moe_act"): ("full", "block", True), ("selective", "moe_act"): ("selective", None, True),
             ("full", None): ("full", "uniform", False), ("none", None): (None, None, False)}
    for (recompute, modules), (granularity, method, moe_act) in cases.items():
        options = ["--rank-of", "8", "--out", str(tmp_path), "--recompute", recompute]
        opts = parse(options + (["--recompute-modules", modules] if modules else []))
        flags = [*student_flags(opts), *TINY_ARCH, *CPU_FLAGS, "--vocab-size", "1000", "--tokenizer-type",
                 "NullTokenizer", *layout_flags(opts)]
        args = megatron_parser().parse_args(flags)
        args.rank, args.world_size, args._is_global_batch_size_explicitly_specified = 0, 1, True
        with megatron_cpu_patches():
            validate_args(args, {})
        config = core_transformer_config_from_args(args)
        assert (config.recompute_granularity, config.recompute_method, recomputes_moe_act(config)) == \
            (granularity, method, moe_act), recompute


def test_configurations_get_their_own_labels(tmp_path):
    opts = parse(["--out", str(tmp_path), "--losses", "fused", "--recompute", "block:10", "--recompute-modules",
                  "moe_act", "--also", "--losses fused,ce --recompute full", "--also", "--label mine --optimizer fused"])
    labels = [run_label(loss, c) for c in opts.configs for loss in c.losses.split(",")]
    # each --also starts from the defaults (the recipe's layout, losses fused,ce,dense), not from this call's
    assert labels == ["fused recompute=block:10 modules=moe_act", "fused", "ce", "fused mine", "ce mine",
                      "dense mine"]
    assert all(c.gpus == 8 and c.out == tmp_path.resolve() for c in opts.configs)
    assert slug(labels[0]) == "fused-recompute-block-10-modules-moe-act"
    with pytest.raises(SystemExit):  # the data and the cache are the call's: --also cannot change them
        parse(["--out", str(tmp_path), "--also", "--seq 4096"])


def test_throughput_line_is_read():
    line = (" [2026-12-01 10:00:00.000000] iteration        3/       4 | consumed samples:            6 | elapsed time "
            "per iteration (ms): 8030.0 | throughput per GPU (TFLOP/s/GPU): 295.3 |\n")
    r = parse_log(line * 3)
    assert r["step_s"] == pytest.approx(8.03) and r["megatron_log_tflops_per_gpu"] == pytest.approx(295.3)


def _frames(*names):
    return [{"filename": f"/usr/lib/python3/site-packages/torch/{n}.py", "line": 1, "name": "inner"} for n in ("a",)] + \
        [{"filename": f"/repo/megatron_kd/{n}.py", "line": 7, "name": n} for n in names]


def test_memory_snapshot_summary_between_iterations_and_at_the_peak():
    mib = 2**20
    weights = _frames("param_and_grad_buffer")
    snapshot = {
        "segments": [{"device": 0, "blocks": [
            {"address": 1, "size": 100 * mib, "state": "active_allocated", "frames": weights},  # before the trace
            {"address": 2, "size": 50 * mib, "state": "active_allocated", "frames": _frames("models/experts")},
            {"address": 9, "size": 999 * mib, "state": "inactive", "frames": []}]}],
        "device_traces": [[
            {"action": "alloc", "addr": 2, "size": 50 * mib, "frames": _frames("models/experts")},
            {"action": "alloc", "addr": 3, "size": 300 * mib, "frames": _frames("models/attention")},
            {"action": "alloc", "addr": 4, "size": 200 * mib, "frames": _frames("models/experts")},
            {"action": "free_requested", "addr": 3, "size": 300 * mib, "frames": []},
            {"action": "free_completed", "addr": 3, "size": 300 * mib, "frames": []},
            {"action": "free_completed", "addr": 5, "size": 70 * mib, "frames": []},  # allocated before the trace
            {"action": "free_completed", "addr": 4, "size": 200 * mib, "frames": []}]]}
    s = summarize_memory_snapshot(snapshot)
    assert s["history"] and s["trace_events"] == 7
    assert s["steady"]["allocated_gib"] * 1024 == pytest.approx(150)  # the inactive block is cached, not allocated
    assert s["steady"]["by_category_gib"] == pytest.approx({"weights and main_grad (DDP buffers)": 100 / 1024,
                                                            "MoE (router, dispatch, experts)": 50 / 1024})
    peak = s["peak"]
    assert peak["allocated_gib"] * 1024 == pytest.approx(720) and peak["events_before_snapshot"] == 3
    assert peak["by_category_gib"] == pytest.approx({"attention": 300 / 1024, "MoE (router, dispatch, experts)": 250 / 1024,
                                                     "weights and main_grad (DDP buffers)": 100 / 1024,
                                                     "unknown (no allocation history)": 70 / 1024})
    assert peak["top_sites"][0] == {"gib": 300 / 1024, "blocks": 1, "category": "attention",
                                    "site": "megatron_kd/models/attention.py:7 models/attention"}
    assert len(json.dumps(s)) < 20_000


def test_memory_snapshot_without_history_says_so():
    s = summarize_memory_snapshot({"segments": [{"device": 0, "blocks": [
        {"address": 1, "size": 2**30, "state": "active_allocated", "frames": []}]}], "device_traces": [[]]})
    assert not s["history"] and "not started" in s["note"]
    assert s["steady"]["allocated_gib"] == s["peak"]["allocated_gib"] == 1


def test_all_to_all_estimate_of_a_rank(tmp_path):
    """The bytes a real rank's expert all-to-alls send: 32,768 tokens x top-4 x 2,880 x 2 bytes, 7/8
    of them off the rank, 4 passes per layer (dispatch and combine, forward and backward) plus 2 per
    recomputed layer, 2 micro-batches."""
    from benchmarks.common.node import all_to_all_estimate
    from megatron_kd.megatron.plan import plan_args

    per_pass = 32768 * 4 * 2880 * 2 * 7 / 8
    for recompute, recomputed in (("block:14", 14), ("full", 24), ("none", 0)):
        opts = parse(["--size", "20b", "--rank-of", "8", "--recompute", recompute, "--out", str(tmp_path)])
        (config,) = opts.configs
        args, _ = plan_args([*train_flags(opts, "/d"), *layout_flags(config)], opts.gpus)
        got = all_to_all_estimate(args, opts)
        assert got["all_to_all_gb"] == pytest.approx(per_pass * (4 * 24 + 2 * recomputed) * 2 / 1e9)
        assert got["all_to_all_s"] == pytest.approx(got["all_to_all_gb"] / 450)


# ---------------------------------------------------------------------------------------------
# the one-GPU Llama size: Llama-3.2-3B from Llama-3.1-8B's vocabulary


def test_llama_size_defaults_and_flags(tmp_path):
    from benchmarks.common.node import TOPK, cache_build_args, online_command
    from megatron_kd.megatron.flags import parse_flags

    opts = parse(["--size", "llama3-3b", "--losses", "fused,ce,dense,online", "--out", str(tmp_path)])
    assert (opts.gpus, opts.seq, opts.global_batch_size, opts.recompute) == (1, 8192, 8, "none")
    student = parse_flags(train_flags(opts, "/d"), prog="test")
    assert (student.num_layers, student.hidden_size, student.ffn_hidden_size, student.num_attention_heads,
            student.num_query_groups, student.vocab_size, student.seq_length) == (28, 3072, 8192, 24, 8, 128256, 8192)
    assert not student.untie_embeddings_and_output_weights and student.expert_model_parallel_size == 1
    assert layout_flags(opts) == [] and run_label("online", opts) == "online"  # 3b.sh's layout: no recompute
    cache = cache_build_args(opts, "/d", tmp_path / "teacher", tmp_path / "cache")
    assert _last(cache, "--kd-topk") == str(TOPK) == "100" and _last(cache, "--kd-cache-mode") == "topk"
    assert _last(cache, "--vocab-size") == "128256"
    command = online_command(opts, ["--student-flag"])
    assert command[0] == "--online-teacher" and command[-1] == "--student-flag"
    teacher = parse_flags(command[1].split(), prog="test")  # examples/llama/8b.sh over llama3.sh
    assert (teacher.num_layers, teacher.hidden_size, teacher.ffn_hidden_size, teacher.num_attention_heads,
            teacher.rope_scaling_factor, teacher.untie_embeddings_and_output_weights) == (32, 4096, 14336, 32, 8, True)
    # 65,536 tokens per step: 2 samples at 32K, at least one at 128K
    assert [parse(["--size", "llama3-3b", "--seq", str(s), "--out", str(tmp_path)]).global_batch_size
            for s in (32768, 131072)] == [2, 1]
    for bad in (["--rank-of", "8"], ["--experts", "4"], ["--losses", "online", "--recompute", "plan"],
                ["--recompute", "plan", "--recompute-modules", "moe_act"]):
        with pytest.raises(SystemExit):
            parse(["--size", "llama3-3b", *bad, "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # GPT-OSS has no online teacher here
        parse(["--size", "20b", "--losses", "online", "--out", str(tmp_path)])


def test_dense_model_flops_by_hand(tmp_path):
    """Llama-3.2-3B at 8K, by hand: per token and layer q/k/v (24 + 2 x 8 heads of 128 from 3,072),
    the output projection, scores and values over (8,192 + 1) / 2 keys, the gated MLP's three
    3,072 x 8,192 matrices; the tied logits; x 3 for backward; 8 samples."""
    from megatron_kd.megatron.plan import plan_args

    opts = parse(["--size", "llama3-3b", "--out", str(tmp_path)])
    args, _ = plan_args(train_flags(opts, "/d"), opts.gpus)
    h, seq = 3072, 8192
    layer = 2 * h * (24 + 2 * 8) * 128 + 2 * 24 * 128 * h + 2 * 2 * 24 * 128 * (seq + 1) / 2 + 3 * 2 * h * 8192
    per_step = 3 * (28 * layer + 2 * h * 128256) * seq * 8
    assert model_flops_per_step(args, opts) == pytest.approx(per_step, rel=1e-12)
    assert per_step / 1e12 == pytest.approx(1540.3, abs=0.1)
    # Megatron-LM counts a dense SwiGLU model the same, but for its s / 2 keys per query
    half_key = 3 * 2 * 2 * 24 * 128 * 0.5 * 28 * seq * 8
    assert megatron_flops_per_step(args, opts) == pytest.approx(per_step - half_key, rel=1e-9)


def test_plan_layout_is_the_long_context_recipe(tmp_path):
    """--recompute plan at 128K with bf16-sr-8bit takes what plan --search ranks first, the layout
    examples/llama/3b_128k.sh records; Megatron's CE fits no layout there; at 32K no recompute. On an
    80 GB card (--gpu-memory 80GB, the H100 the 64K / 128K rows ran on): every layer at 128K."""
    from benchmarks.common.node import SIZES, Recipe, planned_layout

    def planned(seq, loss, *memory):
        opts = parse(["--size", "llama3-3b", "--seq", str(seq), "--recompute", "plan", "--optimizer", "bf16-sr-8bit",
                      "--out", str(tmp_path), *memory])
        return planned_layout([*train_flags(opts, "/d"), *layout_flags(opts)], opts.gpus, loss, opts.gpu_memory)

    recipe = Recipe(size="3b_128k.sh", family="llama", arch="llama3.sh", prefix="LLAMA3").flags()
    assert recipe[:recipe.index("--tensor-model-parallel-size")] == SIZES["llama3-3b"].recipe.flags(layout=False)
    layout = planned(131072, "fused")
    assert layout.recompute_flags() == ["--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "21"]
    assert all(flag in recipe for flag in layout.recompute_flags()) and _last(recipe, "--seq-length") == "131072"
    assert _last(recipe, "--kd-optimizer") == "bf16-sr-8bit"
    assert planned(131072, "ce") is None
    assert planned(32768, "fused").recompute_flags() == []
    assert planned(131072, "fused", "--gpu-memory", "80GB").recompute_flags() == [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def test_llama_table_has_tokens_per_second_and_the_origins_peaks():
    from benchmarks.common.node import markdown

    results = {"size": "llama3-3b", "layers": 28, "experts": None, "seq": 8192, "gpus": 1, "global_batch_size": 8,
               "model_tflop_per_step": 1540.3, "megatron_tflop_per_step": 1540.3,
               "origin_gb": {"fused": 58.3, "online": 102.8}, "runs": {
                   "fused": {"loss": "fused", "rc": 0, "step_s": 4.0, "tokens_per_s_per_gpu": 16384.0,
                             "tflops_per_gpu": 385.1, "megatron_tflops_per_gpu": 385.1, "peak_gib": 70.0,
                             "plan_gib": 77.7},
                   "online": {"loss": "online", "rc": 0, "step_s": 6.0, "tokens_per_s_per_gpu": 10922.7,
                              "tflops_per_gpu": 256.7, "peak_gib": 110.0, "plan_gib": None},
                   "ce recompute=plan": {"loss": "ce", "rc": None, "step_s": None, "plan_gib": None, "no_fit": True}}}
    table = markdown(results)
    assert table.startswith("# llama3-3b student, 28 layers, 8,192 tokens, 1 GPUs, global batch 8")
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}
    assert rows["fused"].endswith("| 4.00 | 16,384 | 385 | 385 | 70.0 | 77.7 | +11.0% | 58.3 |")
    assert rows["online"].endswith("| 6.00 | 10,923 | 257 |  | 110.0 |  |  | 102.8 |")
    assert "no layout that fits" in rows["ce recompute=plan"]
