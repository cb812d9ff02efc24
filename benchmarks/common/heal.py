"""The heal benchmark's pipeline (``python -m benchmarks.bench_heal``, whose docstring says what it
measures): ``HealBench``, the fidelity benchmark's ``Bench`` whose students start from the teacher cut
at each level, its goal and its report.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import torch

from benchmarks.common.fidelity import Arch, Bench, gpt

LEVELS = {"light": 0.75, "heavy": 0.5}  # fraction of the teacher's layers and MLP width kept
# Preset changes for healing: the CPU preset's teacher (200 steps) is still improving 5% per 100 steps,
# so cross-entropy on new text alone beats it within the students' 60 steps and there is nothing to
# heal towards; 1,000 steps make it the better model (held-out CE 3.30 against 4.08).
HEAL_PRESETS = {"cpu": {"teacher_steps": 1000}}
VARIANTS = ("ce", "top100-renorm", "sampled64", "online")
GOAL = 0.8  # of online KD's gap closed, by a cache variant


class HealBench(Bench):
    """``Bench`` whose students start from the teacher, cut."""

    start: tuple[Arch, dict] | None = None

    def new_student(self):
        arch, state = self.start
        model = gpt(arch, self.vocab, self.p.seq_length, self.p.seed + 1, self.device)
        model.load_state_dict(state, strict=True)
        return model

    def calibrate(self, samples: int):
        from megatron_kd.prune import calibrate
        from megatron_kd.teacher import MegatronTeacher

        t = time.perf_counter()
        scores = calibrate(MegatronTeacher(self.teacher), self.student_ds, num_samples=samples,
                           micro_batch_size=self.p.micro_batch_size, group_size=1, device=self.device, progress=False)
        self.stage("calibration", time.perf_counter() - t)
        self.log(f"calibration: {scores.tokens:,} tokens; layer scores "
                 + ", ".join(f"{x:.4f}" for x in scores.layer_groups.tolist()))
        return scores

    def cut(self, scores, keep: float) -> tuple[Arch, dict, dict]:
        from megatron_kd.prune import PruneTargets, choose_kept, pruned_megatron_state

        t = self.p.teacher
        ffn = self.teacher.config.ffn_hidden_size
        targets = PruneTargets(num_layers=max(1, round(t.layers * keep)), ffn_hidden_size=max(1, round(ffn * keep)))
        kept = choose_kept(scores, targets, num_layers=t.layers, num_experts=None, ffn_hidden_size=ffn)
        state = pruned_megatron_state(self.teacher.state_dict(), kept,
                                      gated=self.teacher.config.gated_linear_unit)
        arch = replace(t, layers=targets.num_layers, ffn=targets.ffn_hidden_size)
        return arch, state, {"layers": kept.layers, "ffn_hidden_size": targets.ffn_hidden_size,
                             "parameters": sum(v.numel() for k, v in state.items()
                                               if isinstance(v, torch.Tensor) and not k.endswith("_extra_state"))}

    def heal(self, levels: dict[str, float], variants: list, calib_samples: int) -> dict:
        """Every level's cut and healing runs; what a stopped run finished (``resume``) is kept: its
        teacher, caches, and each level's start and finished variants."""
        self.work.mkdir(parents=True, exist_ok=True)
        self.build_data()
        self.train_teacher()
        resolved = self.build_caches(variants)
        scores = self.calibrate(min(calib_samples, self.p.student_steps * self.p.micro_batch_size))
        teacher_ce = self.results["teacher"]["heldout_ce"]
        done = self.results.setdefault("levels", {})
        for name, keep in levels.items():
            arch, state, info = self.cut(scores, keep)
            self.start = (arch, state)
            level = done.get(name)
            if level is None or any(level[k] != info[k] for k in ("layers", "ffn_hidden_size")):  # not this cut
                before = self.heldout(self.new_student(), teacher=self.teacher)
                level = done[name] = {"keep": keep, "arch": asdict(arch), **info, "before": before,
                                      "gap": before["ce"] - teacher_ce, "variants": {}}
            before = level["before"]
            self.log(f"{name} cut: layers {info['layers']}, MLP width {info['ffn_hidden_size']}, "
                     f"{info['parameters']:,} parameters; before healing: held-out cross-entropy {before['ce']:.4f}, "
                     f"KL {before['kl']:.4f} (teacher {teacher_ce:.4f})")
            self.results["variants"] = level["variants"]  # train_student records (and resumes) here
            for v in resolved:
                self.train_student(v)
            for r in level["variants"].values():
                r["gap_closed"] = (before["ce"] - r["heldout_ce"]) / level["gap"] if level["gap"] > 0 else float("nan")
        del self.results["variants"]
        self.tb.close()
        self.results["goal"] = heal_goal(self.results)
        self.results["seconds"] = round(sum(self.results["stages"].values()), 1)
        return self.results


def heal_goal(results: dict) -> dict:
    """Per level: the best cache variant's gap closed over online KD's, against ``GOAL``."""
    out = {}
    for name, level in results["levels"].items():
        rows = level["variants"]
        if "online" not in rows:
            continue
        cached = {k: r["gap_closed"] for k, r in rows.items() if r["kind"] in ("topk", "sampled")}
        online = rows["online"]["gap_closed"]
        out[name] = {k: closed / online for k, closed in cached.items()} if online > 0 else {}
    return {"goal": f"a cache variant closes >= {GOAL:.0%} of the gap online KD closes", "ratios": out,
            "met": all(any(r >= GOAL for r in ratios.values()) for ratios in out.values()) if out else None}


def markdown(results: dict) -> str:
    teacher = results["teacher"]["heldout_ce"]
    lines = [f"# Healing pruned students ({results['preset_name']} preset)", "",
             f"Teacher: {results['teacher']['parameters']:,} parameters, held-out cross-entropy {teacher:.4f}.", ""]
    for name, level in results["levels"].items():
        lines += [f"## {name} cut: layers {level['layers']}, MLP width {level['ffn_hidden_size']}, "
                  f"{level['parameters']:,} parameters", "",
                  "| student | cache bytes/token | held-out CE | KL(T‖S) | gap closed |", "|---|---:|---:|---:|---:|",
                  f"| pruned, before healing | | {level['before']['ce']:.4f} | {level['before']['kl']:.4f} | 0 |"]
        for k, r in level["variants"].items():
            size = f"{r['bytes_per_token']:.1f}" if r.get("bytes_per_token") else ""
            lines.append(f"| {k} | {size} | {r['heldout_ce']:.4f} | {r['heldout_kl']:.4f} | {r['gap_closed']:.1%} |")
        ratios = results["goal"]["ratios"].get(name, {})
        if ratios:
            lines += ["", "Of online KD's gap closed: " + ", ".join(f"{k} {x:.0%}" for k, x in ratios.items()) + "."]
        lines.append("")
    lines.append(f"Goal ({results['goal']['goal']}): {'met' if results['goal']['met'] else 'not met'}.")
    return "\n".join(lines) + "\n"
