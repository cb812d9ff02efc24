"""The chat benchmark's pipeline (``python -m benchmarks.bench_chat``, whose docstring says what it
measures and how): conversations from the standard library's docstrings, ``ChatBench`` (the fidelity
benchmark's ``Bench`` on the product's chat path), the report, and ``run``, the whole benchmark.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import shutil
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.fidelity import (Bench, Variant, _setup, _start_process, heldout_metrics, packing_of,
                                        parse_variant, train_bpe)

SYSTEM = ("You are a concise assistant. You explain what the modules, classes and functions of Python's standard "
          "library do, quoting their documentation.")
QUESTIONS = {
    "module": ("What is the Python module {module} for?", "Give me a short summary of the {module} module.",
               "What do I get from `import {module}`?"),
    "function": ("What does {module}.{name}() do?", "Explain the function {name} from {module}.",
                 "What is `{name}` in the {module} module for?"),
    "class": ("What is the class {module}.{name}?", "What does {name} in {module} represent?",
              "Explain the {name} class of {module}."),
    "method": ("What does {name}() do in {module}?", "Explain the method {name} of the {module} module.",
               "What is `{name}` for ({module})?"),
}
ANSWER_LINES, MIN_ANSWER_CHARS, MAX_TURNS, ANALYSIS_FRACTION = 3, 20, 3, 1 / 3
SKIPPED_DIRS = {"site-packages", "__pycache__", "test", "tests", "idle_test"}
DEFAULT_VARIANT = "top32-renorm"
# bench_fidelity's CPU preset with the chat corpus' budget: 0.5 MB of training conversations (about
# half of what the standard library's docstrings give) and a teacher of 400 steps (the templates are
# learnt in its first steps; at 400 its held-out answer CE still falls ~2% per 100 steps).
CHAT_PRESETS = {"cpu": {"corpus_bytes": 500_000, "max_file_bytes": 250_000, "bpe_bytes": 500_000,
                        "teacher_steps": 400}}


# ----------------------------------------------------------------------------------------------
# conversations


@dataclass(frozen=True)
class Subject:
    """One thing a conversation asks about."""

    module: str  # dotted name
    name: str  # "" (the module itself), "function", "Class" or "Class.method"
    kind: str  # a QUESTIONS key
    detail: str  # a function's or method's parameters, a class's bases, a module's public names
    answer: str  # the docstring's first paragraph, its lines joined


def stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted name, source) of the standard library's public modules outside test directories, in
    the order of a hash of the name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d.isidentifier() and d not in SKIPPED_DIRS
                             and not d.startswith("_"))
        package = Path(dirpath).relative_to(root).parts
        for name in filenames:
            stem = name[:-3]
            if name.endswith(".py") and stem.isidentifier() and (stem == "__init__" or not stem.startswith("_")):
                parts = package if stem == "__init__" else (*package, stem)
                if parts:
                    found.append((".".join(parts), Path(dirpath, name)))
    return sorted(found, key=lambda item: hashlib.sha1(item[0].encode()).digest())


def first_paragraph(node) -> str:
    doc = ast.get_docstring(node) or ""
    return " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines()[:ANSWER_LINES])


def module_subjects(module: str, tree: ast.Module) -> list[Subject]:
    """The module and its public functions, classes and their methods that have an answer, in
    source order."""
    def public(node):
        return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_")

    defs = [node for node in tree.body if public(node)]
    classes = sum(isinstance(node, ast.ClassDef) for node in defs)
    found = [Subject(module, "", "module", f"{len(defs) - classes} public functions and {classes} public classes",
                     first_paragraph(tree))]
    for node in defs:
        if isinstance(node, ast.ClassDef):
            found.append(Subject(module, node.name, "class", ", ".join(map(ast.unparse, node.bases)),
                                 first_paragraph(node)))
            found += [Subject(module, f"{node.name}.{m.name}", "method", ast.unparse(m.args), first_paragraph(m))
                      for m in node.body if public(m) and not isinstance(m, ast.ClassDef)]
        else:
            found.append(Subject(module, node.name, "function", ast.unparse(node.args), first_paragraph(node)))
    return [s for s in found if len(s.answer) >= MIN_ANSWER_CHARS and not s.answer.startswith(">>>")]


def reasoning(s: Subject) -> str:
    what = {"module": f"the module {s.module}, which defines {s.detail}",
            "function": f"{s.module}.{s.name}, a function taking ({s.detail})",
            "method": f"{s.module}.{s.name}, a method taking ({s.detail})",
            "class": f"{s.module}.{s.name}, a class" + (f" deriving from {s.detail}" if s.detail else "")}[s.kind]
    return f"The user asks about {what}. I will answer from its docstring."


def conversations(subjects: list[Subject], rng: random.Random) -> list[dict]:
    """OpenAI-style conversations (``{"messages": [...]}``) over ``subjects``, 1 to MAX_TURNS turns each."""
    out, i = [], 0
    while i < len(subjects):
        turns = subjects[i:i + rng.randint(1, MAX_TURNS)]
        i += len(turns)
        analysis = rng.random() < ANALYSIS_FRACTION
        messages = [{"role": "system", "content": SYSTEM}]
        for j, s in enumerate(turns):
            question = rng.choice(QUESTIONS[s.kind]).format(module=s.module, name=s.name)
            answer = {"role": "assistant", "content": s.answer}
            if analysis and j == len(turns) - 1:  # harmony drops the reasoning of earlier turns
                answer["reasoning"] = reasoning(s)
            messages += [{"role": "user", "content": question}, answer]
        out.append({"messages": messages})
    return out


def text_bytes(conversation: dict) -> int:
    return sum(len(m["content"]) + len(m.get("reasoning", "")) for m in conversation["messages"])


def chat_corpus(train_bytes: int, heldout_percent: int, max_file_bytes: int, seed: int) -> tuple[list, list, dict]:
    """(training conversations, held-out conversations, counts), ``train_bytes`` of training text."""
    train, heldout, seen, size = [], [], set(), 0
    modules = {"train": 0, "heldout": 0}
    for module, path in stdlib_modules():
        if size >= train_bytes:
            break
        try:
            if path.stat().st_size > max_file_bytes:
                continue
            with warnings.catch_warnings():  # invalid escapes in old sources: SyntaxWarning
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        subjects = []
        for s in module_subjects(module, tree):
            if s.answer not in seen:
                seen.add(s.answer)
                subjects.append(s)
        if not subjects:
            continue
        held = int.from_bytes(hashlib.sha256(module.encode()).digest()[:4], "little") % 100 < heldout_percent
        made = conversations(subjects, random.Random(f"{seed}:{module}"))
        (heldout if held else train).extend(made)
        modules["heldout" if held else "train"] += 1
        size += 0 if held else sum(map(text_bytes, made))
    if size < train_bytes // 2 or not heldout:
        raise RuntimeError(f"found {size:,} bytes of conversations ({len(heldout)} held out) in the standard library's "
                           f"documentation; this preset needs {train_bytes:,}")
    counts = {}
    for split, convs in (("train", train), ("heldout", heldout)):
        assistant = [m for c in convs for m in c["messages"] if m["role"] == "assistant"]
        counts.update({f"{split}_modules": modules[split], f"{split}_conversations": len(convs),
                       f"{split}_turns": len(assistant), f"{split}_analysis": sum("reasoning" in m for m in assistant),
                       f"{split}_bytes": sum(map(text_bytes, convs))})
    return train, heldout, counts


def entry_bytes(path) -> int:
    """Bytes of a cache's ids and log-prob shard files, as its binding records give them: what grows
    with the entries (the store's metadata files are a few kB whatever it holds)."""
    return sum(f["bytes"] for record in Path(path).glob("dp_*/bindings/*.json")
               for f in json.loads(record.read_text())["files"].values())


def text_pieces(conversation: dict) -> list[str]:
    """The conversation's harmony text between its special tokens (what the BPE is trained on)."""
    from megatron_kd.data.conversation import MaskSettings, parse_messages
    from megatron_kd.data.harmony import harmony_pieces

    return [p.text for p in harmony_pieces(parse_messages(conversation), MaskSettings()) if not p.special]


# ----------------------------------------------------------------------------------------------
# the benchmark


@dataclass(frozen=True)
class ChatStudent(Variant):
    """A bench_fidelity cache variant trained on the answers alone (its cache and loss under the chat
    mask) or on every token (its cache and loss over the whole sequence)."""

    answers_only: bool = True

    @property
    def cache(self) -> str:
        return f"{super().cache}-{'answers' if self.answers_only else 'full'}"


def chat_students(variant: str) -> list[ChatStudent]:
    v = parse_variant(variant)
    if v.cache is None or (v.kind == "sampled" and v.k == 0) or v.tail == "best":
        raise ValueError(f"--variant {variant}: expected a cache variant with its K or draws (top{{K}}-{{tail}}..., "
                         f"sampled{{N}}...)")
    fields = asdict(v)
    return [ChatStudent(**{**fields, "name": "answer-only"}, answers_only=True),
            ChatStudent(**{**fields, "name": "full-sequence"}, answers_only=False)]


class ChatBench(Bench):
    """``Bench`` over the chat corpus: every split a ``data chat`` dataset with its loss mask; the
    held-out metrics over the answer tokens (and over every token: ``sequence_*``)."""

    def build_data(self):
        from megatron_kd.data.chat import build_chat_dataset
        from megatron_kd.data.conversation import MaskSettings
        from megatron_kd.data.harmony import SPECIAL_TOKENS

        p, t = self.p, time.perf_counter()
        train, heldout, counts = chat_corpus(p.corpus_bytes, p.heldout_percent, p.max_file_bytes, p.seed)
        self.tok = train_bpe([piece for c in train for piece in text_pieces(c)], p.vocab, p.bpe_bytes,
                             special_tokens=SPECIAL_TOKENS)
        self.vocab = self.tok.vocab_size
        self.packing = packing_of(self.packing_mode, self.tok.eod)
        data, sidecars = self.work / "data", {}
        data.mkdir(parents=True, exist_ok=True)
        for split, convs in (("train", train), ("heldout", heldout)):
            jsonl = data / f"{split}.jsonl"
            jsonl.write_text("".join(json.dumps(c) + "\n" for c in convs))
            sidecars[split] = build_chat_dataset(jsonl, data / split, self.tok, MaskSettings(), renderer="harmony",
                                                 overwrite=True)  # --resume keeps the work directory
        corpus = {**counts, "vocab_size": self.vocab, "tokenizer_sha256": self.tok.unique_identifiers["sha256"],
                  "mask": sidecars["train"]["mask"],
                  **{f"{split}_{key}": sidecars[split][key] for split in sidecars for key in ("tokens", "loss_tokens")}}
        self.results["corpus"] = corpus
        self.log(f"conversations: {corpus['train_conversations']:,} for training ({corpus['train_turns']:,} turns, "
                 f"{corpus['train_analysis']:,} with analysis; {corpus['train_tokens']:,} tokens, "
                 f"{corpus['train_loss_tokens'] / corpus['train_tokens']:.1%} answer tokens) from "
                 f"{corpus['train_modules']} modules, {corpus['heldout_conversations']:,} held out from "
                 f"{corpus['heldout_modules']} ({corpus['heldout_tokens']:,} tokens); BPE vocabulary {self.vocab:,}")

        self.student_ds = self.gpt_dataset(data / "train", p.student_steps * p.micro_batch_size)  # masked
        self.teacher_ds = self.gpt_dataset(data / "train", p.teacher_steps * p.teacher_micro_batch_size).base
        # megatron-core builds whole epochs: under one epoch asked, every window of the split once
        eval_samples = min(p.eval_samples, (corpus["heldout_tokens"] - 1) // p.seq_length)
        self.heldout_ds = self.gpt_dataset(data / "heldout", eval_samples)
        corpus["heldout_samples"] = len(self.heldout_ds)
        self.stage("corpus, tokenizer, datasets", time.perf_counter() - t)

    def heldout(self, model, teacher=None) -> dict:
        """Metrics over the held-out answer tokens (ce, kl) and over every held-out token (sequence_ce, ...)."""
        answers = heldout_metrics(model, self.heldout_ds, self.p.eval_batch_size, self.device, teacher, self.packing)
        sequence = heldout_metrics(model, self.heldout_ds.base, self.p.eval_batch_size, self.device, teacher,
                                   self.packing)
        return {**answers, **{f"sequence_{key}": value for key, value in sequence.items()}}

    def build_cache(self, path: Path, mode: str, k: int, samples: int, dataset=None) -> dict:
        info = super().build_cache(path, mode, k, samples, dataset)
        info["entry_bytes"] = entry_bytes(path)
        return info

    def student_data(self, v: ChatStudent):
        return self.student_ds if v.answers_only else self.student_ds.base

    def run_chat(self, variant: str) -> dict:
        students = chat_students(variant)
        self.work.mkdir(parents=True, exist_ok=True)
        self.build_data()
        self.train_teacher()
        self.results["teacher"].update({f"heldout_{key}": value for key, value in self.heldout(self.teacher).items()})
        start = self.heldout(self.new_student(), teacher=self.teacher)
        self.results["start"] = {f"heldout_{key}": value for key, value in start.items()}
        self.log(f"untrained start: held-out answer cross-entropy {start['ce']:.4f}, KL {start['kl']:.4f}")
        for v in self.build_caches(students):
            self.train_student(v)
            self.results["variants"][v.name]["cache"] = v.cache
        caches = self.results["caches"]
        answers, full = caches[students[0].cache], caches[students[1].cache]
        for cache in (answers, full):
            cache["bytes_per_answer_token"] = cache["bytes"] / answers["tokens_with_entries"]
        self.results["answer_fraction"] = answers["tokens_with_entries"] / answers["tokens"]
        self.results["masked_bytes_ratio"] = answers["bytes"] / full["bytes"]
        self.results["masked_entry_bytes_ratio"] = answers["entry_bytes"] / full["entry_bytes"]
        self.results["variant"] = variant
        self.tb.close()
        self.results["seconds"] = round(sum(self.results["stages"].values()), 1)
        return self.results


# ----------------------------------------------------------------------------------------------
# report


def markdown(results: dict) -> str:
    c, t, p = results["corpus"], results["teacher"], results["preset"]
    students = results["variants"]
    lines = [
        f"# Answer-only vs full-sequence chat distillation ({results['device']}, autocast {results['autocast']}"
        + (f", packing {results['packing']}" if "packing" in results else "") + ")", "",
        (f"Conversations from the standard library's documentation: {c['train_conversations']:,} for training "
         f"({c['train_modules']} modules, {c['train_turns']:,} turns, {c['train_analysis']:,} with an analysis "
         f"message; {c['train_tokens']:,} tokens, {c['train_loss_tokens'] / c['train_tokens']:.1%} of them answer "
         f"tokens), {c['heldout_conversations']:,} held out ({c['heldout_modules']} other modules), evaluated on "
         f"{c['heldout_samples']} x {p['seq_length']} tokens. Harmony rendering, mask {c['mask']!r}; BPE vocabulary "
         f"{c['vocab_size']:,} with harmony's special tokens."),
        (f"Teacher: {t['parameters']:,} parameters, {t['steps']} steps on the full conversations. Students: "
         f"{p['student']['layers']} x {p['student']['hidden']}, {p['student_steps']} steps of "
         f"{p['micro_batch_size']} x {p['seq_length']} tokens from the same start over the same samples, the fused "
         f"loss ({results['variant']}) from each one's cache."), "",
        "| cache | entries at | tokens with entries | cache bytes | of them shard files | bytes/token "
        "| bytes/answer token | teacher pass (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in students.values():
        cache = results["caches"][r["cache"]]
        lines.append(f"| {r['name']} | {'answer tokens' if r['answers_only'] else 'every token'} | "
                     f"{cache['tokens_with_entries']:,} of {cache['tokens']:,} | {cache['bytes']:,} | "
                     f"{cache['entry_bytes']:,} | "
                     f"{cache['bytes_per_token']:.1f} | {cache['bytes_per_answer_token']:.1f} | "
                     f"{cache['seconds']:.1f} |")
    lines += [
        "", (f"Bytes: every file of the store; shard files: its ids and log-probs (what grows with the entries). "
             f"Answer fraction of the students' samples {results['answer_fraction']:.3f}; the answer-only cache is "
             f"{results['masked_bytes_ratio']:.3f} of the full one's bytes, "
             f"{results['masked_entry_bytes_ratio']:.3f} of its shard bytes."), "",
        "Held-out metrics, nats/token: over the answer tokens (what the answer-only student is trained on) and over "
        "every token; KL(teacher ‖ model) over the full vocabulary.", "",
        "| model | answer CE | answer KL(T‖S) | sequence CE | sequence KL(T‖S) | ms/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("untrained start", results["start"], None), *((n, r, r["seconds_per_step"]) for n, r in students.items())]
    for name, r, step in rows:
        lines.append(f"| {name} | {r['heldout_ce']:.4f} | {r['heldout_kl']:.4f} | {r['heldout_sequence_ce']:.4f} | "
                     f"{r['heldout_sequence_kl']:.4f} | {'' if step is None else f'{1e3 * step:.1f}'} |")
    lines.append(f"| teacher | {t['heldout_ce']:.4f} | | {t['heldout_sequence_ce']:.4f} | | |")
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in results["stages"].items())
    lines += ["", f"Stage times: {stages}; total {results['seconds']:.0f} s.", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# entry point


def run(size: str, out, variant: str = DEFAULT_VARIANT, *, dtype: str = "auto", packing: str = "none", log=print,
        **overrides) -> dict:
    """The whole benchmark at preset ``size`` (``CHAT_PRESETS``' changes, then ``overrides``);
    returns results.json's content."""
    chat_students(variant)  # a bad variant stops here, not after the teacher
    preset, _, device, autocast, out = _setup(size, out, None, dtype, {**CHAT_PRESETS[size], **overrides})
    for stale in (out / "work", out / "tensorboard"):  # datasets, caches and curves are rebuilt
        shutil.rmtree(stale, ignore_errors=True)
    _start_process(preset, device)
    bench = ChatBench(preset, out, device, autocast, log, packing=packing)
    results = bench.run_chat(variant)
    results["preset_name"] = size
    shutil.rmtree(out / "work")
    bench.partial.unlink(missing_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    return results
