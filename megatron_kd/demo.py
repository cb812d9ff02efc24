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

Settings are checked before any work, each mistake one line (FlagError): every number finite and
in its range (``DemoConfig``), the workdir a directory, the corpus large enough for the samples
asked of each split (``check_corpus``), the peak memory within what the machine has
(``check_memory``). The demo owns its workdir: a cache of other settings or a damaged one is built
again, said in one line, but never while another demo holds a partition's writer lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from megatron_kd.distributed import init_process_group


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
    kd_divergence: str = "forward"
    kd_jsd_beta: float = 0.5
    seed: int = 1234
    log_interval: int = 25

    def __post_init__(self):
        # checked before any work: a bad value must not surface after minutes of training
        from megatron_kd.errors import FlagError
        from megatron_kd.ops import DIVERGENCES, TAILS

        for f in fields(self):
            check_number(f.name, getattr(self, f.name), type(f.default))
        if self.kd_tail not in TAILS:
            raise FlagError(f"--kd-tail must be one of {TAILS}, got {self.kd_tail!r}")
        if self.kd_divergence not in DIVERGENCES:
            raise FlagError(f"--kd-divergence must be one of {DIVERGENCES}, got {self.kd_divergence!r}")
        if self.kd_divergence != "forward" and self.kd_tail == "none":
            raise FlagError(f"--kd-divergence {self.kd_divergence} needs --kd-tail renorm or ghost, got none")
        if not self.workdir:
            raise FlagError("--workdir must name a directory, got ''")
        for hidden in ("teacher_hidden", "student_hidden"):
            if getattr(self, hidden) % self.heads:
                raise FlagError(f"--{hidden.replace('_', '-')} ({getattr(self, hidden)}) must be divisible by "
                                f"--heads ({self.heads})")
        if self.topk > 258:
            raise FlagError(f"--topk must be <= 258 (the byte vocabulary), got {self.topk}")


# Every int / float field of DemoConfig must be finite and positive, except these (flag -> why):
NUMBER_RANGES = {
    "kd_ce_weight": ("[0, inf)", 0.0, True, math.inf),  # 0: no cross-entropy term
    "seed": ("[0, 2^32)", 0, True, 2**32),  # numpy's RandomState, which megatron's GPTDataset seeds
    "kd_jsd_beta": ("(0, 1)", 0.0, False, 1.0),
}


def check_number(name: str, value, kind: type) -> None:
    """One setting: an int field takes an int, a float field an int or float; finite; in range."""
    from megatron_kd.errors import FlagError

    if kind not in (int, float):
        return
    flag = f"--{name.replace('_', '-')}"
    numeric = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise FlagError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    text, low, low_closed, high = NUMBER_RANGES.get(name, ("> 0", 0, False, math.inf))
    inside = math.isfinite(value) and (value >= low if low_closed else value > low) and value < high
    if not inside:
        raise FlagError(f"{flag} must be finite and {text if text.startswith('>') else 'in ' + text}, got {value}")


MIN_FILES = 20
SPLIT = (95, 5, 0)  # train / held-out / test, as megatron's --split "95,5,0"


def read_corpus(max_bytes: int) -> list[str]:
    """The standard library's top-level .py files (under 100 KB each), sorted by name, up to ``max_bytes``."""
    from megatron_kd.errors import FlagError, UserError

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, total, available, full = [], 0, 0, False
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > 100_000:
            continue
        available += 1  # counted past the budget too: a small --corpus-bytes is not missing sources
        full = full or (total + len(text) > max_bytes and bool(docs))
        if not full:  # the files in name order up to the first that does not fit
            docs.append(text)
            total += len(text)
    if available < MIN_FILES:
        raise UserError(f"found only {available} source files under {stdlib}; the demo needs the Python standard "
                        f"library's sources ({MIN_FILES} files at least)")
    if len(docs) < MIN_FILES:
        raise FlagError(f"--corpus-bytes {max_bytes} holds {len(docs)} standard-library files, the demo needs "
                        f"{MIN_FILES} at least: raise --corpus-bytes (600000 is enough)")
    return docs


def split_samples(doc_tokens: list[int], seq_length: int) -> tuple[int, int]:
    """Distinct samples in one epoch of the train and held-out splits, as megatron-core's GPTDataset
    makes them: the split is over documents (split b gets documents [round(lo·n), round(hi·n))), an
    epoch of a split holds (its tokens - 1) // seq_length samples (each reads seq_length + 1 tokens)."""
    n, total = len(doc_tokens), sum(SPLIT)
    bounds = [0.0, SPLIT[0] / total, (SPLIT[0] + SPLIT[1]) / total]
    train_end, valid_end = int(round(bounds[1] * n)), int(round(bounds[2] * n))
    train_tokens, valid_tokens = sum(doc_tokens[:train_end]), sum(doc_tokens[train_end:valid_end])
    return max(0, (train_tokens - 1) // seq_length), max(0, (valid_tokens - 1) // seq_length)


def check_corpus(cfg: "DemoConfig", doc_tokens: list[int]) -> None:
    """The held-out split must hold --eval-samples distinct samples (they are "unseen" samples only
    if none repeats), the train split one micro-batch of distinct samples (more steps than that
    only repeat epochs, as training does)."""
    from megatron_kd.errors import FlagError

    train, valid = split_samples(doc_tokens, cfg.seq_length)
    where = (f"--corpus-bytes {cfg.corpus_bytes} ({len(doc_tokens)} files, {sum(doc_tokens):,} tokens; split "
             f"{','.join(map(str, SPLIT))} by file) at --seq-length {cfg.seq_length}")
    if valid < cfg.eval_samples:
        raise FlagError(f"{where} gives {valid} held-out samples, --eval-samples asks {cfg.eval_samples}: raise "
                        f"--corpus-bytes or lower --eval-samples / --seq-length")
    if train < cfg.micro_batch_size:
        raise FlagError(f"{where} gives {train} training samples per epoch, fewer than --micro-batch-size "
                        f"{cfg.micro_batch_size}: raise --corpus-bytes or lower --micro-batch-size / --seq-length")


def check_workdir(workdir: str) -> None:
    from megatron_kd.errors import FlagError

    path = Path(workdir)
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                raise FlagError(f"--workdir {workdir}: {existing} is a file, expected a directory")
            if not os.access(existing, os.W_OK | os.X_OK):
                raise FlagError(f"--workdir {workdir}: {existing} is not writable")
            return


# The memory check is a guard on this CPU process's resident memory, not a plan of a GPU run: its
# models' parameters are counted by ``megatron-kd plan``'s model (``model_parameters``), the rest is
# what this process itself holds, measured on this project's CPU machine (torch 2.11, 2026-12-01,
# one training step of a demo GPTModel, ru_maxrss): 0.85 GiB of interpreter and libraries before
# any model, and 0.36 GiB more once plan's model is asked (it builds Megatron-LM's argument parser:
# ru_maxrss 0.65 GiB after importing this module, 1.02 after ``model_parameters``; 2026-12-07); then per token of a micro-batch ~130 bytes per layer per hidden unit (what torch's
# fp32 eager autograd keeps; plan's bf16 GPU activations are 44, 88 in fp32) plus ~12 KiB
# (embeddings, logits over the 258-byte vocabulary, loss), linear in the sequence length up to 32K
# tokens: torch's CPU SDPA kernel never holds the [b, heads, s, s] scores. The estimate takes
# 1.3 GiB, 160 B and 16 KiB and adds weights, gradients and AdamW's two moments.
RUNTIME_BYTES = int(1.3 * 2**30)
ACTIVATION_BYTES_PER_LAYER_UNIT = 160
ACTIVATION_BYTES_PER_TOKEN = 16 << 10
# train_loop's torch.optim.AdamW over fp32 parameters: the weight, its gradient, two moments (not
# Megatron's mixed-precision optimizer, whose bytes plan counts)
WEIGHT_BYTES_PER_PARAM = 4
TRAINING_BYTES_PER_PARAM = 16
VOCAB = 258


def model_flags(layers: int, hidden: int, heads: int, seq_length: int) -> list[str]:
    """One of the demo's GPTModels (``_model``) as the Megatron-LM flags ``megatron-kd plan`` reads:
    fp32, the byte vocabulary unpadded, learned positions, an untied output layer, RMSNorm,
    megatron-core's local spec."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1", "--normalization", "RMSNorm",
            "--untie-embeddings-and-output-weights", "--position-embedding-type", "learned_absolute",
            "--transformer-impl", "local"]


@functools.lru_cache(maxsize=16)
def model_parameters(layers: int, hidden: int, heads: int, seq_length: int) -> int:
    """Parameters of one of the demo's models as ``megatron-kd plan`` counts them
    (``plan.model_parameters``: Megatron-LM's estimator, which leaves out the linear biases and the
    position table, 2% of the demo's teacher)."""
    from megatron_kd.megatron import plan

    args, _ = plan.plan_args(model_flags(layers, hidden, heads, seq_length), gpus=1)
    return int(plan.model_parameters(args) + 0.5)  # the nearest integer (the estimator divides floats)


def estimate_peak_bytes(cfg: "DemoConfig") -> int:
    """The demo's peak resident memory: training its larger model dominates (the teacher pass and
    evaluation run without gradients); the teacher stays in memory while the students train."""
    tokens = cfg.micro_batch_size * cfg.seq_length
    models = [(cfg.teacher_layers, cfg.teacher_hidden), (cfg.student_layers, cfg.student_hidden)]
    params = [model_parameters(layers, hidden, cfg.heads, cfg.seq_length) for layers, hidden in models]
    training = max(TRAINING_BYTES_PER_PARAM * n
                   + tokens * (ACTIVATION_BYTES_PER_LAYER_UNIT * layers * hidden + ACTIVATION_BYTES_PER_TOKEN)
                   for n, (layers, hidden) in zip(params, models))
    return RUNTIME_BYTES + WEIGHT_BYTES_PER_PARAM * params[0] + training


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(cfg: "DemoConfig", available: int | None = None) -> None:
    from megatron_kd.errors import FlagError

    need, have = estimate_peak_bytes(cfg), available_memory_bytes() if available is None else available
    if need > have:
        layers, hidden = max((cfg.teacher_layers, cfg.teacher_hidden), (cfg.student_layers, cfg.student_hidden),
                             key=lambda m: m[0] * m[1])
        raise FlagError(f"--seq-length {cfg.seq_length} x --micro-batch-size {cfg.micro_batch_size} (a {layers}-layer, "
                        f"{hidden}-wide model) needs about {need / 2**30:,.1f} GiB of memory, this machine has "
                        f"{have / 2**30:,.1f} GiB available: lower --seq-length or --micro-batch-size")


def _init_single_process():
    init_process_group("gloo")
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


def _load_checkpoint(checkpoint: Path, name: str, log) -> dict | None:
    """A checkpoint ``train_loop`` wrote, read with ``weights_only``: tensors, dicts, lists, numbers
    and strings only, so a file planted in the workdir runs no code. One it cannot read (another
    format, damaged) is said in one line; the stage then starts over and writes its own."""
    import pickle

    try:
        state = torch.load(checkpoint, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        log(f"  {name:10} checkpoint {checkpoint} cannot be resumed ({' '.join(str(e).split())[:200]}); "
            "starting this stage again")
        return None
    return state if isinstance(state, dict) else None


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
    state = _load_checkpoint(checkpoint, name, log) if checkpoint is not None and checkpoint.exists() else None
    if state is not None:
        if state.get("steps") == steps and state.get("config") == config_key(cfg):
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


@contextlib.contextmanager
def partitions_locked(cache: Path):
    """Hold every partition's writer lock of ``cache`` (the exclusive flock a CacheWriter takes on
    dp_NNNNN/.writer.lock), or raise CacheBusyError naming the one another writer holds."""
    from megatron_kd.cache import CacheBusyError
    from megatron_kd.cache.store import LOCK_FILE

    with contextlib.ExitStack() as held:
        for file in sorted(Path(cache).glob(f"dp_*/{LOCK_FILE}")):
            handle = held.enter_context(open(file, "ab"))
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheBusyError(f"{cache}: another demo is writing this cache (it holds {file}); wait for it "
                                     f"or use another --workdir") from None
        yield


def start_cache_again(cache: Path) -> None:
    """Delete the demo's cache, under every partition's lock: never one that a live writer holds."""
    with partitions_locked(cache):
        if cache.is_dir() and not cache.is_symlink():
            shutil.rmtree(cache)
        else:
            cache.unlink(missing_ok=True)


def open_cache_writer(cache: Path, *, log=print, **params):
    """The demo's cache writer. A cache left by other settings (another teacher) or one that cannot
    be opened is started again, said in one line; one that another demo is writing right now
    (CacheBusyError) or that cannot be written here (CacheWriteError: it may be fine) is left alone."""
    from megatron_kd.cache import CacheBusyError, CacheError, CacheWriteError, CacheWriter

    cache = Path(cache)
    try:
        return CacheWriter(cache, **params)
    except (CacheBusyError, CacheWriteError):
        raise
    except CacheError as e:
        start_cache_again(cache)
        log(f"  teacher cache {cache} cannot be resumed ({' '.join(str(e).split())}); building it again")
        return CacheWriter(cache, **params)


def _pass_record(work: Path) -> Path:
    return work / "teacher-pass.json"


def build_teacher_cache(cache: Path, work: Path, params: dict, run_pass, log) -> dict:
    """Bring the demo's cache up to date and say what it holds.

    ``run_pass(writer)`` runs the teacher over the writer's pending samples (capture_teacher's
    summary). Each run that computes samples is appended to the workdir's teacher-pass.json (reset
    when the cache starts from nothing), so a resumed or skipped pass still reports the throughput
    of the runs that built the cache. A cache this run did not write whole is then verified
    (every file, every block): a damaged one is built again once, said in one line (a shard found
    missing when the writer opens is computed again, also said). Returns the report: the cache's own
    content (``inspect``), how this run got it (built / resumed / skipped) and the throughput.
    """
    from megatron_kd.cache import CacheError
    from megatron_kd.cache.inspect import inspect, verify

    record_file = _pass_record(work)
    for attempt in range(2):
        writer = open_cache_writer(cache, log=log, **params)
        with writer:
            pending = len(writer.pending_samples())
            if len(writer.repaired_samples):
                log(f"  teacher cache {cache}: {len(writer.repairs)} damaged shard(s) ({writer.repairs[0]}); "
                    f"computing their {len(writer.repaired_samples)} samples again")
            runs = [] if pending == writer.num_rows or not record_file.exists() else \
                json.loads(record_file.read_text()).get("runs", [])
            summary = run_pass(writer)
        if summary["samples"]:
            runs.append({"samples": summary["samples"], "tokens": summary["tokens"], "seconds": summary["seconds"]})
            record_file.write_text(json.dumps({"cache": str(cache), "runs": runs}, indent=2))
        try:
            # rows found on disk are verified (every file, every block); a cache written whole by
            # this run is not, beyond what inspect's decode of every block checks
            if summary["samples"] < writer.num_rows:
                verify(cache, progress=False)
            content = inspect(cache, progress=False)
            break
        except CacheError as e:
            if attempt:
                raise
            log(f"  teacher cache {cache} is damaged ({' '.join(str(e).split())}); building it again")
            start_cache_again(cache)
    status = "built" if summary["samples"] == content["samples"] else "resumed" if summary["samples"] else "skipped"
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    return {"status": status, "samples": content["samples"], "tokens": content["tokens"],
            "mean_teacher_mass": content["mean_teacher_mass"], "bytes": content["bytes"],
            "samples_computed_now": summary["samples"], "seconds": seconds if runs else None,
            "tokens_per_s": tokens / seconds if runs and seconds > 0 else None}


def describe_teacher_pass(report: dict, topk: int, cache: Path) -> str:
    rate = (f"{report['tokens_per_s']:,.0f} tokens/s" if report["tokens_per_s"] is not None
            else "throughput not recorded")
    content = (f"{report['samples']} samples, {report['tokens']:,} tokens, K={topk}, mean top-K mass "
               f"{report['mean_teacher_mass']:.3f}")
    if report["status"] == "built":
        return f"[3/5] teacher pass: {content}, {rate} -> {cache}"
    if report["status"] == "resumed":
        return (f"[3/5] teacher pass resumed: {report['samples_computed_now']} of {report['samples']} samples "
                f"computed now; cache {cache}: {content}; {rate} over the runs that built it")
    return (f"[3/5] teacher pass skipped: the cache of an earlier run is complete and verified; cache {cache}: "
            f"{content}; built at {rate}")


def run_demo(cfg: DemoConfig, log=print) -> dict:
    start = time.perf_counter()
    # every check before any work: nothing is written, nothing trained, for a setting that cannot run
    check_workdir(cfg.workdir)
    check_memory(cfg)

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
    from megatron_kd.teacher.fingerprint import module_fingerprint

    tok = ByteTokenizer()
    vocab = tok.vocab_size
    docs = read_corpus(cfg.corpus_bytes)
    doc_tokens = [len(tok.tokenize(d)) + 1 for d in docs]  # + the end-of-document token
    check_corpus(cfg, doc_tokens)

    work = Path(cfg.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    _init_single_process()
    prefix = write_indexed_dataset(work / "data" / "stdlib", ([*tok.tokenize(d), tok.eod] for d in docs), vocab)
    log(f"[1/5] corpus: {len(docs)} standard-library files, {sum(doc_tokens):,} tokens -> {prefix}.bin/.idx")

    mbs = cfg.micro_batch_size
    common = dict(split=",".join(map(str, SPLIT)), seq_length=cfg.seq_length, seed=cfg.seed, tokenizer=tok,
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
    # the teacher's own weights name it: the same settings train the same teacher (training is
    # deterministic), whose cache a rerun resumes
    teacher_model = MegatronTeacher(teacher.eval(), vocab_size=vocab, fingerprint=module_fingerprint(teacher))
    meta = {"teacher_fingerprint": teacher_model.fingerprint, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "dataset_fingerprint": dataset_fingerprint(student_ds)}
    params = dict(vocab_size=vocab, topk=cfg.topk, seq_length=cfg.seq_length, num_samples=cfg.student_steps * mbs,
                  micro_batch_size=mbs, metadata=meta)

    def run_pass(writer):  # the samples the student consumes (steps x micro-batch), in its order
        return capture_teacher(teacher_model, student_ds, writer, CaptureConfig(topk=cfg.topk, micro_batch_size=mbs),
                               device=torch.device("cpu"), progress=False)

    teacher_pass = build_teacher_cache(cache, work, params, run_pass, log)
    log(describe_teacher_pass(teacher_pass, cfg.topk, cache))

    kd = KDConfig(cache=str(cache), temperature=cfg.kd_temperature, tail=cfg.kd_tail, ce_weight=cfg.kd_ce_weight,
                  divergence=cfg.kd_divergence, jsd_beta=cfg.kd_jsd_beta)
    student_kd = _model(cfg, cfg.student_layers, cfg.student_hidden, vocab, cfg.seed + 1)
    n_student = sum(p.numel() for p in student_kd.parameters())
    log(f"[4/5] students: GPTModel {cfg.student_layers} layers x {cfg.student_hidden}, {n_student:,} parameters, "
        f"{cfg.student_steps} steps; KD: fused top-{cfg.topk} loss, divergence={kd.divergence}"
        f"{f' (beta {kd.jsd_beta})' if kd.divergence == 'jsd' else ''}, tail={kd.tail}, T={kd.temperature}, "
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
              "teacher_pass": teacher_pass, "curves": curves}
    (work / "results.json").write_text(json.dumps(result, indent=2))
    return result
