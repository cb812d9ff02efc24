"""The teacher pass timed end to end (``python -m benchmarks.bench_teacher_topk --pass-samples``, whose
docstring says what it measures): forward, top-K or draws, encode and store for each codec and number
of store workers against the teacher's logits forwards, optionally under a chat loss mask and torch's
profiler.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def answer_mask(seq: int, fraction: float, span_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[seq] int64 loss mask of alternating prompt (0) and answer (1) spans, the answer spans holding
    about ``fraction`` of the tokens (bench_teacher_topk's ``--answer-fraction``)."""
    mask, at, answer = torch.zeros(seq, dtype=torch.int64), 0, False
    while at < seq:
        mean = span_tokens * (fraction if answer else 1 - fraction)
        length = max(1, int(torch.empty(1).exponential_(1 / mean, generator=gen)))
        mask[at:at + length] = int(answer)
        at, answer = at + length, not answer
    return mask


def _writer_of(codec: str, path, *, vocab: int, k: int, seq: int, n: int, rows_per_shard=None):
    from megatron_kd.cache import CacheWriter
    from megatron_kd.cache.encodings import SAMPLED_COUNTS_V1

    meta = {"mode": "sampled", "sampled_draws": k} if codec == SAMPLED_COUNTS_V1 else None
    return CacheWriter(path, vocab_size=vocab, topk=k, seq_length=seq, num_samples=n, codec=codec, metadata=meta,
                       rows_per_shard=rows_per_shard)


def time_teacher_pass(model, args, vocab: int, *, logits_forward_ms: float):
    """The teacher pass end to end (forward, top-K or draws, encode, store) against N logits forwards."""
    import tempfile
    import time

    from megatron_kd.cache.encodings import SAMPLED_COUNTS_V1
    from megatron_kd.cache.write_behind import default_workers
    from megatron_kd.ops.teacher import sample_row_keys, vocab_parallel_sample, vocab_parallel_topk
    from megatron_kd.teacher import CaptureConfig, MegatronTeacher, capture_teacher

    s, lengths = args.seq_length, args.pass_samples
    counts = [int(w) for w in args.workers.split(",")] if args.workers else [default_workers()]
    intervals = [float(v) for v in args.switch_intervals.split(",")] if args.switch_intervals else [None]
    gen = torch.Generator().manual_seed(0)
    dataset = [{"tokens": torch.randint(0, vocab, (s,), generator=gen), "position_ids": torch.arange(s)}
               for _ in range(max(lengths))]
    masks = [False]
    if args.answer_fraction is not None:
        for x in dataset:
            x["loss_mask"] = answer_mask(s, args.answer_fraction, args.span_tokens, gen)
        kept = sum(int(x["loss_mask"].sum()) for x in dataset) / (len(dataset) * s)
        print(f"chat loss mask: {kept:.3f} of the tokens kept, spans of {args.span_tokens} tokens per pair on average")
        masks.append(True)
    teacher = MegatronTeacher(model, vocab_size=vocab)
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    logits_forward_s = logits_forward_ms / 1e3
    print(f"teacher pass over {','.join(map(str, lengths))} x {s} tokens; one logits forward {logits_forward_s:.3f} s, "
          f"{8 * s / logits_forward_s:,.0f} tokens/s for 8 GPUs")
    def logits_forwards(data):  # what the pass is measured against: the teacher's forward and bf16 logits
        for x in data:
            hidden, weight = teacher(x["tokens"][None].to(device), x["position_ids"][None].to(device))
            hidden.view(-1, hidden.shape[-1]) @ weight.t()

    for codec in args.codecs.split(","):
        mode = "sampled" if codec == SAMPLED_COUNTS_V1 else "topk"

        def inline(w, data):  # the pass with each micro-batch stored before the next forward
            for i in w.pending_samples():
                x = data[int(i)]
                hidden, weight = teacher(x["tokens"][None].to(device), x["position_ids"][None].to(device))
                if mode == "topk":
                    ids, lps = vocab_parallel_topk(hidden, weight, args.topk, vocab_size=vocab)
                else:
                    keys = sample_row_keys(1234, torch.tensor([int(i)], device=device), s)
                    ids, lps = vocab_parallel_sample(hidden, weight, args.topk, row_keys=keys, vocab_size=vocab)
                w.write(int(i), ids[:, 0], lps[:, 0], tokens=x["tokens"])

        def behind(workers, interval, masked):
            def run(w, data):
                default = sys.getswitchinterval()
                sys.setswitchinterval(interval or default)
                try:
                    cfg = CaptureConfig(topk=args.topk, mode=mode, store_workers=workers, masked=masked)
                    capture_teacher(teacher, data, w, cfg, progress=False)
                finally:
                    sys.setswitchinterval(default)
            return run

        with tempfile.TemporaryDirectory() as tmp:  # warm-up
            n = min(lengths)
            warm = _writer_of(codec, f"{tmp}/cache", vocab=vocab, k=args.topk, seq=s, n=n)
            inline(warm, dataset[:n])
            warm.close()
        if getattr(args, "profile_pass", False):
            n = min(lengths)
            with tempfile.TemporaryDirectory() as tmp:
                profile_pass(behind(counts[0], intervals[0], False), dataset[:n], sync, n * logits_forward_s,
                             lambda: _writer_of(codec, f"{tmp}/cache", vocab=vocab, k=args.topk, seq=s, n=n),
                             logits_forwards)
        runs = [] if args.no_inline else [("stores inline", inline)]
        runs += [(f"stores behind, {workers} workers" + (f", switch {interval * 1e3:g} ms" if interval else "")
                  + (", answer tokens only" if masked else ""), behind(workers, interval, masked))
                 for masked in masks for interval in intervals for workers in counts]
        for name, run in runs:
            took = {}
            for n in lengths:
                with tempfile.TemporaryDirectory() as tmp:
                    w = _writer_of(codec, f"{tmp}/cache", vocab=vocab, k=args.topk, seq=s, n=n)
                    sync()
                    start = time.perf_counter()
                    run(w, dataset[:n])
                    w.close()
                    sync()
                    took[n] = time.perf_counter() - start
                    size = sum(f.stat().st_size for f in Path(tmp, "cache").rglob("*") if f.is_file())
                print(f"  {codec:17} {name:40} {n:4} samples {took[n]:7.2f} s  {n * s / took[n]:10,.0f} tokens/s  "
                      f"overhead over a logits forward {100 * (took[n] / (n * logits_forward_s) - 1):5.1f}%  "
                      f"{size / (n * s):6.1f} bytes/token", flush=True)
            if len(lengths) > 1:
                a, b = min(lengths), max(lengths)
                per_sample = (took[b] - took[a]) / (b - a)
                print(f"  {codec:17} {name:40} marginal {a}->{b}: {per_sample:.3f} s per sample, "
                      f"{s / per_sample:,.0f} tokens/s, overhead over a logits forward "
                      f"{100 * (per_sample / logits_forward_s - 1):5.1f}%; 8 GPUs: 1 B tokens in "
                      f"{1e9 / (8 * s / per_sample) / 3600:.2f} h", flush=True)


# CUPTI's records of its own buffer stalls sit on the device's timeline but are no kernel
_PROFILER_OVERHEAD = ("Command Buffer Full",)


def _gpu_kernels(prof) -> tuple[float, dict[str, float]]:
    """Of a finished profile: the GPU's busy time (s, the union of its kernel and copy intervals)
    and the seconds each kernel name took."""
    from torch.autograd import DeviceType

    spans, by_name = [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or e.name in _PROFILER_OVERHEAD:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy / 1e6, by_name


def profile_pass(run, data, sync, logits_forwards_s: float, make_writer, logits_forwards, rows: int = 25) -> None:
    """``run`` over ``data`` into ``make_writer()`` under torch's profiler, then ``logits_forwards``
    over the same data: the pass's wall time (the profiler's own cost included), the GPU's busy time
    against the logits forwards' (timed unprofiled, and profiled), and the kernels the pass runs
    beyond the forwards' ranked by their extra GPU time per sample: where its overhead goes."""
    import time

    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        w = make_writer()
        sync()
        start = time.perf_counter()
        run(w, data)
        w.close()
        sync()
        wall = time.perf_counter() - start
    busy, kernels = _gpu_kernels(prof)
    with profile(activities=activities) as prof_fwd:
        logits_forwards(data)
        sync()
    busy_fwd, kernels_fwd = _gpu_kernels(prof_fwd)
    n = len(data)
    print(f"  profiled pass, {n} samples: wall {wall:.2f} s, GPU busy {busy:.2f} s ({100 * busy / wall:.1f}% of the "
          f"wall), {100 * (busy / logits_forwards_s - 1):+.1f}% over the logits forwards' {logits_forwards_s:.2f} s "
          f"({100 * (busy / max(busy_fwd, 1e-9) - 1):+.1f}% over their profiled GPU busy {busy_fwd:.2f} s); idle "
          f"{wall - busy:.2f} s", flush=True)
    extra = {name: t - kernels_fwd.get(name, 0.0) for name, t in kernels.items()}
    extra.update({name: -t for name, t in kernels_fwd.items() if name not in kernels})
    print(f"  kernels beyond the logits forwards, ms per sample (of {1e3 * (busy - busy_fwd) / n:.2f} ms busy more; "
          f"a forward is {1e3 * busy_fwd / n:.1f} ms):", flush=True)
    for name, t in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:rows]:
        print(f"    {1e3 * t / n:+8.3f}  {name[:110]}", flush=True)
