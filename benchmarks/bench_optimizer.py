"""Does ``--kd-optimizer bf16-sr-8bit`` train as well as Megatron's default optimizer?

    python -m benchmarks.bench_optimizer --size cpu --out /tmp/bench_optimizer     # 2 CPU cores: ~15 min
    python -m benchmarks.bench_optimizer --size gpu --out runs/optimizer           # one H200: ~5 min

The fidelity benchmark's pieces (benchmarks/common/fidelity.py: corpus, BPE, teacher, top-K cache,
student architecture, held-out metrics), then the distillation recipe's settings
(examples/gpt_oss/distill.sh: --kd-tail renorm --kd-ce-weight 0.1, cosine to lr/10 after 1% warm-up,
--clip-grad 1.0, --weight-decay 0.1, Adam betas 0.9/0.999) at the recipe's learning rate (1e-5) and
at 10x (1e-4), through megatron-core's own training stack: the student is a bf16 Float16Module in
DistributedDataParallel with the distributed optimizer, gradients accumulated over micro-batches,
``get_megatron_optimizer`` builds the optimizer of each arm (``tests/fixtures/megatron_student.py``;
on CPU inside the tests' CPU harness for megatron-core, ``tests/fixtures/megatron_cpu.py``):

  megatron               Megatron's default: fp32 master weights, fp32 moments, fp32 gradients (12 + 4 B)
  bf16-nearest           bf16 weights rounded to nearest, no master; fp32 moments and gradients
  bf16-sr                bf16 weights by stochastic rounding, no master; fp32 moments and gradients
  bf16-sr-8bit-fp32grad  + 8-bit moments
  bf16-sr-8bit           + bf16 gradients: what --kd-optimizer bf16-sr-8bit runs (2.03 + 2 B)

The recipe distills into a pretrained student; so here every arm starts from the same student
trained first with cross-entropy (fp32, the fidelity preset's learning rate) and then distills for
the same steps on the same batches. At lr 1e-5 an update is ~1e-5 per weight, below half a bf16
step for most weights: rounding to nearest drops it, stochastic rounding keeps it in expectation.

Goal: held-out cross-entropy of bf16-sr-8bit within 0.5% of megatron's at both learning
rates. Writes OUT/results.json (settings, every arm's curve, held-out CE and KL before and after,
bytes of optimizer state per parameter, the goal), OUT/results.md and OUT/curves.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import benchmarks.common.fidelity as fidelity

# name: (--kd-optimizer choice, Bf16Adam settings that differ from the choice's, fp32 gradients)
ARMS = {
    "megatron": ("megatron", {}, True),
    "bf16-nearest": ("bf16-sr-8bit", {"rounding": "nearest", "moments": "fp32"}, True),
    "bf16-sr": ("bf16-sr-8bit", {"moments": "fp32"}, True),
    "bf16-sr-8bit-fp32grad": ("bf16-sr-8bit", {}, True),
    "bf16-sr-8bit": ("bf16-sr-8bit", {}, False),
}
CHOSEN, REFERENCE = "bf16-sr-8bit", "megatron"
LRS = (1e-5, 1e-4)
GOAL = 0.005
# the recipe's settings (examples/gpt_oss/distill.sh and Megatron-LM's defaults)
RECIPE = dict(tail="renorm", ce_weight=0.1, weight_decay=0.1, clip_grad=1.0, betas=(0.9, 0.999), warmup=0.01,
              min_lr_ratio=0.1)


@dataclass(frozen=True)
class Setup:
    fidelity: dict  # bench_fidelity preset fields changed for this benchmark
    warm_steps: int  # cross-entropy pretraining of the student (fp32, the preset's student lr)
    micro_batches: int  # per step; the preset's micro_batch_size is the global batch
    topk: int


SETUPS = {
    # 2 CPU cores: the fidelity CPU preset, 300 distillation steps of 16 x 128 tokens per arm
    "cpu": Setup(fidelity=dict(student_steps=300, eval_samples=64), warm_steps=60, micro_batches=4, topk=100),
    # one H200: a 12 x 768 teacher for 500 steps (~80 s), 6 x 384 students from 200 cross-entropy
    # steps, 300 distillation steps of 16 x 1024 tokens per arm (2 micro-batches), top-100 of the 32K
    # BPE vocabulary (estimated from bench_fidelity's H200 timings, 2026-11-30: ~5 min in all)
    "gpu": Setup(fidelity=dict(teacher_steps=500, teacher_eval_interval=250, student_steps=300, micro_batch_size=16,
                               eval_samples=128), warm_steps=200, micro_batches=2, topk=100),
}


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _init_process(device: torch.device, seed: int):
    """One rank: megatron-core's process groups (NCCL on CUDA: the DDP collectives run on the GPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_kd.distributed import init_process_group
    init_process_group("nccl" if device.type == "cuda" else "gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _megatron_runtime(device: torch.device):
    """megatron-core's DDP and distributed optimizer as they are on CUDA; the tests' harness on CPU."""
    if device.type == "cuda":
        import contextlib

        return contextlib.nullcontext()
    from tests.fixtures.megatron_cpu import megatron_optimizer_cpu_patches

    return megatron_optimizer_cpu_patches()


class OptimizerBench:
    def __init__(self, size: str, out: Path, lrs, arms, log, overrides: dict, warm_steps: int | None = None):
        self.setup = SETUPS[size] if warm_steps is None else replace(SETUPS[size], warm_steps=warm_steps)
        self.preset = replace(fidelity.PRESETS[size], **{**self.setup.fidelity, **overrides})
        self.device = _device()
        self.autocast = fidelity.autocast_dtype("auto", self.device)
        self.out, self.lrs, self.arms, self._log = out, lrs, arms, log
        self.bench = fidelity.Bench(self.preset, out, self.device, self.autocast, log)
        self.variant = fidelity.parse_variant(f"top{self.setup.topk}-{RECIPE['tail']}-ce{RECIPE['ce_weight']}")
        self.results = {"size": size, "device": str(self.device), "preset": asdict(self.preset),
                        "setup": asdict(self.setup), "recipe": RECIPE, "variant": self.variant.name, "runs": {}}

    def log(self, message):
        self.bench.log(message)

    def prepare(self, resume: bool = False):
        """Corpus, teacher, cache (bench_fidelity; ``resume``: those a stopped run with the same preset
        left in OUT/work), then the pretrained student every arm starts from."""
        if resume:
            self.bench.resume()
        self.bench.work.mkdir(parents=True, exist_ok=True)
        self.bench.build_data()
        self.bench.train_teacher()
        (self.variant,) = self.bench.build_caches([self.variant])
        self.results["teacher"] = {k: self.bench.results["teacher"][k] for k in ("parameters", "heldout_ce")}
        self.results["cache"] = self.bench.results["caches"][self.variant.cache]
        self.warm = self._warm_student()

    def _student(self):
        p = self.preset
        return fidelity.gpt(p.student, self.bench.vocab, p.seq_length, p.seed + 1, self.device)

    def _warm_student(self) -> dict:
        from megatron_kd.demo import DemoConfig, train_loop

        p, s = self.preset, self.setup
        model = self._student()
        batches = fidelity.ordered_batches(self.bench.teacher_ds, s.warm_steps, p.micro_batch_size, workers=p.workers,
                                           device=self.device)
        amp = fidelity.Autocast(model, self.autocast)
        t = time.perf_counter()
        train_loop("warm start", model, s.warm_steps,
                   lambda m, step: fidelity.Bench._ce_step(amp, fidelity._to(next(batches), self.device)),
                   DemoConfig(lr=p.student_lr, log_interval=p.log_interval), self.bench.tb, self.log)
        metrics = self.bench.heldout(model, teacher=self.bench.teacher)
        self.results["start"] = {"heldout_ce": metrics["ce"], "heldout_kl": metrics["kl"],
                                 "seconds": round(time.perf_counter() - t, 1)}
        self.log(f"student start ({s.warm_steps} cross-entropy steps): held-out CE {metrics['ce']:.4f}, "
                 f"KL {metrics['kl']:.4f}")
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}

    def _batches(self):
        from megatron_kd.megatron.kd_data import KDDataset

        p, s = self.preset, self.setup
        dataset = KDDataset(self.bench.student_ds, str(self.bench.caches[self.variant.cache]), tokenizer=self.bench.tok,
                            required_samples=p.student_steps * p.micro_batch_size)
        return fidelity.ordered_batches(dataset, p.student_steps * s.micro_batches, p.micro_batch_size // s.micro_batches,
                                        workers=p.workers, device=self.device)

    def run_arm(self, arm: str, lr: float) -> dict:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_kd.megatron.args import KDConfig
        from megatron_kd.megatron.loss import KDForwardStep
        from tests.fixtures.megatron_student import wrap_for_training

        p, s = self.preset, self.setup
        choice, settings, fp32_grads = ARMS[arm]
        steps = p.student_steps
        model = self._student()
        model.load_state_dict(self.warm)
        ddp, optimizer = wrap_for_training(model, choice, lr=lr, seed=p.seed, weight_decay=RECIPE["weight_decay"],
                                           clip_grad=RECIPE["clip_grad"], betas=RECIPE["betas"],
                                           grad_fp32=fp32_grads, **settings)
        schedule = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=lr, min_lr=lr * RECIPE["min_lr_ratio"],
            lr_warmup_steps=max(1, round(RECIPE["warmup"] * steps)), lr_decay_steps=steps, lr_decay_style="cosine",
            start_wd=RECIPE["weight_decay"], end_wd=RECIPE["weight_decay"], wd_incr_steps=steps,
            wd_incr_style="constant")
        forward_step = KDForwardStep(KDConfig(tail=self.variant.tail, ce_weight=self.variant.ce_weight),
                                     device=self.device)
        batches, curve, skipped = self._batches(), [], 0
        t = time.perf_counter()
        for step in range(1, steps + 1):
            micro = [next(batches) for _ in range(s.micro_batches)]
            tokens = sum(float(b["loss_mask"].sum()) for b in micro)  # the step's loss is per token of the batch
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            ce = 0.0
            for batch in micro:
                output, loss_fn = forward_step(iter([batch]), ddp)
                loss, _, report = loss_fn(output)
                (loss / tokens).backward()
                ce += float(report["ce loss"][0])
            ddp.finish_grad_sync()
            ok, _, _ = optimizer.step()
            skipped += not ok
            schedule.step(1)
            curve.append((step, ce / tokens))
            if step % p.log_interval == 0 or step == steps:
                self.log(f"  {arm:22s} lr {lr:.0e} step {step:4d}/{steps}  train CE {ce / tokens:.4f}")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        evaluated = self._student()
        evaluated.load_state_dict(ddp.module.module.state_dict())  # the bf16 weights, evaluated in fp32
        metrics = self.bench.heldout(evaluated, teacher=self.bench.teacher)
        params = sum(x.numel() for x in ddp.parameters())
        return {"heldout_ce": metrics["ce"], "heldout_kl": metrics["kl"], "curve": curve, "skipped_steps": skipped,
                "seconds_per_step": seconds / steps, "optimizer_state_bytes_per_param": _state_bytes(optimizer) / params}

    def run(self, resume: bool = False) -> dict:
        self.prepare(resume)
        for lr in self.lrs:
            runs = self.results["runs"].setdefault(f"{lr:g}", {})
            for arm in self.arms:
                with _megatron_runtime(self.device):
                    runs[arm] = self.run_arm(arm, lr)
                r = runs[arm]
                self.log(f"{arm} at lr {lr:g}: held-out CE {r['heldout_ce']:.4f} (start "
                         f"{self.results['start']['heldout_ce']:.4f}), KL {r['heldout_kl']:.4f}, "
                         f"{r['optimizer_state_bytes_per_param']:.2f} B/param of state")
        self.results["goal"] = goal(self.results)
        return self.results


def _state_bytes(optimizer) -> int:
    """Bytes of optimizer state: Bf16Adam's own count, or the fp32 main params and moments."""
    from megatron_kd.optim import Bf16Adam

    total = 0
    for part in optimizer.chained_optimizers:
        inner = part.optimizer
        if isinstance(inner, Bf16Adam):
            total += inner.state_bytes()
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                total += p.numel() * p.element_size()  # the fp32 main param
                total += sum(v.numel() * v.element_size() for v in inner.state[p].values()
                             if torch.is_tensor(v) and v.dim() > 0)
    return total


def goal(results: dict) -> dict:
    """The chosen arm's held-out CE against megatron's at every learning rate."""
    gaps = {}
    for lr, runs in results["runs"].items():
        if CHOSEN in runs and REFERENCE in runs:
            gaps[lr] = runs[CHOSEN]["heldout_ce"] / runs[REFERENCE]["heldout_ce"] - 1
    return {"arm": CHOSEN, "reference": REFERENCE, "gaps": gaps, "goal": GOAL,
            "met": bool(gaps) and all(abs(g) <= GOAL for g in gaps.values())}


def write_markdown(results: dict, path: Path):
    start = results["start"]["heldout_ce"]
    lines = [f"# Optimizer state vs quality ({results['device']})", "",
             (f"Student {results['preset']['student']} from {results['setup']['warm_steps']} cross-entropy steps "
              f"(held-out CE {start:.4f}), then {results['preset']['student_steps']} distillation steps "
              f"({results['variant']}, recipe settings {results['recipe']}) per arm and learning rate; teacher "
              f"held-out CE {results['teacher']['heldout_ce']:.4f}."), "",
             ("Gain from start: held-out CE reduction since the start; its ratio to megatron's says how much of "
              "megatron's training the arm reproduces (a weight that never moves scores 0)."), "",
             "| lr | arm | state B/param | held-out CE | vs megatron | gain from start | gain / megatron's | "
             "held-out KL | skipped | s/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lr, runs in results["runs"].items():
        ref = runs.get(REFERENCE, {}).get("heldout_ce")
        for arm, r in runs.items():
            vs = "" if ref is None else f"{r['heldout_ce'] / ref - 1:+.3%}"
            share = "" if ref is None or ref == start else f"{(start - r['heldout_ce']) / (start - ref):.2f}"
            lines.append(f"| {lr} | {arm} | {r['optimizer_state_bytes_per_param']:.2f} | {r['heldout_ce']:.4f} | {vs} | "
                         f"{1 - r['heldout_ce'] / start:+.3%} | {share} | {r['heldout_kl']:.4f} | {r['skipped_steps']} | "
                         f"{r['seconds_per_step']:.3f} |")
    g = results["goal"]
    lines += ["", f"- Goal: {g['arm']} within {g['goal']:.1%} of {g['reference']} in held-out CE at every lr: "
              + ", ".join(f"lr {lr}: {gap:+.3%}" for lr, gap in g["gaps"].items())
              + f" -> {'met' if g['met'] else 'NOT met'}", ""]
    path.write_text("\n".join(lines))


def plot(results: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = list(results["runs"])
    fig, axes = plt.subplots(1, len(lrs), figsize=(7 * len(lrs), 5), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for arm, r in results["runs"][lr].items():
            steps, values = zip(*r["curve"])
            width = max(1, len(values) // 15)
            smooth = [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
                      for i in range(len(values))]
            ax.plot(steps, smooth, linewidth=2 if arm in (CHOSEN, REFERENCE) else 1,
                    label=f"{arm} (held-out {r['heldout_ce']:.4f})")
        ax.set(title=f"lr {lr} (start: held-out {results['start']['heldout_ce']:.4f})", xlabel="step",
               ylabel="training cross-entropy (moving average)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SETUPS), default="gpu")
    parser.add_argument("--out", default="runs/optimizer")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LRS), help="comma-separated learning rates")
    parser.add_argument("--warm-steps", type=int, default=None, help="cross-entropy steps of the starting student")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the tokenizer, teacher and caches a stopped run left in --out (same settings)")
    parser.add_argument("--keep-work", action="store_true", help="keep OUT/work (datasets, teacher, caches)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="change one bench_fidelity preset field, e.g. --set student_steps=100")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
        overrides = fidelity.preset_overrides(args.set)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = _device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    bench = OptimizerBench(args.size, out, lrs, arms, lambda m: print(m, flush=True), overrides,
                           warm_steps=args.warm_steps)
    _init_process(device, bench.preset.seed)
    results = bench.run(resume=args.resume)
    bench.bench.tb.close()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, out / "results.md")
    plot(results, out / "curves.png")
    if not args.keep_work:
        import shutil

        shutil.rmtree(bench.bench.work, ignore_errors=True)
        (out / "results.partial.json").unlink(missing_ok=True)  # bench_fidelity's stage record
    print((out / "results.md").read_text())
    return 0 if results["goal"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
