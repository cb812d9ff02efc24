"""The CPU demo (`megatron-kd demo`): a real offline distillation, end to end, in a few minutes.

1. Corpus: the Python standard library's own source files, read at run time, byte-tokenized into a
   Megatron indexed dataset (.bin/.idx); megatron-core's GPTDataset splits it (train / held-out).
2. Teacher: a megatron-core GPTModel trained briefly with cross-entropy.
3. Teacher pass: the teacher's top-K log-probabilities for every sample the student will see, in
   the student's sample order, written to a Zarr cache (``capture_teacher``).
4. Students (smaller GPTModels, same initialization): one distilled from the cache through the fused
   loss (``KDForwardStep``: the same forward step and loss function as ``megatron-kd train``), one
   trained with cross-entropy only, for the same steps.
5. Held-out cross-entropy of all three, a PNG of the loss curves and TensorBoard logs.

megatron.training needs CUDA, so this CPU path drives megatron-core modules with a minimal loop
(AdamW, cosine schedule); on GPUs the same forward step runs inside megatron.training.pretrain.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class DemoConfig:
    workdir: str = "runs/demo"
    seq_length: int = 128
    micro_batch_size: int = 16
    corpus_bytes: int = 2_500_000
    teacher_layers: int = 4
    teacher_hidden: int = 128
    student_layers: int = 2
    student_hidden: int = 48
    heads: int = 4
    teacher_steps: int = 600
    student_steps: int = 400
    eval_samples: int = 128
    lr: float = 3e-3
    topk: int = 32
    kd_temperature: float = 1.0
    # ghost, not --kd-tail's renorm: at this byte-level scale (top-32 mass 0.98) it measured better
    # (held-out 2.260 against renorm's 2.300 nats/token; README, CPU demo)
    kd_tail: str = "ghost"
    kd_ce_weight: float = 0.0
    seed: int = 1234
    log_interval: int = 25

    def __post_init__(self):
        # checked before any work: a bad value must not surface after minutes of training
        from megatron_kd.errors import FlagError
        from megatron_kd.ops import TAILS

        if self.kd_tail not in TAILS:
            raise FlagError(f"--kd-tail must be one of {TAILS}, got {self.kd_tail!r}")
        positive = ("seq_length", "micro_batch_size", "corpus_bytes", "teacher_layers", "teacher_hidden",
                    "student_layers", "student_hidden", "heads", "teacher_steps", "student_steps", "eval_samples",
                    "topk", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise FlagError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "kd_temperature"):
            if getattr(self, name) <= 0:
                raise FlagError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.kd_ce_weight < 0:
            raise FlagError(f"--kd-ce-weight must be >= 0, got {self.kd_ce_weight}")
        for hidden in ("teacher_hidden", "student_hidden"):
            if getattr(self, hidden) % self.heads:
                raise FlagError(f"--{hidden.replace('_', '-')} ({getattr(self, hidden)}) must be divisible by "
                                f"--heads ({self.heads})")
        if self.topk > 258:
            raise FlagError(f"--topk must be <= 258 (the byte vocabulary), got {self.topk}")


def read_corpus(max_bytes: int) -> list[str]:
    """The standard library's top-level .py files (under 100 KB each), sorted by name, up to ``max_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > 100_000:
            continue
        if total + len(text) > max_bytes and docs:
            break
        docs.append(text)
        total += len(text)
    if len(docs) < 20:
        raise RuntimeError(f"found only {len(docs)} source files under {stdlib}; the demo needs the stdlib sources")
    return docs


def _init_single_process():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1)


def _model(cfg: DemoConfig, layers: int, hidden: int, vocab: int, seed: int):
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=cfg.heads,
                               use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0,
                               hidden_dropout=0.0, normalization="RMSNorm", init_method_std=0.02)
    # learned absolute positions: megatron-core's rotary embedding moves itself to CUDA
    return build_gpt_model(config, vocab_size=vocab, max_sequence_length=cfg.seq_length,
                           position_embedding_type="learned_absolute", use_te=False)


def config_key(cfg: DemoConfig) -> str:
    """What a checkpoint of this demo depends on (not where it is written or how often it logs)."""
    return json.dumps({k: v for k, v in asdict(cfg).items() if k not in ("workdir", "log_interval")}, sort_keys=True)


def batch_at(dataset, step: int, batch_size: int) -> dict:
    """Micro-batch ``step`` (1-based) of a dataset read in order, as Megatron's sampler hands it to a
    single data-parallel rank: samples [(step-1)·b, step·b). Indexed by step, so a resumed run
    reads exactly the samples (and teacher rows) the interrupted one would have."""
    items = [dataset[i] for i in range((step - 1) * batch_size, step * batch_size)]
    return torch.utils.data.default_collate(items)


def _ce_step(model, batch):
    """Megatron's own language-model loss: per-token cross-entropy [b, s] from labels."""
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"]
    return (losses * mask).sum(), mask.sum()


def train_loop(name, model, steps, step_fn, cfg: DemoConfig, writer, log,
               checkpoint: Path | None = None) -> list[tuple[int, float]]:
    """AdamW + warm-up/cosine for ``steps`` steps of ``step_fn(model, step)``; returns the curve.

    With ``checkpoint``, the model, optimizer, schedule and curve are saved every log interval
    (written to a temporary file, then renamed: a kill never leaves a torn checkpoint), and a run
    that finds one continues after its last step: the same batches, teacher rows and losses as a
    run that was never interrupted."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) * 0.9 + 0.1)
    curve, first = [], 1
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["steps"] == steps and state["config"] == config_key(cfg):
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["schedule"])
            curve, first = state["curve"], state["step"] + 1
            log(f"  {name:10} resumed after step {state['step']} from {checkpoint}")
    model.train()
    t0, tokens = time.perf_counter(), 0
    for step in range(first, steps + 1):
        loss_sum, num_tokens, report = step_fn(model, step)
        (loss_sum / num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(num_tokens)
        value = loss_sum.item() / float(num_tokens)
        # curves compare cross-entropy on the labels (the KD student reports its own as "ce loss")
        ce = report.get("ce loss")
        curve.append((step, float(ce[0]) / max(float(ce[1]), 1.0) if ce is not None else value))
        writer.add_scalar(f"{name}/loss", value, step)
        for key, (s, n) in report.items():
            writer.add_scalar(f"{name}/{key}", float(s) / max(float(n), 1.0), step)
        if step % cfg.log_interval == 0 or step == steps:
            if checkpoint is not None:
                tmp = checkpoint.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": sched.state_dict(),
                            "step": step, "steps": steps, "curve": curve, "config": config_key(cfg)}, tmp)
                os.replace(tmp, checkpoint)
            rate = tokens / (time.perf_counter() - t0)
            writer.add_scalar(f"{name}/tokens_per_s", rate, step)
            log(f"  {name:10} step {step:4d}/{steps}  loss {value:.3f}  "
                + "  ".join(f"{k} {float(s) / max(float(n), 1.0):.3f}" for k, (s, n) in report.items()
                            if k != "lm loss")
                + f"  {rate:,.0f} tokens/s")
    return curve


@torch.no_grad()
def evaluate(model, dataset, batch_size: int) -> float:
    """Mean held-out cross-entropy per token (nats)."""
    model.eval()
    total, count = 0.0, 0.0
    for batch in torch.utils.data.DataLoader(dataset, batch_size=batch_size):
        loss, n = _ce_step(model, batch)
        total, count = total + float(loss), count + float(n)
    model.train()
    return total / count


def _plot(curves: dict, path: Path, table: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve in curves.items():
        steps, values = zip(*curve)
        ax.plot(steps, values, label=f"{name} (held-out {table[name]:.3f})", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training cross-entropy (nats/token)")
    ax.set_title("megatron_kd CPU demo: byte-level LMs on the Python standard library")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def open_cache_writer(cache: Path, **params):
    """The demo's cache writer: a cache left by other settings (another teacher) or damaged is
    started again; one that another demo is writing right now is left alone (CacheBusyError)."""
    from megatron_kd.cache import CacheBusyError, CacheError, CacheWriter

    try:
        return CacheWriter(cache, **params)
    except CacheBusyError:
        raise
    except CacheError:
        shutil.rmtree(cache)
        return CacheWriter(cache, **params)


def run_demo(cfg: DemoConfig, log=print) -> dict:
    # (imported here so that `megatron-kd --help` and the cache commands stay light)
    from torch.utils.tensorboard import SummaryWriter

    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.data import (
        ByteTokenizer,
        build_gpt_datasets,
        dataset_fingerprint,
        tokenizer_fingerprint,
        write_indexed_dataset,
    )
    from megatron_kd.megatron.kd_data import KDDataset
    from megatron_kd.megatron.loss import KDForwardStep
    from megatron_kd.teacher import CaptureConfig, MegatronTeacher, capture_teacher

    start = time.perf_counter()
    work = Path(cfg.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    _init_single_process()
    tok = ByteTokenizer()
    vocab = tok.vocab_size

    docs = read_corpus(cfg.corpus_bytes)
    prefix = write_indexed_dataset(work / "data" / "stdlib", ([*tok.tokenize(d), tok.eod] for d in docs), vocab)
    log(f"[1/5] corpus: {len(docs)} standard-library files, {sum(map(len, docs)):,} bytes -> {prefix}.bin/.idx")

    mbs = cfg.micro_batch_size
    common = dict(split="95,5,0", seq_length=cfg.seq_length, seed=cfg.seed, tokenizer=tok,
                  cache_dir=str(work / "data" / "index-cache"))
    teacher_ds, valid_ds, _ = build_gpt_datasets([prefix], num_samples=(cfg.teacher_steps * mbs, cfg.eval_samples, 0),
                                                 **common)
    student_ds, _, _ = build_gpt_datasets([prefix], num_samples=(cfg.student_steps * mbs, cfg.eval_samples, 0),
                                          **common)
    tb = SummaryWriter(str(work / "tensorboard"))

    teacher = _model(cfg, cfg.teacher_layers, cfg.teacher_hidden, vocab, cfg.seed)
    n_teacher = sum(p.numel() for p in teacher.parameters())
    log(f"[2/5] teacher: GPTModel {cfg.teacher_layers} layers x {cfg.teacher_hidden}, {n_teacher:,} parameters, "
        f"{cfg.teacher_steps} steps of {mbs} x {cfg.seq_length} tokens")
    checkpoints = work / "checkpoints"  # a killed demo, run again, resumes each stage where it stopped
    checkpoints.mkdir(exist_ok=True)
    curves = {"teacher": train_loop("teacher", teacher, cfg.teacher_steps,
                                    lambda m, step: (*_ce_step(m, batch_at(teacher_ds, step, mbs)), {}), cfg, tb, log,
                                    checkpoint=checkpoints / "teacher.pt")}

    cache = work / "teacher-cache"
    # training is deterministic: the same settings give the same teacher, whose cache a rerun resumes
    digest = hashlib.sha256(config_key(cfg).encode()).hexdigest()[:16]
    teacher_model = MegatronTeacher(teacher.eval(), vocab_size=vocab, fingerprint=f"demo-teacher-{n_teacher}-{digest}")
    meta = {"teacher_fingerprint": teacher_model.fingerprint, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "dataset_fingerprint": dataset_fingerprint(student_ds)}
    params = dict(vocab_size=vocab, topk=cfg.topk, seq_length=cfg.seq_length, num_samples=cfg.student_steps * mbs,
                  micro_batch_size=mbs, metadata=meta)
    writer = open_cache_writer(cache, **params)
    # the samples the student consumes (steps x micro-batch), in its order
    with writer:
        summary = capture_teacher(teacher_model, student_ds, writer, CaptureConfig(topk=cfg.topk, micro_batch_size=mbs),
                                  device=torch.device("cpu"), progress=False)
    log(f"[3/5] teacher pass: {summary['samples']} samples, {summary['tokens']:,} tokens, K={cfg.topk}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, mean top-K mass {summary['mean_teacher_mass']:.3f} -> {cache}")

    kd = KDConfig(cache=str(cache), temperature=cfg.kd_temperature, tail=cfg.kd_tail, ce_weight=cfg.kd_ce_weight)
    student_kd = _model(cfg, cfg.student_layers, cfg.student_hidden, vocab, cfg.seed + 1)
    n_student = sum(p.numel() for p in student_kd.parameters())
    log(f"[4/5] students: GPTModel {cfg.student_layers} layers x {cfg.student_hidden}, {n_student:,} parameters, "
        f"{cfg.student_steps} steps; KD: fused top-{cfg.topk} loss, tail={kd.tail}, T={kd.temperature}, "
        f"ce_weight={kd.ce_weight}")
    kd_data = KDDataset(student_ds, str(cache), tokenizer=tok, required_samples=cfg.student_steps * mbs)
    forward_step = KDForwardStep(kd, device=torch.device("cpu"))

    def kd_step(model, step):
        output, loss_fn = forward_step(iter([batch_at(kd_data, step, mbs)]), model)
        return loss_fn(output)

    curves["student KD"] = train_loop("student_kd", student_kd, cfg.student_steps, kd_step, cfg, tb, log,
                                      checkpoint=checkpoints / "student_kd.pt")
    student_ce = _model(cfg, cfg.student_layers, cfg.student_hidden, vocab, cfg.seed + 1)
    curves["student CE"] = train_loop("student_ce", student_ce, cfg.student_steps,
                                      lambda m, step: (*_ce_step(m, batch_at(student_ds, step, mbs)), {}), cfg, tb,
                                      log, checkpoint=checkpoints / "student_ce.pt")

    table = {"teacher": evaluate(teacher, valid_ds, mbs), "student KD": evaluate(student_kd, valid_ds, mbs),
             "student CE": evaluate(student_ce, valid_ds, mbs)}
    for name, value in table.items():
        tb.add_scalar(f"heldout/{name.replace(' ', '_')}", value, 0)
    tb.close()
    _plot(curves, work / "loss_curves.png", table)
    elapsed = time.perf_counter() - start
    log(f"[5/5] held-out cross-entropy on {len(valid_ds)} unseen samples ({len(valid_ds) * cfg.seq_length:,} tokens):")
    log(f"  {'model':12} {'nats/token':>10} {'bits/byte':>10}")
    for name, value in table.items():
        log(f"  {name:12} {value:10.3f} {value / math.log(2):10.3f}")
    gain = table["student CE"] - table["student KD"]
    log(f"  distillation gain over CE-only at equal steps: {gain:+.3f} nats/token")
    log(f"  plot: {work / 'loss_curves.png'}  tensorboard: {work / 'tensorboard'}  ({elapsed:.0f} s)")
    result = {"heldout": table, "gain": gain, "seconds": elapsed, "config": asdict(cfg),
              "teacher_pass": summary, "curves": curves}
    (work / "results.json").write_text(json.dumps(result, indent=2))
    return result
