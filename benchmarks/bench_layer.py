"""Where one GPT-OSS-20B layer's time goes at 32K tokens: a window layer and a full layer, bf16, one GPU.

    python -m benchmarks.bench_layer --out runs/layer                       # H200, < 2 min
    python -m benchmarks.bench_layer --out runs/layer --extra "--recompute-granularity selective \\
        --recompute-modules moe_act --moe-grouped-gemm"                     # with a recompute option
    python -m benchmarks.bench_layer --out runs/layer-mcore --megatron-ops rope,permutation   # megatron-core's RoPE
                                                                            # and token permutation instead
    python -m benchmarks.bench_layer --tiny --out /tmp/layer                # CPU smoke run (CI)

The model is examples/gpt_oss's 20B recipe at its real width (``benchmarks.common.gpt_oss.model_flags``) with two
layers (layer 0 has the 128-key window, layer 1 full causal attention with sinks) and ``--experts``
local experts (default 4, top-4: one rank of the 8-GPU node), parsed by Megatron-LM's parser and
built by ``megatron-kd train``'s own ``model_provider``, wrapped as training wraps it (Float16Module,
Megatron's DDP with fp32 ``main_grad``). One step is GPTModel's forward on one micro-batch of
``--seq`` tokens, through its ``output_processor`` hook returning the final hidden states (no
logits: the loss has its own benchmark, bench_loss.py), and backward from a random gradient. So
the step is embedding + 2 layers + final norm, forward and backward, as a training step runs them.

Measured, after two warm-up steps (they compile flex attention and the experts' activation):
  step_ms / forward_ms  CUDA-event medians of ``--reps`` steps (forward alone: the same forward,
                        graph kept, then dropped)
  modules_forward_ms    forward time per module (CUDA events from forward hooks, one extra pass):
                        per layer the norms, attention (qkv, core attention, projection; the rest of
                        attention is RoPE and reshapes), the MoE layer (router, experts; the rest is
                        the token dispatcher's permutation and combine)
  saved_gib             what forward keeps for backward per module, counted with saved_tensors_hooks
                        (parameters excluded, each storage once), in a separate pass at the end
  peak_gib              peak allocated memory of a step above the memory before it
  top_ops               torch.profiler's operators and kernels by self device time, for one step and
                        for one forward; the same as text tables in profile_step.txt / profile_forward.txt
Written to ``--out``: layer_profile.json, the two tables, and with ``--trace`` a Chrome trace of one step.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

GIB = 2**30
TOP_OPS = 60


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--experts", type=int, default=4, help="local experts (top-4 routing over them)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--attention", default="auto",
                   help="core attention's impl (models/attention.py ATTENTION_IMPLS): one for both layers, or "
                        "per kind of layer as window:IMPL,full:IMPL (e.g. window:flex,full:cudnn)")
    p.add_argument("--extra", default="", help="more Megatron-LM flags (e.g. recompute options), one string")
    p.add_argument("--megatron-ops", default="", metavar="rope,permutation",
                   help="run megatron-core's own functions instead of megatron_kd's kernels for these (the kernels' "
                        "win is the difference of the two rows)")
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace of one step")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run at toy sizes")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    return p.parse_args(argv)


def layer_flags(opts) -> list[str]:
    from benchmarks.common.gpt_oss import model_flags

    flags = model_flags(argparse.Namespace(layers=2, seq=opts.seq, ep=1, tiny=opts.tiny))
    if not opts.tiny:
        flags += ["--num-experts", str(opts.experts)]
    return flags + shlex.split(opts.extra)


def timed_modules(model) -> dict[str, torch.nn.Module]:
    """The modules whose forward is timed and whose saved tensors are counted, by display name."""
    gpt = model.module.module  # DDP -> Float16Module -> GPTModel
    named = {"embedding": gpt.embedding}
    if getattr(gpt, "rotary_pos_emb", None) is not None:
        named["rotary embedding"] = gpt.rotary_pos_emb
    for i, layer in enumerate(gpt.decoder.layers):
        kind = "window" if getattr(layer.self_attention.core_attention, "window", None) else "full"
        prefix = f"layer {i} ({kind})"
        named[prefix] = layer
        for name in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
            named[f"{prefix} / {name}"] = getattr(layer, name)
        for name in ("linear_qkv", "core_attention", "linear_proj"):
            named[f"{prefix} / self_attention / {name}"] = getattr(layer.self_attention, name)
        for name in ("router", "experts"):
            if hasattr(layer.mlp, name):
                named[f"{prefix} / mlp / {name}"] = getattr(layer.mlp, name)
    if getattr(gpt.decoder, "final_layernorm", None) is not None:
        named["final norm"] = gpt.decoder.final_layernorm
    return named


class ForwardTimes:
    """Forward time per module: CUDA events (wall clock on CPU) recorded by forward hooks."""

    def __init__(self, modules: dict[str, torch.nn.Module], cuda: bool):
        self.cuda, self.spans, self.open, self.handles = cuda, defaultdict(list), {}, []
        for name, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._start(name)))
            self.handles.append(module.register_forward_hook(lambda m, a, o, name=name: self._stop(name)))

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, name):
        self.open[name] = self._now()

    def _stop(self, name):
        self.spans[name].append((self.open.pop(name), self._now()))

    def milliseconds(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {n: sum(a.elapsed_time(b) for a, b in spans) for n, spans in self.spans.items()}
        return {n: sum(b - a for a, b in spans) * 1e3 for n, spans in self.spans.items()}

    def remove(self):
        for h in self.handles:
            h.remove()


def with_residuals(ms: dict[str, float]) -> dict[str, float]:
    """Adds what a module spends outside its timed children: attention's RoPE and reshapes, the MoE
    layer's token dispatch (permutation and combine)."""
    out = dict(ms)
    for name in ms:
        if name.endswith("/ self_attention"):
            parts = [f"{name} / {c}" for c in ("linear_qkv", "core_attention", "linear_proj")]
            out[f"{name} / rest (RoPE, reshapes)"] = ms[name] - sum(ms.get(p, 0.0) for p in parts)
        if name.endswith("/ mlp") and f"{name} / experts" in ms:
            parts = [f"{name} / {c}" for c in ("router", "experts")]
            out[f"{name} / rest (token dispatch: permute, combine)"] = ms[name] - sum(ms.get(p, 0.0) for p in parts)
    return out


def saved_bytes_by_module(model, modules: dict[str, torch.nn.Module], forward) -> dict[str, float]:
    """GiB that forward saves for backward, attributed to the innermost timed module running when the
    tensor is saved (parameters excluded; each storage counted once, where it is first saved)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, saved = ["(outside the timed modules)"], set(), defaultdict(int)
    handles = []

    def leave(module, args, output):
        stack.pop()  # returns None: a forward hook's return value would replace the output

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(module.register_forward_hook(leave))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[stack[-1]] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        del out
    finally:
        for h in handles:
            h.remove()
    return {name: b / GIB for name, b in sorted(saved.items(), key=lambda kv: -kv[1])}


def top_ops(prof, cuda: bool) -> list[dict]:
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:TOP_OPS]
    return [{"name": e.key, "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3,
             "device_ms": e.device_time_total / 1e3, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in events]


def profile(fn, cuda: bool, out: Path, name: str, trace: bool) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    (out / f"profile_{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS))
    if trace:
        prof.export_chrome_trace(str(out / f"trace_{name}.json"))
    return top_ops(prof, cuda)


def use_megatron_ops(names: str) -> None:
    """Point megatron-core's callers back at its own functions (``build_gpt_model`` installed ours)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for name in filter(None, names.split(",")):
        if name == "rope":
            attention.apply_rotary_pos_emb = rope_utils.apply_rotary_pos_emb
        elif name == "permutation":
            token_dispatcher.permute, token_dispatcher.unpermute = moe_utils.permute, moe_utils.unpermute
        else:
            raise SystemExit(f"--megatron-ops {names!r}: {name!r} is not one of rope, permutation")


def attention_impls(spec: str) -> dict[str, str]:
    """``--attention``'s value -> {"window": impl, "full": impl}."""
    if ":" not in spec:
        return {"window": spec, "full": spec}
    impls = dict(part.split(":", 1) for part in spec.split(","))
    if sorted(impls) != ["full", "window"]:
        raise SystemExit(f"--attention {spec!r}: name both kinds of layer, window:IMPL,full:IMPL")
    return impls


def median_ms(fn, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(opts, device):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import model_provider
    from megatron_kd.models.experts import recomputes_moe_act

    cuda = device.type == "cuda"
    args = parse_megatron_args(layer_flags(opts))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    if cuda:
        model_parallel_cuda_manual_seed(1234)
    module = model_provider().to(device)
    use_megatron_ops(opts.megatron_ops)
    config = module.config
    impls = attention_impls(opts.attention)
    for layer in module.decoder.layers:
        attention = layer.self_attention.core_attention
        attention.impl = impls["window" if attention.window else "full"]
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    Float16Module(config, module))
    vocab, h = args.padded_vocab_size, args.hidden_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, opts.seq), generator=gen).to(device)
    positions = torch.arange(opts.seq, device=device).unsqueeze(0)
    d_out = torch.randn(opts.seq, 1, h, generator=gen).to(device)

    def forward():
        return model(tokens, positions, None, output_processor=lambda hidden_states, **_: hidden_states)

    def step():
        forward().backward(d_out)
        model.zero_grad_buffer()

    for _ in range(2):  # compiles flex attention and the experts' activation for these shapes
        step()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "seq": opts.seq,
               "experts": args.num_experts, "topk": args.moe_router_topk, "hidden": h,
               "moe_act_recompute": recomputes_moe_act(config), "recompute_granularity": config.recompute_granularity,
               "attention": opts.attention, "megatron_ops": opts.megatron_ops, "extra": opts.extra,
               "step_ms": median_ms(step, opts.reps, cuda)}
    if cuda:
        results["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / GIB
    results["forward_ms"] = median_ms(lambda: forward(), opts.reps, cuda)
    modules = timed_modules(model)
    timer = ForwardTimes(modules, cuda)
    forward()
    results["modules_forward_ms"] = with_residuals(timer.milliseconds())
    timer.remove()
    results["top_ops_step"] = profile(step, cuda, opts.out, "step", opts.trace)
    results["top_ops_forward"] = profile(lambda: forward(), cuda, opts.out, "forward", False)
    try:  # last: the hooks may make torch.compile trace the compiled regions again
        results["saved_gib"] = saved_bytes_by_module(model, modules, forward)
    except RuntimeError as e:  # torch.compile refusing saved-tensor hooks: say so, keep the rest
        results["saved_gib"] = {"error": str(e).splitlines()[0][:300]}
    (opts.out / "layer_profile.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if not k.startswith("top_ops")}, indent=1))
    print(f"top ops of one step: {opts.out / 'profile_step.txt'}")


def main(argv=None):
    opts = parse(argv)
    if opts.tiny:
        opts.seq, opts.reps = 64, 2
    opts.out.mkdir(parents=True, exist_ok=True)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1")):
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available() and not opts.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from megatron_kd.distributed import init_process_group
    init_process_group("nccl" if cuda else "gloo")
    try:
        if cuda:
            run(opts, device)
        else:  # megatron-core on the CPU through the test harness's patches
            from tests.fixtures.dist_utils import megatron_cpu_patches

            with megatron_cpu_patches():
                run(opts, device)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
