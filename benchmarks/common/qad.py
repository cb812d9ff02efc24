"""The QAD benchmark's pipeline (``python -m benchmarks.bench_qad``, whose docstring says what it
measures): the fidelity benchmark's corpus, tokenizer, teacher and cache (``Bench``), an MoE student
whose experts are megatron_kd's ``GroupedGemmExperts``, and its four arms per FP4 format: the bf16
student, that student quantized after training (PTQ), the same student trained further without
quantization (the control) and with its experts fake-quantized (QAD)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch

from benchmarks.common.fidelity import Bench, Preset, gpt, ordered_batches, parse_variant
from megatron_kd.ops.quant import FORMATS

GOAL = 0.8  # MXFP4: QAD recovers at least this fraction of the held-out cross-entropy PTQ loses


@dataclass(frozen=True)
class QADSettings:
    formats: tuple[str, ...] = FORMATS
    experts: int = 8  # each of the preset student's width, SwiGLU, top-``topk`` routed
    topk: int = 2
    fraction: float = 0.15  # steps of the QAD run (and of the control) / steps of the bf16 run
    lr_ratio: float = 0.3  # their learning rate / the bf16 run's: they start from a trained student
    variant: str = "sampled64"  # the cache and loss every arm trains with (bench_fidelity's names)


def recovery(bf16: float, ptq: float, qad: float) -> float:
    """The fraction of the held-out cross-entropy PTQ loses against ``bf16`` that QAD wins back."""
    return (ptq - qad) / (ptq - bf16)


class QADBench(Bench):
    """``Bench`` whose student is an MoE model. The students' samples are the bf16 run's
    ``preset.student_steps`` micro-batches, then ``fraction`` as many more for the QAD run and the
    control (one cache holds both)."""

    def __init__(self, preset: Preset, settings: QADSettings, *args, **kwargs):
        self.base_steps = preset.student_steps
        self.more_steps = max(1, round(settings.fraction * preset.student_steps))
        super().__init__(replace(preset, student_steps=self.base_steps + self.more_steps), *args, **kwargs)
        self.s = settings
        self.results["qad"] = {**asdict(settings), "base_steps": self.base_steps, "more_steps": self.more_steps}

    def new_student(self):
        import torch.nn.functional as F

        arch = self.p.student
        return gpt(arch, self.vocab, self.p.seq_length, self.p.seed + 1, self.device,
                   num_moe_experts=self.s.experts, moe_router_topk=self.s.topk, moe_ffn_hidden_size=arch.hidden,
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                   moe_token_dispatcher_type="allgather", gated_linear_unit=True, activation_func=F.silu,
                   bias_activation_fusion=False,
                   # fp32 router: megatron-core's router backward multiplies its gradient by the weight
                   # in the router dtype, and under autocast the fp32 weight meets a bf16 gradient
                   moe_router_dtype="fp32")

    def heldout(self, model, teacher=None) -> dict:
        # in the training autocast: the grouped experts take its dtype (fp32 weights quantize alike)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return super().heldout(model, teacher)

    def student_from(self, state: dict, fmt: str | None):
        from megatron_kd.models.experts import quantize_experts

        model = self.new_student()
        model.load_state_dict(state)
        if fmt is not None:
            quantize_experts(model, fmt)
        return model

    def train(self, name: str, model, first_step: int, steps: int, lr: float) -> dict:
        """``steps`` steps of the variant's loss on micro-batches ``first_step`` .. (samples in order);
        returns held-out metrics and the steady-state seconds per step."""
        from megatron_kd.demo import DemoConfig, train_loop
        from megatron_kd.megatron.kd_data import KDDataset

        p, b = self.p, self.p.micro_batch_size
        v = parse_variant(self.s.variant)
        dataset = KDDataset(self.student_ds, str(self.caches[v.cache]), tokenizer=self.tok,
                            required_samples=p.student_steps * b, packing=self.packing.mode)
        part = torch.utils.data.Subset(dataset, range(first_step * b, (first_step + steps) * b))
        step_fn = self._step_fn(v, ordered_batches(part, steps, b, workers=p.workers, device=self.device))
        starts = []

        def timed(model, step):
            starts.append(time.perf_counter())
            return step_fn(model, step)

        t = time.perf_counter()
        curve = train_loop(name, model, steps, timed, DemoConfig(lr=lr, log_interval=p.log_interval), self.tb,
                           self.log)
        self._sync()
        starts.append(time.perf_counter())
        skip = min(5, steps // 10)  # the first steps compile kernels and start the loader
        metrics = self.heldout(model, teacher=self.teacher)
        self.stage(f"student {name}", time.perf_counter() - t)
        self.log(f"{name}: held-out cross-entropy {metrics['ce']:.4f}, KL {metrics['kl']:.4f}")
        return {**metrics, "steps": steps, "seconds_per_step": (starts[-1] - starts[skip]) / (steps - skip),
                "curve": curve}

    def run_qad(self) -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        self.build_data()
        self.train_teacher()
        self.build_caches([parse_variant(self.s.variant)])
        p, arms = self.p, self.results.setdefault("arms", {})
        lr = p.student_lr * self.s.lr_ratio

        model = self.new_student()
        arms["bf16"] = self.train("bf16", model, 0, self.base_steps, p.student_lr)
        start = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
        arms["bf16+"] = self.train("bf16+", self.student_from(start, None), self.base_steps, self.more_steps, lr)
        for fmt in self.s.formats:
            t = time.perf_counter()
            ptq = self.heldout(self.student_from(start, fmt), teacher=self.teacher)
            self.stage(f"PTQ {fmt}", time.perf_counter() - t)
            self.log(f"PTQ {fmt}: held-out cross-entropy {ptq['ce']:.4f}, KL {ptq['kl']:.4f}")
            arms[f"ptq-{fmt}"] = ptq
            arms[f"qad-{fmt}"] = self.train(f"qad-{fmt}", self.student_from(start, fmt), self.base_steps,
                                            self.more_steps, lr)
        self.tb.close()
        bf16 = arms["bf16"]["ce"]
        self.results["recovery"] = {
            fmt: {"vs_bf16": recovery(bf16, arms[f"ptq-{fmt}"]["ce"], arms[f"qad-{fmt}"]["ce"]),
                  "vs_bf16_continued": recovery(arms["bf16+"]["ce"], arms[f"ptq-{fmt}"]["ce"],
                                                arms[f"qad-{fmt}"]["ce"])}
            for fmt in self.s.formats}
        if "mxfp4" in self.s.formats:
            self.results["goal"] = {"mxfp4_recovery": self.results["recovery"]["mxfp4"]["vs_bf16"], "target": GOAL,
                                    "met": self.results["recovery"]["mxfp4"]["vs_bf16"] >= GOAL}
        self.results["seconds"] = round(sum(self.results["stages"].values()), 1)
        return self.results


def markdown(results: dict) -> str:
    q, arms, teacher = results["qad"], results["arms"], results["teacher"]
    student = results["preset"]["student"]
    lines = [
        "# Quantization-aware distillation of an MoE student's experts", "",
        f"Student: {student['layers']} x {student['hidden']}, {q['experts']} SwiGLU experts of width "
        f"{student['hidden']}, top-{q['topk']}; loss and cache `{q['variant']}`; teacher held-out cross-entropy "
        f"{teacher['heldout_ce']:.4f}. bf16: {q['base_steps']} steps; bf16+ (control) and QAD: "
        f"{q['more_steps']} more steps from it on the next samples, learning rate x{q['lr_ratio']}. PTQ: the bf16 "
        "student's experts rounded to nearest (nvidia-modelopt's rules, bit for bit). Held-out metrics under "
        "bf16 autocast, quantized arms with their experts quantized.", "",
        "| arm | held-out CE | KL(teacher‖student) | ms / step |", "|---|---:|---:|---:|"]
    for name, arm in arms.items():
        step = f"{1e3 * arm['seconds_per_step']:.1f}" if "seconds_per_step" in arm else ""
        lines.append(f"| {name} | {arm['ce']:.4f} | {arm['kl']:.4f} | {step} |")
    lines += ["", "| format | PTQ loses | QAD recovers (vs bf16) | (vs bf16+) |", "|---|---:|---:|---:|"]
    for fmt, r in results["recovery"].items():
        lines.append(f"| {fmt} | {arms[f'ptq-{fmt}']['ce'] - arms['bf16']['ce']:+.4f} | {r['vs_bf16']:.1%} | "
                     f"{r['vs_bf16_continued']:.1%} |")
    if "goal" in results:
        g = results["goal"]
        lines += ["", f"Goal: MXFP4 recovery >= {g['target']:.0%}: {g['mxfp4_recovery']:.1%}, "
                      f"{'met' if g['met'] else 'not met'}."]
    return "\n".join(lines) + "\n"
