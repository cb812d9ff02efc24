"""The SmolLM2 healing benchmark's stages (``python -m benchmarks.bench_smollm2``, whose docstring says
what it runs): ``Bench``, every ``megatron-kd`` command of a run as a job (``--dry-run`` prints
them), run a wave at a time on one GPU and resumed where outputs exist, the scoring of the exported
models (``heal_eval``) and the report.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the run's shape and optimizer are examples/smollm2/smollm2.sh's (SMOL_RUN, SMOL_OPTIM: 200 steps of
# 32 x 1,024 tokens, two passes over the healing text); the benchmark adds the chat students' steps
# (about two passes over the conversations), the calibration samples and its scoring windows
PRESETS = {"gpu": dict(chat_iters=60, calib_samples=256, ood_windows=128, eval_batch=8)}
CUTS = {"deep": ["--prune-num-layers", "20"], "width": ["--prune-ffn-hidden-size", "768"]}
CACHES = {"sampled64": ["--kd-cache-mode", "sampled", "--kd-draws", "64"],
          "top100": ["--kd-cache-mode", "topk", "--kd-topk", "100"]}
VARIANTS = ("ce", "sampled64", "top100", "online")
CHAT_VARIANTS = ("ce", "sampled64")
OOD = {"kjv": "kjv.jsonl", "fortunes": "fortunes.jsonl"}
HEAL_TEXT, CHAT_TEXT = "python-docs.jsonl", "wordnet-chat.jsonl"


@dataclass
class Job:
    name: str
    argv: list[str]
    clean: Path | None = None  # an output a stopped attempt may have left half-written: removed before a run


class Bench:
    def __init__(self, opts):
        self.o, self.p = opts, PRESETS[opts.preset]
        self.work = Path(opts.work).resolve()
        self.logs = self.work / "logs"
        self.seeds = [int(s) for s in opts.seeds.split(",")]
        self.port = 29600
        self.stages: dict[str, float] = {}
        self.flags: dict[Path, list[str]] = {}
        self.run_flags, self.optim_flags = recipe("SMOL_RUN"), recipe("SMOL_OPTIM")
        self.seq_length = int(flag(self.run_flags, "--seq-length"))

    # ---- commands ----------------------------------------------------------------------------
    def megatron_kd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "megatron_kd.cli", *args]

    def torchrun(self, *args: str) -> list[str]:
        self.port += 1
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                str(self.port), *args]

    def impl(self) -> list[str]:
        """megatron-core's local spec where Transformer Engine is missing (examples/common.sh's KD_IMPL)."""
        try:
            import transformer_engine  # noqa: F401

            return []
        except ImportError:
            return ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
                    "--no-gradient-accumulation-fusion"]

    def data_flags(self, prefix: Path, seed: int, *extra: str) -> list[str]:
        return ["--data-path", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                str(self.teacher), *self.run_flags, *self.impl(), "--seed", str(seed),
                "--data-cache-path", str(self.work / "index-cache"), "--num-workers", "2", *extra]

    def text_data(self, seed: int) -> list[str]:
        return self.data_flags(self.work / "data" / "python-docs", seed)

    def chat_data(self) -> list[str]:
        return self.data_flags(self.work / "data" / "chat", self.seeds[0], "--train-iters", str(self.p["chat_iters"]))

    # ---- running -----------------------------------------------------------------------------
    def run_jobs(self, stage: str, jobs: list[Job]) -> None:
        """The jobs not done yet, ``--jobs`` at a time; a failure stops the benchmark with its log's tail."""
        todo = [j for j in jobs if not self.done(j).exists()]
        if self.o.dry_run:
            for j in todo:
                print(f"# {j.name}\n{shlex.join(j.argv)}")
            return
        start, running, failed = time.perf_counter(), [], []
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "2",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        while todo or running:
            while todo and len(running) < self.o.jobs:
                j = todo.pop(0)
                if j.clean is not None:
                    shutil.rmtree(j.clean, ignore_errors=True)
                log = (self.logs / f"{j.name}.log").open("w")
                running.append((j, subprocess.Popen(j.argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                    env=env), log, time.perf_counter()))
            time.sleep(1)
            for item in [r for r in running if r[1].poll() is not None]:
                j, proc, log, t0 = item
                running.remove(item)
                log.close()
                if proc.returncode == 0:
                    self.done(j).parent.mkdir(parents=True, exist_ok=True)
                    self.done(j).write_text(f"{time.perf_counter() - t0:.1f}\n")
                    print(f"  {j.name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
                else:
                    failed.append(j.name)
                    tail = (self.logs / f"{j.name}.log").read_text().splitlines()[-25:]
                    print(f"  {j.name}: exit {proc.returncode}\n    " + "\n    ".join(tail), flush=True)
        self.stages[stage] = self.stages.get(stage, 0) + time.perf_counter() - start
        print(f"{stage}: {time.perf_counter() - start:.0f} s", flush=True)
        if failed:
            raise SystemExit(f"bench_smollm2: {stage}: {', '.join(failed)} failed (logs in {self.logs})")

    def done(self, job: Job) -> Path:
        """Written when the job succeeded: a resumed benchmark skips it."""
        return self.work / "done" / job.name

    def output(self, argv: list[str]) -> str:
        return subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT).stdout

    # ---- stages ------------------------------------------------------------------------------
    @property
    def teacher(self) -> Path:
        return self.work / "teacher"

    def model_flags(self, hf_dir: Path) -> list[str]:
        """``megatron-kd hf-flags DIR``, once per directory."""
        if self.o.dry_run and not hf_dir.exists():
            return [f"<hf-flags {hf_dir}>"]
        if hf_dir not in self.flags:
            self.flags[hf_dir] = shlex.split(self.output(self.megatron_kd("hf-flags", str(hf_dir))).strip())
        return self.flags[hf_dir]

    def prepare(self) -> None:
        corpora = Path(self.o.corpora).resolve()
        self.run_jobs("teacher", [Job("gguf-to-hf", self.megatron_kd("gguf-to-hf", self.o.gguf, "--out", str(self.teacher)),
                                      clean=self.teacher)])
        tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(self.teacher)]
        data = self.work / "data"
        # --overwrite: a stage killed after its files moved into place, before its marker, runs again
        self.run_jobs("data", [
            Job("data-text", self.megatron_kd("data", "text", "--input", str(corpora / HEAL_TEXT),
                                              "--output", str(data / "python-docs"), "--overwrite", *tok)),
            Job("data-chat", self.megatron_kd("data", "chat", "--input", str(corpora / CHAT_TEXT), "--output",
                                              str(data / "chat"), "--renderer", "template",
                                              "--seq-length", str(self.seq_length), "--overwrite", *tok)),
        ])
        self.teacher_flags = self.model_flags(self.teacher)

    def cache(self, name: str, seed: int) -> Path:
        return self.work / "caches" / f"{name}-{seed}"

    def teacher_pass(self) -> None:
        teacher = [*self.teacher_flags, "--kd-teacher-hf", str(self.teacher)]

        def build(name, seed, data):
            path = self.cache(name, seed)
            return Job(f"cache-{name}-{seed}", self.torchrun("-m", "megatron_kd.cli", "cache", "build", *teacher, *data,
                                                             "--kd-cache", str(path),
                                                             *CACHES[name.removeprefix("chat-")]))

        # one build per data set first: it writes the dataset's index files the others then read
        first = [build("sampled64", s, self.text_data(s)) for s in self.seeds]
        self.run_jobs("cache (first)", [*first, build("chat-sampled64", self.seeds[0], self.chat_data())])
        prunes = [Job(f"prune-{cut}", self.torchrun("-m", "megatron_kd.cli", "prune", *teacher,
                                                    *self.text_data(self.seeds[0]), *flags, "--prune-calib-samples",
                                                    str(self.p["calib_samples"]), "--out", str(self.pruned(cut))),
                      clean=self.pruned(cut)) for cut, flags in CUTS.items()]
        self.run_jobs("cache + prune", [*(build("top100", s, self.text_data(s)) for s in self.seeds), *prunes])

    def pruned(self, cut: str) -> Path:
        return self.work / "pruned" / cut

    def run_name(self, cut: str, variant: str, seed: int) -> str:
        return f"{cut}-{variant}-{seed}"

    def student_runs(self):
        """(name, cut, variant, seed, data flags, iterations) of every student."""
        for cut in CUTS:
            for seed in self.seeds:
                for v in VARIANTS:
                    yield self.run_name(cut, v, seed), cut, v, seed, self.text_data(seed)
        for v in CHAT_VARIANTS:
            yield f"chat-{v}", "deep", v, self.seeds[0], self.chat_data()

    def student_flags(self, cut: str, data: list[str]) -> list[str]:
        return [*self.model_flags(self.pruned(cut)), "--kd-student-hf", str(self.pruned(cut)), *data]

    def train(self) -> None:
        jobs = []
        for name, cut, variant, seed, data in self.student_runs():
            ckpt = self.work / "ckpt" / name
            flags = [*self.student_flags(cut, data), *self.optim_flags, "--save", str(ckpt),
                     "--save-interval", flag(data, "--train-iters"), "--tensorboard-dir", str(self.work / "tb" / name)]
            if variant == "online":
                teacher = shlex.join([*self.teacher_flags, "--kd-teacher-hf", str(self.teacher)])
                argv = self.torchrun("-m", "benchmarks.common.online_kd", "--online-teacher", teacher, *flags)
            else:
                cache = ["--kd-cache", str(self.cache(("chat-" if name.startswith("chat") else "") + variant, seed))] \
                    if variant != "ce" else []
                argv = self.torchrun("-m", "megatron_kd.cli", "train", *flags, *cache)
            jobs.append(Job(f"train-{name}", argv, clean=ckpt))
        self.run_jobs("train", jobs)

    def export(self) -> None:
        jobs = []
        for name, cut, _, _, data in self.student_runs():
            out = self.work / "students" / name
            jobs.append(Job(f"export-{name}", self.torchrun("-m", "megatron_kd.cli", "export-hf",
                                                            *self.student_flags(cut, data), "--load",
                                                            str(self.work / "ckpt" / name), "--out", str(out)),
                            clean=out))
        self.run_jobs("export", jobs)

    # ---- scoring -----------------------------------------------------------------------------
    def megatron_eval(self, name: str) -> float | None:
        """The held-out CE ``train`` printed at its end (Megatron's evaluation, bf16)."""
        found = re.findall(r"validation loss at iteration \d+ on validation set \|.*?ce loss value: ([0-9.Ee+-]+)",
                           (self.logs / f"train-{name}.log").read_text())
        return float(found[-1]) if found else None

    def score(self) -> dict:
        import torch
        import transformers

        from benchmarks.common.heal_eval import load_models, megatron_windows, score, text_windows

        t0 = time.perf_counter()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        runs = list(self.student_runs())
        dirs = {"teacher": self.teacher, **{f"pruned-{c}": self.pruned(c) for c in CUTS},
                **{name: self.work / "students" / name for name, *_ in runs}}
        models = load_models(dirs, device=device)
        tokenizer = transformers.AutoTokenizer.from_pretrained(self.teacher)
        eod = tokenizer.eos_token_id
        text_runs = [r[0] for r in runs if not r[0].startswith("chat")]
        scored = {}

        def scored_set(label, windows, names):
            batch = self.p["eval_batch"]
            scored[label] = {k: asdict(v) for k, v in score({n: models[n] for n in ["teacher", *names]}, "teacher",
                                                            windows, batch_size=batch, device=device).items()}

        held_out = megatron_windows(self.text_data(self.seeds[0]))
        scored_set("held-out", held_out, [*(f"pruned-{c}" for c in CUTS), *text_runs])
        for label, file in OOD.items():
            windows = text_windows(Path(self.o.corpora) / file, tokenizer, seq_length=self.seq_length,
                                   count=self.p["ood_windows"], eod=eod)
            scored_set(label, windows, [*(f"pruned-{c}" for c in CUTS), *text_runs])
        scored_set("chat held-out", megatron_windows(self.chat_data()),
                   ["pruned-deep", *(r[0] for r in runs if r[0].startswith("chat"))])
        # every exported student against the evaluation its own train run printed (its seed's samples)
        check = {}
        for seed in self.seeds:
            names = [r[0] for r in runs if r[3] == seed and not r[0].startswith("chat")]
            got = score({n: models[n] for n in ["teacher", *names]}, "teacher",
                        held_out if seed == self.seeds[0] else megatron_windows(self.text_data(seed)),
                        batch_size=self.p["eval_batch"], device=device)
            check.update({n: (self.megatron_eval(n), got[n].ce) for n in names})
        chat = scored["chat held-out"]
        check.update({n: (self.megatron_eval(n), chat[n]["ce"]) for n, *_ in runs if n.startswith("chat")})
        self.stages["score"] = time.perf_counter() - t0
        return {"scores": scored, "megatron_vs_transformers": check}

    # ---- the whole benchmark -----------------------------------------------------------------
    def run(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.prepare()
        self.teacher_pass()
        self.train()
        self.export()
        if self.o.dry_run:
            return
        results = {"preset": self.p, "recipe": {"SMOL_RUN": self.run_flags, "SMOL_OPTIM": self.optim_flags},
                   "seeds": self.seeds, "cuts": CUTS, **self.score(),
                   "pruned": {c: json.loads((self.pruned(c) / "prune.json").read_text()) for c in CUTS},
                   "cache_bytes_per_token": self.cache_sizes(), "stage_seconds": self.stages}
        (self.work / "results.json").write_text(json.dumps(results, indent=1))
        (self.work / "results.md").write_text(report(results))
        print(report(results))

    def cache_sizes(self) -> dict:
        """bytes/token of each cache, as ``cache build`` printed it."""
        out = {}
        for log in sorted(self.logs.glob("cache-*.log")):
            found = re.findall(r"([0-9.]+) bytes/token", log.read_text())
            if found:
                out[log.stem.removeprefix("cache-")] = float(found[-1])
        return out


def recipe(*arrays: str) -> list[str]:
    """The flags of examples/smollm2/smollm2.sh's bash arrays."""
    script = (f'source "{ROOT}/examples/smollm2/smollm2.sh"; printf "%s\\n" '
              + " ".join(f'"${{{a}[@]}}"' for a in arrays))
    return subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]


def flag(flags: list[str], name: str) -> str:
    """The value of the last ``name`` in ``flags`` (Megatron-LM's parser keeps the last)."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def _mean(values):
    return statistics.fmean(values) if values else float("nan")


def report(r: dict) -> str:
    """The tables: per cut, held-out and out-of-domain CE, KL and top-1 (seed means), the gap each
    closes out of domain, and the Megatron / transformers agreement; then chat."""
    s, seeds = r["scores"], r["seeds"]
    ood = [k for k in s if k not in ("held-out", "chat held-out")]
    lines = []
    for cut in r["cuts"]:
        def metric(model, key, sets):
            return _mean([s[x][model][key] for x in sets])

        def runs(v, cut=cut):
            return [f"{cut}-{v}-{seed}" for seed in seeds]

        teacher_ood, pruned_ood = metric("teacher", "ce", ood), metric(f"pruned-{cut}", "ce", ood)
        gap = pruned_ood - teacher_ood
        online = _mean([(pruned_ood - metric(n, "ce", ood)) / gap for n in runs("online")])
        lines += [f"\n### {cut} cut ({' '.join(r['cuts'][cut])}), means over seeds {', '.join(map(str, seeds))}\n",
                  "| model | held-out CE | KL | top-1 | out-of-domain CE | KL | top-1 | OOD gap closed | of online KD's |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for label, names in [("teacher", ["teacher"]), ("pruned, before healing", [f"pruned-{cut}"]),
                             *((v, runs(v)) for v in VARIANTS)]:
            cells = [_mean([metric(n, k, ["held-out"]) for n in names]) for k in ("ce", "kl", "top1")]
            cells += [_mean([metric(n, k, ood) for n in names]) for k in ("ce", "kl", "top1")]
            closed = (pruned_ood - cells[3]) / gap
            extra = f"{closed:.1%} | {closed / online:.1%}" if label in VARIANTS else " | "
            lines.append(f"| {label} | " + " | ".join(f"{c:.4f}" for c in cells) + f" | {extra} |")
    lines += ["\n### out of domain, per set and seed (CE / KL / top-1)\n", "| model | " + " | ".join(ood) + " |",
              "|---|" + "---:|" * len(ood)]
    for name in s["held-out"]:
        lines.append(f"| {name} | " + " | ".join(
            f"{s[x][name]['ce']:.4f} / {s[x][name]['kl']:.4f} / {s[x][name]['top1']:.3f}" for x in ood) + " |")
    lines += ["\n### chat: answer tokens of held-out conversations\n", "| model | answer CE | KL | top-1 |",
              "|---|---:|---:|---:|"]
    for name, v in s["chat held-out"].items():
        lines.append(f"| {name} | {v['ce']:.4f} | {v['kl']:.4f} | {v['top1']:.3f} |")
    lines += ["\n### held-out CE: Megatron's evaluation at the end of train vs transformers on the export\n",
              "| student | Megatron | transformers | difference |", "|---|---:|---:|---:|"]
    for name, (megatron, hf) in r["megatron_vs_transformers"].items():
        diff = f"{hf - megatron:+.2e}" if megatron is not None else "no evaluation in the log"
        lines.append(f"| {name} | {megatron if megatron is not None else float('nan'):.5f} | {hf:.5f} | {diff} |")
    return "\n".join(lines) + "\n"
