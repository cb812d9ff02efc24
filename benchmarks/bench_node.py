"""GPT-OSS and Llama students at full depth through ``megatron-kd train`` on one node: step time,
tokens/s and model TFLOP/s per GPU and peak memory per loss path and memory layout, against
``megatron-kd plan``.

    python -m benchmarks.bench_node --size 20b --gpus 8 --out runs/node20b      # fused, ce, dense
    python -m benchmarks.bench_node --help      # the options, what runs and what is reported

The options, each run's flags, reading Megatron's log and the report are benchmarks/common/node.py's
(its docstring is the --help text, with the measured recipes); this file runs them: the data, the
teacher cache, one ``megatron-kd train`` per (loss, configuration), OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import json

from benchmarks.common.node import (ONLINE_ENTRY, SIZES, all_to_all_estimate, build_cache, layout_flags, loss_flags,
                                    markdown, megatron_flops_per_step, memory_snapshot_summary, model_flops_per_step,
                                    online_command, parse, parse_log, plan_gib, plan_static_gib, planned_layout,
                                    rank_note, run_label, slug, torchrun, train_flags, unsharded_optimizer_gib,
                                    write_data)


def main(argv=None):
    opts = parse(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    results_path = opts.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.setdefault("runs", {})
    data_prefix = write_data(opts)
    student = train_flags(opts, data_prefix)
    from megatron_kd.megatron.plan import plan_args

    args, _ = plan_args(student, opts.gpus)
    size = SIZES[opts.size]
    results.update(size=opts.size, layers=args.num_layers, experts=args.num_experts, seq=opts.seq, gpus=opts.gpus,
                   global_batch_size=opts.global_batch_size, iters=opts.iters, rank_of=opts.rank_of,
                   packing=opts.packing, document_tokens=opts.document_tokens,
                   origin_gb=size.origin_gb if opts.seq == size.origin_seq else {},
                   model_tflop_per_step=model_flops_per_step(args, opts) / 1e12,
                   megatron_tflop_per_step=megatron_flops_per_step(args, opts) / 1e12)
    if opts.rank_of:
        results["unsharded_optimizer_gib"] = unsharded_optimizer_gib(args, opts)
        print(rank_note(results), flush=True)
    runs = [(loss, config) for config in opts.configs for loss in config.losses.split(",")]
    cache = build_cache(opts, data_prefix) if {"fused", "dense"} & {loss for loss, _ in runs} else None
    if cache is not None:
        results["cache"] = cache.with_name(cache.name + ".done").read_text().strip()
    for loss, config in runs:
        label = run_label(loss, config)
        if results["runs"].get(label, {}).get("rc") == 0:
            continue
        planned = planned_layout([*student, *layout_flags(config)], opts.gpus, loss, opts.gpu_memory) \
            if config.recompute == "plan" else None
        if config.recompute == "plan" and planned is None:
            results["runs"][label] = {"loss": loss, "rc": None, "step_s": None, "plan_gib": None, "no_fit": True}
            print(f"{label}: megatron-kd plan --search finds no layout of this run that fits {opts.gpu_memory}", flush=True)
            continue
        flags = [*student, *layout_flags(config, planned), *loss_flags(loss, cache)]
        snapshot = opts.out / "work" / f"snapshot_{slug(label)}.pickle"
        if config.memory_snapshot:
            snapshot.unlink(missing_ok=True)
            flags += ["--record-memory-history", "--memory-snapshot-path", str(snapshot)]
        log = opts.out / f"train_{slug(label)}.log"
        if loss == "online":
            rc, text = torchrun(opts, online_command(opts, flags), log, module=ONLINE_ENTRY)
        else:
            rc, text = torchrun(opts, ["train", *flags], log)
        r = {"loss": loss, "layout_flags": layout_flags(config, planned), "rc": rc, **parse_log(text),
             "plan_gib": plan_gib(flags, opts.gpus, loss)}
        if planned is not None:
            r["plan_layout"] = planned.describe()
        if opts.rank_of:
            r.update(all_to_all_estimate(plan_args(flags, opts.gpus)[0], opts))
        if r["step_s"]:
            r["tokens_per_s_per_gpu"] = opts.global_batch_size * opts.seq / opts.gpus / r["step_s"]
            r["tflops_per_gpu"] = results["model_tflop_per_step"] / opts.gpus / r["step_s"]
            r["megatron_tflops_per_gpu"] = results["megatron_tflop_per_step"] / opts.gpus / r["step_s"]
        if config.memory_snapshot:
            summary = memory_snapshot_summary(snapshot, plan_static_gib(flags, opts.gpus))
            if summary is not None:
                summary["logged_peak_gib"] = r["peak_gib"]
                path = opts.out / f"memory_{slug(label)}.json"
                path.write_text(json.dumps(summary, indent=1))
                r["memory_snapshot"] = path.name
        results["runs"][label] = r
        print(f"{label}: {json.dumps(r)}", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    results_path.write_text(json.dumps(results, indent=1))
    (opts.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
