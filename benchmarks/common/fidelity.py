"""The distillation-fidelity benchmark's pipeline (``python -m benchmarks.bench_fidelity``, whose
docstring says what it measures and how): presets and variants, the corpus of the installed Python's
text files and its byte-level BPE, megatron-core GPT teachers and students, their caches and held-out
metrics, the report, and ``run``, the whole benchmark. The chat, heal, cache-fidelity and optimizer
benchmarks and online KD build on its pieces.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import site
import sysconfig
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path

import torch

from megatron_kd.cache.meta import PACKING_MODES
from megatron_kd.megatron.packing import DocumentPacking
from megatron_kd.ops import DIVERGENCES, TAILS

EOD, PAD = "<eod>", "<pad>"
TEXT_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")


# ----------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    ffn: int | None = None  # MLP width (None: megatron-core's 4 x hidden)


@dataclass(frozen=True)
class Preset:
    corpus_bytes: int  # training text to read (the held-out split comes on top)
    max_file_bytes: int  # larger files are skipped (generated tables; few, long documents)
    heldout_percent: int
    bpe_bytes: int  # training text the BPE is trained on (a prefix of the training documents)
    vocab: int
    seq_length: int
    teacher: Arch
    teacher_steps: int
    teacher_micro_batch_size: int
    teacher_lr: float
    teacher_eval_interval: int
    student: Arch
    student_steps: int
    micro_batch_size: int  # of the students, hence of the teacher passes and caches
    student_lr: float
    eval_samples: int
    eval_batch_size: int
    draw_candidates: tuple[int, ...]  # sampled cache: draws per token to choose from
    calibration_samples: int  # samples the sampled cache's bytes/token is calibrated on
    workers: int  # DataLoader worker processes (0 on CPU: the cores are busy training)
    log_interval: int
    seed: int = 1234


PRESETS = {
    # One H200, ~12 minutes: a teacher of ~135M parameters (12 x 768, 32K vocabulary, untied
    # embeddings) on ~33M tokens (~1.2 epochs of ~27M training tokens), students of ~36M (6 x 384)
    # on 6.6M tokens each (< 1 epoch) in 800 steps of 8 x 1024 tokens. Measured on an H200
    # (2026-11-30): data 21 s, teacher 155 s, the four caches 111 s, ~55 ms per student step at
    # 32 x 1024 tokens. A run stopped by a time limit continues with --resume. (200 steps of
    # 32 x 1024 left every student, online KD included, within 1% of CE-only: too few updates for
    # the teacher's signal to matter.) Sampled caches hold `draws` slots per token: candidates stop
    # at 128 to bound their write time.
    "gpu": Preset(corpus_bytes=100_000_000, max_file_bytes=200_000, heldout_percent=2, bpe_bytes=32_000_000,
                  vocab=32768, seq_length=1024, teacher=Arch(12, 768, 12), teacher_steps=1000,
                  teacher_micro_batch_size=32, teacher_lr=1e-3, teacher_eval_interval=250,
                  student=Arch(6, 384, 6), student_steps=800, micro_batch_size=8, student_lr=1e-3,
                  eval_samples=256, eval_batch_size=16, draw_candidates=(32, 48, 64, 96, 128),
                  calibration_samples=128, workers=10, log_interval=100),
    # CI: tiny models on ~0.6 MB, in under a minute on two idle cores.
    "cpu": Preset(corpus_bytes=600_000, max_file_bytes=16_000, heldout_percent=10, bpe_bytes=1_000_000, vocab=512,
                  seq_length=128, teacher=Arch(4, 96, 4), teacher_steps=200, teacher_micro_batch_size=16,
                  teacher_lr=3e-3, teacher_eval_interval=100, student=Arch(2, 64, 4), student_steps=60,
                  micro_batch_size=16, student_lr=3e-3, eval_samples=64, eval_batch_size=16,
                  draw_candidates=(16, 32, 48, 64, 96), calibration_samples=32, workers=0, log_interval=20),
}

def preset_overrides(items: list[str]) -> dict:
    """``FIELD=VALUE`` strings (Python literals; architectures as "layers,hidden,heads") -> Preset fields."""
    names, out = {f.name for f in fields(Preset)}, {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in names:
            raise ValueError(f"--set {item!r}: {key!r} is not a preset field ({', '.join(sorted(names))})")
        try:
            parsed = ast.literal_eval(value)
            out[key] = Arch(*parsed) if key in ("teacher", "student") else parsed
        except (ValueError, SyntaxError, TypeError):
            raise ValueError(f"--set {item!r}: cannot read {value!r}") from None
    return out


DEFAULT_VARIANTS = ("ce", "online", *(f"top{k}-{tail}" for k in (8, 32, 100) for tail in TAILS), "sampled",
                    *(f"top{k}-best-ce0.1" for k in (8, 32, 100)))


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "ce" | "online" | "topk" | "sampled"
    k: int = 0  # K of a top-K cache; draws of a sampled cache (0: chosen by calibration)
    tail: str = "none"  # a TAILS entry, or "best" until resolved
    ce_weight: float = 0.0
    divergence: str = "forward"  # a DIVERGENCES entry (reverse / jsd: tail renorm or ghost)
    jsd_beta: float = 0.5

    @property
    def cache(self) -> str | None:
        """Name of the cache the variant reads (None: no cache)."""
        if self.kind in ("topk", "sampled"):
            return f"{'top' if self.kind == 'topk' else 'sampled'}{self.k}"
        return None


_NUMBER = r"\d+(?:\.\d+)?"
_DIVERGENCE = rf"(?:-(reverse|jsd)({_NUMBER})?)?"
_VARIANT = re.compile(rf"^(?:(ce|online)|top(\d+)-({'|'.join(TAILS)}|best){_DIVERGENCE}(?:-ce({_NUMBER}))?"
                      rf"|sampled(\d+)?(-ghost)?{_DIVERGENCE}(?:-ce({_NUMBER}))?)$")
SUPPORT_DIVERGENCES = tuple(d for d in DIVERGENCES if d != "forward")


def parse_variant(name: str) -> Variant:
    m = _VARIANT.match(name)
    if m is None:
        raise ValueError(f"unknown variant {name!r}: ce, online, top{{K}}-{{none|renorm|ghost|best}}[-reverse|-jsd[B]]"
                         f"[-ce{{W}}] or sampled[N][-ghost][-reverse|-jsd[B]][-ce{{W}}]")
    plain, k, tail, divergence, beta, ce_weight, draws, s_ghost, s_divergence, s_beta, s_ce_weight = m.groups()
    if plain:
        return Variant(name, plain)
    divergence, beta = (divergence, beta) if k else (s_divergence, s_beta)
    if beta is not None and divergence != "jsd":
        raise ValueError(f"variant {name!r}: only jsd takes a weight (jsd{beta})")
    loss = dict(divergence=divergence or "forward", jsd_beta=float(beta) if beta is not None else 0.5)
    if not 0 < loss["jsd_beta"] < 1:
        raise ValueError(f"variant {name!r}: the jsd weight must be in (0, 1), got {beta}")
    if k:
        if int(k) < 1:
            raise ValueError(f"variant {name!r}: K must be >= 1")
        if divergence and tail not in ("renorm", "ghost"):  # "best" may resolve to none
            raise ValueError(f"variant {name!r}: {divergence} needs tail renorm or ghost")
        return Variant(name, "topk", int(k), tail, float(ce_weight or 0.0), **loss)
    # the sampled teacher has mass 1 on its draws: renorm is the tail meant for it (README); ghost
    # adds the student's mass outside them as an outcome the teacher gives (floored) nothing
    return Variant(name, "sampled", int(draws or 0), "ghost" if s_ghost else "renorm", float(s_ce_weight or 0.0),
                   **loss)


def with_divergence_ablation(variants: list[str]) -> list[str]:
    """``variants`` plus reverse and jsd for each top-100 and sampled variant with forward KL and a
    tail they take (renorm, ghost; sampled: renorm), each right after its forward variant."""
    out = []
    for name in variants:
        out.append(name)
        v = parse_variant(name)
        if v.divergence == "forward" and (v.kind == "sampled" or (v.kind == "topk" and v.k == 100
                                                                 and v.tail in ("renorm", "ghost"))):
            stem, ce = (name.split("-ce", 1) + [""])[:2] if v.kind == "topk" else (name, "")
            out += [f"{stem}-{d}" + (f"-ce{ce}" if ce else "") for d in SUPPORT_DIVERGENCES]
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------------
# corpus and tokenizer


def _text_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the text files of the standard library and site-packages."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), *map(Path, site.getsitepackages())]
    found = {}
    for root in dict.fromkeys(roots):
        for dirpath, dirnames, filenames in os.walk(root):
            # a site-packages inside the stdlib tree is another root (or another environment's)
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
            for name in filenames:
                if name.endswith(TEXT_SUFFIXES):
                    path = Path(dirpath, name)
                    found.setdefault(str(path.relative_to(root)), path)
    return sorted(found.items())


def read_corpus(train_bytes: int, heldout_percent: int, max_file_bytes: int) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents), ``train_bytes`` of training text.

    Files are visited in the order of a hash of their relative path (the same on any machine with
    the same packages), each read once; duplicates of an earlier document are skipped; a
    document is held out when the hash of its content says so."""
    files = sorted(_text_files(), key=lambda item: hashlib.sha1(item[0].encode()).digest())
    train, heldout, seen, size = [], [], set(), 0
    for _, path in files:
        if size >= train_bytes:
            break
        try:
            if not 256 <= path.stat().st_size <= max_file_bytes:  # not stubs
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha256(" ".join(text.split()).encode()).digest()
        if digest in seen:
            continue
        seen.add(digest)
        if int.from_bytes(digest[:4], "little") % 100 < heldout_percent:
            heldout.append(text)
        else:
            train.append(text)
            size += len(text)
    if size < train_bytes // 2 or not heldout:
        raise RuntimeError(f"found {size:,} bytes of text ({len(heldout)} held-out documents) under the standard "
                           f"library and site-packages; this preset needs {train_bytes:,}")
    return train, heldout


def _bpe_tokenizer_class():
    from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase

    class BPETokenizer(MegatronTokenizerBase):
        """A `tokenizers` BPE behind megatron-core's tokenizer interface (what GPTDataset and the
        cache fingerprints read), like ``ByteTokenizer`` in megatron_kd/megatron/data.py."""

        def __init__(self, tokenizer):
            super().__init__(path="", config={})
            self.tokenizer = tokenizer
            # plain ints: DataLoader workers never call into the (threaded) Rust tokenizer
            self._size, self._eod, self._pad = tokenizer.get_vocab_size(), tokenizer.token_to_id(EOD), \
                tokenizer.token_to_id(PAD)
            # megatron-core datasets hash this into their description: another BPE, another index
            digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
            self.unique_identifiers = {"class": type(self).__name__, "vocab_size": self._size, "sha256": digest}

        def tokenize(self, text: str) -> list[int]:
            return self.tokenizer.encode(text).ids

        def detokenize(self, ids) -> str:
            return self.tokenizer.decode([int(i) for i in ids])

        @property
        def vocab(self) -> dict:
            return self.tokenizer.get_vocab()

        @property
        def vocab_size(self) -> int:
            return self._size

        @property
        def eod(self) -> int:
            return self._eod

        @property
        def pad(self) -> int:
            return self._pad

        def apply_chat_template(self, *args, **kwargs):
            raise NotImplementedError("BPETokenizer has no chat template")

    return BPETokenizer


def train_bpe(docs: list[str], vocab_size: int, max_bytes: int, special_tokens: tuple[str, ...] = ()):
    """A byte-level BPE of ``vocab_size`` entries (end-of-document and pad first, then
    ``special_tokens``, each one id never merged) trained on the first ``max_bytes`` of ``docs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, size = [], 0
    for doc in docs:
        if size >= max_bytes:
            break
        sample.append(doc)
        size += len(doc)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD, PAD, *special_tokens],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer, length=len(sample))
    return _bpe_tokenizer_class()(tok)


def _encoded(tok, docs: list[str], counter: list[int]):
    """Token ids of each document followed by end-of-document, encoded in parallel batches."""
    for i in range(0, len(docs), 512):
        for enc in tok.tokenizer.encode_batch(docs[i:i + 512]):
            counter[0] += len(enc.ids) + 1
            yield [*enc.ids, tok.eod]


# ----------------------------------------------------------------------------------------------
# models, precision, batches


def gpt(arch: Arch, vocab: int, seq_length: int, seed: int, device: torch.device, **config_fields):
    """A megatron-core GPTModel of ``arch`` on the local spec, fp32 weights; ``config_fields``: more
    TransformerConfig fields (an MoE student's experts)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=arch.layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
                               ffn_hidden_size=arch.ffn, use_cpu_initialization=True, params_dtype=torch.float32,
                               attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm",
                               init_method_std=0.02, **config_fields)
    # megatron-core's rotary embedding assumes CUDA; on the CPU, learned absolute positions
    position = "rope" if device.type == "cuda" else "learned_absolute"
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=seq_length,
                            position_embedding_type=position, use_te=False)
    return model.to(device)


def _head_in(dtype, processor, *, hidden_states, output_layer, output_weight, **kwargs):
    weight = output_layer.weight if output_weight is None else output_weight
    with torch.autocast(hidden_states.device.type, enabled=False):
        return processor(hidden_states=hidden_states.to(dtype), output_layer=output_layer,
                         output_weight=weight.to(dtype), **kwargs)


class Autocast:
    """Calls a GPTModel under autocast to ``dtype`` (None: as is). fp32 weights and optimizer
    state stay; an ``output_processor`` (the fused KD loss, the teacher's top-K) gets the hidden
    states and a copy of the output weight in ``dtype``, the pair Megatron's bf16 training gives it
    (the op needs one dtype for both; the copy passes its gradient back to the fp32 weight)."""

    def __init__(self, model, dtype: torch.dtype | None):
        self.model, self.dtype = model, dtype

    def __call__(self, *args, output_processor=None, **kwargs):
        if self.dtype is None:
            return self.model(*args, output_processor=output_processor, **kwargs)
        if output_processor is not None:
            output_processor = partial(_head_in, self.dtype, output_processor)
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=self.dtype):
            return self.model(*args, output_processor=output_processor, **kwargs)


def ordered_batches(dataset, steps: int, batch_size: int, *, workers: int, device: torch.device):
    """Micro-batches 1..steps, samples in order ((step-1)·b .. step·b - 1, as ``demo.batch_at``),
    read ahead by ``workers`` processes."""
    subset = torch.utils.data.Subset(dataset, range(steps * batch_size))
    loader = torch.utils.data.DataLoader(subset, batch_size=batch_size, num_workers=workers,
                                         pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None)
    return iter(loader)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def kl_and_ce(student_logits, teacher_logits, labels, mask):
    """Sums over unmasked tokens of KL(teacher || student) over the full vocabulary and of the
    student's cross-entropy, in fp32 (the reference loss of the online variant)."""
    log_q = student_logits.float().log_softmax(-1)
    ce = -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if teacher_logits is None:
        return None, (ce * mask).sum()
    log_p = teacher_logits.float().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (kl * mask).sum(), (ce * mask).sum()


@torch.no_grad()
def heldout_metrics(model, dataset, batch_size: int, device: torch.device, teacher=None,
                    packing: DocumentPacking | None = None) -> dict:
    """Mean held-out cross-entropy (and KL(teacher || model)) per token, fp32, in nats. ``packing``:
    the documents of each sample as the models were trained to see them (None: attention crosses)."""
    was_training = model.training
    model.eval()
    ce = kl = count = 0.0
    for batch in torch.utils.data.DataLoader(dataset, batch_size=batch_size):
        b, packed = (packing or DocumentPacking()).apply(_to(batch, device))
        logits = model(b["tokens"], b["position_ids"], None, packed_seq_params=packed)
        teacher_logits = None if teacher is None else teacher(b["tokens"], b["position_ids"], None,
                                                              packed_seq_params=packed)
        kl_sum, ce_sum = kl_and_ce(logits, teacher_logits, b["labels"], b["loss_mask"])
        ce, count = ce + float(ce_sum), count + float(b["loss_mask"].sum())
        kl += 0.0 if kl_sum is None else float(kl_sum)
    model.train(was_training)
    return {"ce": ce / count, **({} if teacher is None else {"kl": kl / count})}


def document_windows(documents: list[list[int]], length: int, stride: int, pad: int) -> list[dict]:
    """Rows that score every prediction of each document exactly once, each row one document on
    its own from position 0 (nothing of another document in any row, so it does not matter how a
    model treats packed documents).

    A document (its token ids, end-of-document last) of n tokens has n - 1 predictions (each token
    from those before it, the end-of-document included). One of up to ``length`` + 1 tokens is one
    row; a longer one is cut into windows of ``length`` inputs starting every ``stride`` tokens,
    and a window scores only the predictions the window before it did not reach, so each scored
    token sees at least ``length - stride + 1`` tokens of its document (or all before it). Rows are
    padded to ``length`` with ``pad`` (loss mask 0); GPTDataset's keys, position_ids 0 ..
    length - 1."""
    if not 0 < stride <= length:
        raise ValueError(f"stride must be in 1 .. {length}, got {stride}")
    rows = []
    for doc in documents:
        n, start, scored = len(doc), 0, 0  # scored: the last label index already scored
        while scored < n - 1:
            end = min(start + length, n - 1)  # inputs doc[start:end], labels doc[start + 1:end + 1]
            width = end - start
            tokens = torch.full((length,), pad, dtype=torch.int64)
            labels = torch.full((length,), pad, dtype=torch.int64)
            tokens[:width] = torch.tensor(doc[start:end])
            labels[:width] = torch.tensor(doc[start + 1:end + 1])
            mask = torch.zeros(length)
            mask[:width] = (torch.arange(start + 1, end + 1) > scored).float()
            rows.append({"tokens": tokens, "labels": labels, "loss_mask": mask,
                         "position_ids": torch.arange(length)})
            scored, start = end, start + stride
    return rows


def packing_of(mode: str, eod: int | None) -> DocumentPacking:
    """The product's ``DocumentPacking`` for a ``PACKING_MODES`` entry."""
    if mode not in PACKING_MODES:
        raise ValueError(f"packing {mode!r}: one of {', '.join(PACKING_MODES)}")
    parts = mode.split("+")
    return DocumentPacking(documents="documents" in parts, positions="positions" in parts,
                           eod=None if mode == "none" else eod)


# ----------------------------------------------------------------------------------------------
# the benchmark


class Bench:
    """One run: the corpus, the teacher, its caches and the students, stage by stage.

    ``packing`` (a ``PACKING_MODES`` entry): how the teacher (its training, its held-out metric,
    its teacher passes, recorded in the caches) and the students treat the documents packed into a
    sample, through the product's ``DocumentPacking`` and the model's attention paths, as
    ``megatron-kd train`` with ``--reset-attention-mask`` / ``--reset-position-ids`` does; "none":
    attention crosses documents, positions run through the sample. ``document_eval``: every
    model's held-out metrics also on whole held-out documents, each on its own from its first token
    (``document_windows``; results keys ``heldout_doc_ce`` / ``heldout_doc_kl``). ``tag``: another
    run in the same ``out`` (its own work directory, partial results and TensorBoard logs)."""

    def __init__(self, preset: Preset, out: Path, device: torch.device, dtype: torch.dtype | None, log, *,
                 packing: str = "none", document_eval: bool = False, tag: str = ""):
        self.p, self.out, self.device, self.dtype = preset, out, device, dtype
        self.work = out / "work" / tag if tag else out / "work"
        self.partial = out / (f"results.partial.{tag}.json" if tag else "results.partial.json")
        self.tensorboard = out / "tensorboard" / tag if tag else out / "tensorboard"
        self._log, self._t0 = log, time.perf_counter()
        self.packing_mode = packing_of(packing, 0).mode  # checked here; the EOD id comes with the tokenizer
        self.packing = DocumentPacking()  # build_data sets the run's once the tokenizer is known
        self.results: dict = {"preset": asdict(preset), "device": str(device), "autocast": str(dtype),
                              "stages": {}, "caches": {}, "variants": {}}
        if packing != "none":
            self.results["packing"] = self.packing_mode
        if document_eval:
            # documents longer than the context: windows of seq_length tokens every half of it
            self.results["document_eval"] = {"window": preset.seq_length, "stride": max(1, preset.seq_length // 2)}
        self.caches: dict[str, Path] = {}

    def resume(self) -> bool:
        """Take over what a stopped run with the same preset finished (results.partial.json and
        OUT/work: the teacher's weights, complete caches); returns whether there was such a run."""
        partial = self.partial
        if not partial.exists():
            return False
        done = json.loads(partial.read_text())
        same = {key: self.results.get(key) for key in ("packing", "document_eval")}
        if done.get("preset") != json.loads(json.dumps(self.results["preset"])) or \
                {key: done.get(key) for key in same} != json.loads(json.dumps(same)):
            self.log(f"{partial} is from other settings: starting afresh")
            return False
        self.results = done
        self.log(f"resuming: teacher {'done' if 'teacher' in done else 'to train'}, caches {sorted(done['caches'])}, "
                 f"students {sorted(done['variants'])}")
        return True

    def log(self, msg: str):
        self._log(f"[{time.perf_counter() - self._t0:7.1f}s] {msg}")

    def stage(self, name: str, seconds: float):
        stages = self.results["stages"]
        stages[name] = round(stages.get(name, 0.0) + seconds, 2)
        # what is done so far, so that a run stopped by a time limit still leaves its numbers
        self.partial.write_text(json.dumps(self.results, indent=1))

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- data -----------------------------------------------------------------------------------

    def build_data(self):
        from megatron_kd.megatron.data import write_indexed_dataset

        p, t = self.p, time.perf_counter()
        train_docs, heldout_docs = read_corpus(p.corpus_bytes, p.heldout_percent, p.max_file_bytes)
        saved = self.work / "tokenizer.json"  # kept only by --resume: its caches were written with this one
        if saved.exists():
            from tokenizers import Tokenizer

            self.tok = _bpe_tokenizer_class()(Tokenizer.from_file(str(saved)))
        else:
            self.tok = train_bpe(train_docs, p.vocab, p.bpe_bytes)
            self.work.mkdir(parents=True, exist_ok=True)
            self.tok.tokenizer.save(str(saved))
        self.vocab = self.tok.vocab_size
        self.packing = packing_of(self.packing_mode, self.tok.eod)
        counts = {"train": [0], "heldout": [0]}
        prefixes = {split: write_indexed_dataset(self.work / "data" / split, _encoded(self.tok, docs, counts[split]),
                                                 self.vocab)
                    for split, docs in (("train", train_docs), ("heldout", heldout_docs))}
        corpus = {"train_documents": len(train_docs), "train_bytes": sum(map(len, train_docs)),
                  "train_tokens": counts["train"][0], "heldout_documents": len(heldout_docs),
                  "heldout_bytes": sum(map(len, heldout_docs)), "heldout_tokens": counts["heldout"][0],
                  "vocab_size": self.vocab, "tokenizer_sha256": self.tok.unique_identifiers["sha256"]}
        self.results["corpus"] = corpus
        self.log(f"corpus: {corpus['train_documents']:,} training documents ({corpus['train_bytes'] / 1e6:.1f} MB, "
                 f"{corpus['train_tokens']:,} tokens), {corpus['heldout_documents']:,} held out "
                 f"({corpus['heldout_tokens']:,} tokens); BPE vocabulary {self.vocab:,}")

        self.teacher_ds = self.gpt_dataset(prefixes["train"], p.teacher_steps * p.teacher_micro_batch_size)
        self.student_ds = self.gpt_dataset(prefixes["train"], p.student_steps * p.micro_batch_size)
        # every held-out window once: no more samples than the split holds
        eval_samples = min(p.eval_samples, (corpus["heldout_tokens"] - 1) // p.seq_length)
        self.heldout_ds = self.gpt_dataset(prefixes["heldout"], eval_samples)
        self.results["corpus"]["heldout_samples"] = eval_samples
        if "document_eval" in self.results:
            self.heldout_rows = self._document_rows(heldout_docs, eval_samples * p.seq_length)
        self.stage("corpus, tokenizer, datasets", time.perf_counter() - t)

    def gpt_dataset(self, prefix, samples: int):
        """``samples`` samples of the indexed dataset at ``prefix``, read whole ("100,0,0") by
        megatron-core's GPTDataset (in ``LossMaskedDataset`` when the prefix has a chat loss mask)."""
        from megatron_kd.megatron.data import build_gpt_datasets

        return build_gpt_datasets([prefix], split="100,0,0", seq_length=self.p.seq_length, seed=self.p.seed,
                                  tokenizer=self.tok, num_samples=(samples, 0, 0),
                                  cache_dir=str(self.work / "data" / "index-cache"))[0]

    def _document_rows(self, docs: list[str], budget: int) -> list[dict]:
        """``document_windows`` of the first whole held-out documents holding ``budget`` predictions."""
        window, stride = self.results["document_eval"]["window"], self.results["document_eval"]["stride"]
        chosen, predictions = [], 0
        for ids in _encoded(self.tok, docs, [0]):
            if predictions >= budget:
                break
            chosen.append(ids)
            predictions += len(ids) - 1
        rows = document_windows(chosen, window, stride, self.tok.pad)
        lengths = sorted(len(ids) for ids in chosen)
        self.results["corpus"]["heldout_document_eval"] = {
            "documents": len(chosen), "predictions": predictions, "rows": len(rows),
            "longer_than_window": sum(n - 1 > window for n in lengths), "median_tokens": lengths[len(lengths) // 2],
            "max_tokens": lengths[-1]}
        self.log(f"whole-document held-out set: {len(chosen)} documents ({predictions:,} predictions, median "
                 f"{lengths[len(lengths) // 2]} tokens), {len(rows)} rows of {window} tokens, stride {stride}")
        return rows

    def heldout(self, model, teacher=None) -> dict:
        return heldout_metrics(model, self.heldout_ds, self.p.eval_batch_size, self.device, teacher, self.packing)

    def heldout_documents(self, model, teacher=None) -> dict:
        """Held-out metrics on whole documents, each alone from its first token (no packing needed:
        one document per row)."""
        return heldout_metrics(model, self.heldout_rows, self.p.eval_batch_size, self.device, teacher)

    # -- teacher ----------------------------------------------------------------------------------

    def train_teacher(self):
        from torch.utils.tensorboard import SummaryWriter

        from megatron_kd.demo import DemoConfig, train_loop

        p = self.p
        self.tb = SummaryWriter(str(self.tensorboard))
        self.teacher = gpt(p.teacher, self.vocab, p.seq_length, p.seed, self.device)
        n = sum(x.numel() for x in self.teacher.parameters())
        weights = self.work / "teacher.pt"
        if "teacher" in self.results and weights.exists():
            self.teacher.load_state_dict(torch.load(weights, map_location=self.device))
            self.teacher.eval()
            self.log(f"teacher: loaded {weights} (held-out cross-entropy {self.results['teacher']['heldout_ce']:.4f})")
            return
        self.log(f"teacher: GPTModel {p.teacher.layers} x {p.teacher.hidden}, {n:,} parameters, {p.teacher_steps} "
                 f"steps of {p.teacher_micro_batch_size} x {p.seq_length} tokens")
        batches = ordered_batches(self.teacher_ds, p.teacher_steps, p.teacher_micro_batch_size, workers=p.workers,
                                  device=self.device)
        amp, heldout_curve = Autocast(self.teacher, self.dtype), []

        def step_fn(model, step):
            if (step - 1) % p.teacher_eval_interval == 0 and step > 1:  # after step - 1 updates
                heldout_curve.append((step - 1, self.heldout(model)["ce"]))
                self.log(f"  teacher held-out cross-entropy after {step - 1} steps: {heldout_curve[-1][1]:.4f}")
            return self._ce_step(amp, _to(next(batches), self.device), self.packing)

        t = time.perf_counter()
        curve = train_loop("teacher", self.teacher, p.teacher_steps, step_fn,
                           DemoConfig(lr=p.teacher_lr, log_interval=p.log_interval), self.tb, self.log)
        self._sync()
        seconds = time.perf_counter() - t
        self.teacher.eval()
        torch.save(self.teacher.state_dict(), weights)
        final = self.heldout(self.teacher)["ce"]
        heldout_curve.append((p.teacher_steps, final))
        # what the last quarter of training still gained on held-out text: ~0 means it had flattened
        since, before = next(((s, ce) for s, ce in reversed(heldout_curve) if s <= 0.75 * p.teacher_steps),
                             (0, float("nan")))
        late = {"since_step": since, "gain": 1 - final / before}
        self.results["teacher"] = {"parameters": n, "steps": p.teacher_steps, "seconds": round(seconds, 1),
                                   "heldout_ce": final, "heldout_curve": heldout_curve, "late_heldout_gain": late,
                                   "curve": curve}
        self.log(f"teacher: held-out cross-entropy {final:.4f} ({late['gain']:+.2%} since step {since}), "
                 f"{seconds:.0f} s")
        if "document_eval" in self.results:
            self.results["teacher"]["heldout_doc_ce"] = self.heldout_documents(self.teacher)["ce"]
            self.log(f"teacher: whole-document held-out cross-entropy {self.results['teacher']['heldout_doc_ce']:.4f}")
        self.stage("teacher training", seconds)

    @staticmethod
    def _ce_step(amp, batch, packing: DocumentPacking | None = None):
        """Megatron's own language-model loss: per-token cross-entropy from labels; ``packing``: the
        documents of each sample kept apart as ``KDForwardStep`` keeps them."""
        batch, packed = (packing or DocumentPacking()).apply(batch)
        losses = amp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed)
        mask = batch["loss_mask"]
        loss = (losses.float() * mask).sum()
        return loss, mask.sum(), {"ce loss": torch.stack([loss.detach(), mask.sum()])}

    # -- caches -----------------------------------------------------------------------------------

    def build_cache(self, path: Path, mode: str, k: int, samples: int, dataset=None) -> dict:
        """One teacher pass over the first ``samples`` samples of ``dataset`` (default: the student's)
        into a cache of its own; with a chat loss mask, entries only where it keeps the loss, as
        ``cache build`` writes them."""
        from megatron_kd.cache import CacheWriter
        from megatron_kd.cache.inspect import store_bytes
        from megatron_kd.megatron.data import dataset_fingerprint, tokenizer_fingerprint
        from megatron_kd.megatron.loss_mask import loss_mask_field
        from megatron_kd.teacher import CaptureConfig, MegatronTeacher, capture_teacher

        dataset = self.student_ds if dataset is None else dataset
        loss_mask = loss_mask_field(dataset)

        teacher = MegatronTeacher(Autocast(self.teacher, self.dtype), vocab_size=self.vocab,
                                  fingerprint=f"bench-fidelity-teacher-{self.results['teacher']['parameters']}",
                                  packing=self.packing)
        meta = {"mode": mode, "sampled_draws": k if mode == "sampled" else 0, "packing": self.packing.mode,
                "teacher_fingerprint": teacher.fingerprint, "tokenizer_fingerprint": tokenizer_fingerprint(self.tok),
                "dataset_fingerprint": dataset_fingerprint(dataset), **({"loss_mask": loss_mask} if loss_mask else {})}
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        with CacheWriter(path, vocab_size=self.vocab, topk=k, seq_length=self.p.seq_length, num_samples=samples,
                         micro_batch_size=self.p.micro_batch_size, metadata=meta) as writer:
            summary = capture_teacher(teacher, dataset, writer,
                                      CaptureConfig(topk=k, mode=mode, micro_batch_size=self.p.micro_batch_size,
                                                    seed=self.p.seed, masked=bool(loss_mask)),
                                      device=self.device, progress=False)
        tokens, size = samples * self.p.seq_length, store_bytes(path)
        packed = {} if self.packing.mode == "none" else {"packing": self.packing.mode}
        masked = {"loss_mask": loss_mask["mask"]} if loss_mask else {}
        return {"mode": mode, "k": k, **packed, **masked, "samples": samples, "tokens": tokens,
                "tokens_with_entries": summary["tokens"], "bytes": size, "bytes_per_token": size / tokens,
                "mean_teacher_mass": summary["mean_teacher_mass"],
                "seconds": round(time.perf_counter() - t, 2)}

    def choose_draws(self) -> int:
        """The most draws per token whose sampled cache costs no more bytes/token than top-100,
        both measured on the same calibration slice of the student's samples."""
        n = min(self.p.calibration_samples, self.p.student_steps * self.p.micro_batch_size)
        calib = self.work / "calibration"
        budget = self.build_cache(calib / "top100", "topk", 100, n)["bytes_per_token"]
        table, best = {}, None
        for draws in sorted(self.p.draw_candidates):  # more draws, more distinct ids: more bytes
            table[draws] = self.build_cache(calib / f"sampled{draws}", "sampled", draws, n)["bytes_per_token"]
            if table[draws] > budget:
                break
            best = draws
        shutil.rmtree(calib)
        self.results["draws_calibration"] = {"top100_bytes_per_token": budget, "sampled_bytes_per_token": table,
                                             "chosen": best}
        if best is None:
            raise RuntimeError(f"every candidate number of draws {sorted(table)} costs more bytes/token than top-100 "
                               f"({budget:.1f}): {table}")
        self.log(f"sampled cache: {best} draws per token (calibration bytes/token: top-100 {budget:.1f}, "
                 + ", ".join(f"{d} draws {b:.1f}" for d, b in table.items()) + ")")
        return best

    def build_caches(self, variants: list[Variant]) -> list[Variant]:
        """Every cache the variants read; returns the variants with sampled draws resolved."""
        t, samples = time.perf_counter(), self.p.student_steps * self.p.micro_batch_size
        resolved = []
        for v in variants:
            if v.kind == "sampled" and v.k == 0:
                chosen = self.results.get("draws_calibration", {}).get("chosen")
                v = replace(v, k=chosen or self.choose_draws())
            resolved.append(v)
            if v.cache is None or v.cache in self.caches:
                continue
            path = self.work / "caches" / v.cache
            if v.cache in self.results["caches"] and _complete_cache(path):  # built by a stopped run
                self.caches[v.cache] = path
                continue
            info = self.build_cache(path, "topk" if v.kind == "topk" else "sampled", v.k, samples,
                                    self.student_data(v))
            self.caches[v.cache], self.results["caches"][v.cache] = path, info
            self.log(f"cache {v.cache}: K={v.k} ({info['mode']}), {info['bytes_per_token']:.1f} bytes/token, mean "
                     f"teacher mass {info['mean_teacher_mass']:.3f}, {info['seconds']:.0f} s")
        self.stage("teacher passes (caches)", time.perf_counter() - t)
        return resolved

    # -- students ---------------------------------------------------------------------------------

    def _step_fn(self, v: Variant, batches):
        """``step_fn(model, step)`` of ``train_loop`` for variant ``v``: (loss sum, tokens, report)."""
        from megatron_kd.megatron.args import KDConfig
        from megatron_kd.megatron.loss import KDForwardStep

        if v.kind == "ce":
            return lambda model, step: self._ce_step(Autocast(model, self.dtype), _to(next(batches), self.device),
                                                     self.packing)
        if v.kind == "online":
            teacher = Autocast(self.teacher, self.dtype)

            def online(model, step):
                b, packed = self.packing.apply(_to(next(batches), self.device))
                with torch.no_grad():
                    teacher_logits = teacher(b["tokens"], b["position_ids"], None, packed_seq_params=packed)
                logits = Autocast(model, self.dtype)(b["tokens"], b["position_ids"], None, packed_seq_params=packed)
                kl, ce = kl_and_ce(logits, teacher_logits, b["labels"], b["loss_mask"])
                tokens = b["loss_mask"].sum()
                pair = lambda x: torch.stack([x.detach(), tokens])  # noqa: E731
                return kl, tokens, {"kd loss": pair(kl), "ce loss": pair(ce)}

            return online
        # offline: exactly the forward step and loss function of `megatron-kd train`
        forward_step = KDForwardStep(KDConfig(tail=v.tail, ce_weight=v.ce_weight, divergence=v.divergence,
                                              jsd_beta=v.jsd_beta), device=self.device, packing=self.packing)

        def offline(model, step):
            output, loss_fn = forward_step(iter([next(batches)]), Autocast(model, self.dtype))
            return loss_fn(output)

        return offline

    def student_data(self, v: Variant):
        """The samples variant ``v`` trains on (and its cache holds): the student's."""
        return self.student_ds

    def new_student(self):
        """The model every variant starts from: the student architecture, one seed for all."""
        return gpt(self.p.student, self.vocab, self.p.seq_length, self.p.seed + 1, self.device)

    def train_student(self, v: Variant):
        if v.name in self.results["variants"]:  # finished by a stopped run
            return
        from megatron_kd.demo import DemoConfig, train_loop
        from megatron_kd.megatron.kd_data import KDDataset

        p, data = self.p, self.student_data(v)
        dataset = data if v.cache is None else KDDataset(
            data, str(self.caches[v.cache]), tokenizer=self.tok,
            required_samples=p.student_steps * p.micro_batch_size, packing=self.packing.mode)
        batches = ordered_batches(dataset, p.student_steps, p.micro_batch_size, workers=p.workers, device=self.device)
        model = self.new_student()
        step_fn, starts = self._step_fn(v, batches), []

        def timed(model, step):  # train_loop syncs every step (it reads the loss), so starts are step ends
            starts.append(time.perf_counter())
            return step_fn(model, step)

        t = time.perf_counter()
        curve = train_loop(v.name, model, p.student_steps, timed,
                           DemoConfig(lr=p.student_lr, log_interval=p.log_interval), self.tb, self.log)
        self._sync()
        starts.append(time.perf_counter())
        # steady state: the first steps also compile kernels and start the DataLoader workers
        skip = min(5, p.student_steps // 10)
        per_step = (starts[-1] - starts[skip]) / (p.student_steps - skip)
        metrics = self.heldout(model, teacher=self.teacher)
        cache = self.results["caches"].get(v.cache, {})
        self.results["variants"][v.name] = {
            **asdict(v), **{f"heldout_{key}": value for key, value in metrics.items()},
            "seconds_per_step": per_step, "bytes_per_token": cache.get("bytes_per_token"), "curve": curve}
        whole = ""
        if "document_eval" in self.results:
            docs = self.heldout_documents(model, teacher=self.teacher)
            self.results["variants"][v.name].update(heldout_doc_ce=docs["ce"], heldout_doc_kl=docs["kl"])
            whole = f"; whole documents: cross-entropy {docs['ce']:.4f}, KL {docs['kl']:.4f}"
        self.stage("students (training + held-out)", time.perf_counter() - t)  # saved: a resume skips it
        self.log(f"{v.name}: held-out cross-entropy {metrics['ce']:.4f}, KL(teacher||student) {metrics['kl']:.4f}"
                 f"{whole}, {1e3 * per_step:.1f} ms/step")

    def best_tail(self) -> str:
        """The tail whose plain (forward KL, ce_weight 0) top-K variants have the lowest mean held-out CE."""
        scores = {}
        for r in self.results["variants"].values():
            if r["kind"] == "topk" and r["ce_weight"] == 0 and r.get("divergence", "forward") == "forward":
                scores.setdefault(r["tail"], []).append(r["heldout_ce"])
        if not scores:
            raise ValueError("a top{K}-best variant needs plain top-K variants to pick the tail from; name a tail")
        best = min(scores, key=lambda tail: sum(scores[tail]) / len(scores[tail]))
        self.results["best_tail"] = best
        self.log(f"best tail: {best} (mean held-out CE " + ", ".join(
            f"{tail} {sum(s) / len(s):.4f}" for tail, s in scores.items()) + ")")
        return best

    def run(self, variants: list[Variant]) -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        self.build_data()
        self.train_teacher()
        # "best"-tail variants run last, once the tails have been compared
        for v in self.build_caches([v for v in variants if v.tail != "best"]):
            self.train_student(v)
        last = [v for v in variants if v.tail == "best"]
        if last:
            tail = self.best_tail()
            resolved = [replace(v, name=v.name.replace("best", tail), tail=tail) for v in last]
            for v in self.build_caches([v for v in resolved if v.name not in self.results["variants"]]):
                self.train_student(v)
        self.tb.close()
        self.results["goals"] = goals(self.results)
        # the stages add up across resumed calls; this call's wall time alone would undercount a resumed run
        self.results["seconds"] = round(sum(self.results["stages"].values()), 1)
        return self.results


def _complete_cache(path: Path) -> bool:
    from megatron_kd.cache import CacheError, CacheReader

    try:
        CacheReader(path)
        return True
    except (CacheError, OSError):
        return False


# ----------------------------------------------------------------------------------------------
# report


def goals(results: dict) -> dict:
    """The benchmark's two goals, where the variants they need were run."""
    v, out = results["variants"], {}
    if "online" in v:
        top100 = {n: r for n, r in v.items() if r["kind"] == "topk" and r["k"] == 100}
        if top100:
            best = min(top100, key=lambda n: top100[n]["heldout_ce"])
            gap = top100[best]["heldout_ce"] / v["online"]["heldout_ce"] - 1
            out["best_top100_vs_online"] = {"variant": best, "gap": gap, "goal": 0.01, "met": gap <= 0.01}
    if "ce" in v:
        gains = {n: 1 - r["heldout_ce"] / v["ce"]["heldout_ce"] for n, r in v.items() if n != "ce"}
        if gains:
            out["kd_vs_ce_only"] = {"gains": gains, "min_gain": min(gains.values()), "goal": 0.03,
                                    "met": min(gains.values()) >= 0.03}
    return out


def write_markdown(results: dict, path: Path):
    path.write_text("\n".join(markdown_lines(results)))


def _document_eval_line(results: dict) -> str:
    d, e = results["corpus"]["heldout_document_eval"], results["document_eval"]
    return (f"Whole-document held-out metric: the first {d['documents']} held-out documents ({d['predictions']:,} "
            f"predictions; median {d['median_tokens']} tokens, longest {d['max_tokens']:,}), each evaluated on its own "
            f"from its first token; the {d['longer_than_window']} with more than {e['window']} predictions in windows of "
            f"{e['window']} tokens every {e['stride']}, each window scoring only what the one before it did not reach "
            f"(so every token is predicted from its own document alone, at least {e['window'] - e['stride'] + 1} "
            f"tokens of it or all before it).")


def markdown_lines(results: dict, heading: str = "#") -> list[str]:
    """results.md of one run (``heading``: the Markdown level of its title)."""
    v, t, corpus = results["variants"], results["teacher"], results["corpus"]
    ce_only, online = v.get("ce", {}).get("heldout_ce"), v.get("online", {}).get("heldout_ce")
    rel = lambda x, ref: "" if ref is None else f"{x / ref - 1:+.2%}"  # noqa: E731
    late = t["late_heldout_gain"]
    docs = "document_eval" in results
    packing = results.get("packing", "none")
    lines = [
        f"{heading} Distillation fidelity ({results['device']}, autocast {results['autocast']}"
        + (f", packing {packing_of(packing, 0).describe()}" if packing != "none" else "") + ")", "",
        (f"Corpus: {corpus['train_documents']:,} documents, {corpus['train_tokens']:,} training tokens; held out "
         f"{corpus['heldout_documents']:,} documents, evaluated on {corpus['heldout_samples']} x "
         f"{results['preset']['seq_length']} tokens. BPE vocabulary {corpus['vocab_size']:,}."),
        (f"Teacher: {t['parameters']:,} parameters, {t['steps']} steps, held-out CE {t['heldout_ce']:.4f} nats/token "
         f"({late['gain']:+.2%} since step {late['since_step']})"
         + (f"; on whole documents {t['heldout_doc_ce']:.4f}." if docs else ".")), "",
        *([_document_eval_line(results), ""] if docs else []),
        ("Caches: one teacher pass each, written with its own K (or number of draws); bytes/token = store size / "
         "cached tokens; teacher mass = mean probability per token the cache holds."), "",
        "| cache | mode | K / draws | bytes/token | teacher mass | teacher pass (s) |",
        "|---|---|---:|---:|---:|---:|",
        *(f"| {name} | {cache['mode']} | {cache['k']} | {cache['bytes_per_token']:.1f} | "
          f"{cache['mean_teacher_mass']:.3f} | {cache['seconds']:.0f} |" for name, cache in results["caches"].items()),
        "",
        ("Students: held-out cross-entropy (CE) and full-vocabulary KL(teacher || student), nats/token; ms/step: "
         "steady-state wall time of one training step, data included."), "",
        "| variant | cache bytes/token | held-out CE | vs CE-only | vs online | held-out KL(T‖S) | ms/step |"
        + (" whole-doc CE | whole-doc KL(T‖S) |" if docs else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if docs else ""),
    ]
    for name, r in v.items():
        bpt = "" if r["bytes_per_token"] is None else f"{r['bytes_per_token']:.1f}"
        lines.append(f"| {name} | {bpt} | {r['heldout_ce']:.4f} | {rel(r['heldout_ce'], ce_only)} | "
                     f"{rel(r['heldout_ce'], online)} | {r['heldout_kl']:.4f} | {1e3 * r['seconds_per_step']:.1f} |"
                     + (f" {r['heldout_doc_ce']:.4f} | {r['heldout_doc_kl']:.4f} |" if docs else ""))
    g = results["goals"]
    lines.append("")
    if "best_top100_vs_online" in g:
        b = g["best_top100_vs_online"]
        lines.append(f"- Goal: best offline top-100 within 1% of online KD on held-out CE: {b['variant']} is "
                     f"{b['gap']:+.2%} -> {'met' if b['met'] else 'NOT met'}")
    if "kd_vs_ce_only" in g:
        k = g["kd_vs_ce_only"]
        worst = min(k["gains"], key=k["gains"].get)
        lines.append(f"- Goal: every KD variant >= 3% better than CE-only: the least held-out CE reduction is "
                     f"{k['min_gain']:+.2%} ({worst}; negative: worse than CE-only) -> {'met' if k['met'] else 'NOT met'}")
    if "draws_calibration" in results:
        d = results["draws_calibration"]
        tried = ", ".join(f"{n}: {b:.1f}" for n, b in d["sampled_bytes_per_token"].items())
        lines.append(f"- Sampled cache: {d['chosen']} draws/token, the most whose calibration bytes/token fit "
                     f"top-100's {d['top100_bytes_per_token']:.1f} ({tried})")
    if "best_tail" in results:
        lines.append(f"- Best tail (lowest mean held-out CE of the plain top-K variants): {results['best_tail']}")
    stages = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in results["stages"].items())
    lines += ["", f"Stage times: {stages}; total {results['seconds']:.0f} s (summed over resumed calls).", ""]
    return lines


PACKING_ABLATION = ("none", "documents+positions")  # attention across documents (today's default), kept apart


def packing_ablation_lines(results: dict) -> list[str]:
    """results.md of ``--packing-ablation``: both settings side by side, then each run in full."""
    modes, settings = results["packing_ablation"], results["settings"]
    first = settings[modes[0]]
    ref = lambda r: r["heldout_doc_ce"]  # noqa: E731
    rel = lambda x, y: "" if y is None else f"{x / y - 1:+.2%}"  # noqa: E731
    lines = [
        f"# Packing ablation: documents kept apart vs attention across them ({results['device']}, autocast "
        f"{results['autocast']})", "",
        ("The same benchmark twice over the same corpus, tokenizer, samples, order, steps and initializations; "
         "only how the teacher (its training, its held-out metric, its teacher passes, which the caches record) "
         "and every student treat the documents packed into a sample differ, through megatron_kd's "
         "DocumentPacking and the model's attention paths as `megatron-kd train` runs them:"),
        *(f"- {mode} ({packing_of(mode, 0).flags()})" + (
            ": attention crosses documents, positions run through the sample" if mode == "none" else
            ": attention within each document, positions restart at each" if mode == "documents+positions" else "")
          for mode in modes), "",
        _document_eval_line(first),
        ("The loss mask is the same in both settings (the benchmark's GPTDataset has eod_mask_loss off: the "
         "prediction made at an end-of-document token counts in training in both)."), "",
        (f"Whole-document held-out metrics, nats/token; KL(T‖S) against the teacher of the same setting; "
         f"'{modes[-1]} − {modes[0]}': the change in whole-document CE."), "",
        f"| model | packing | whole-doc CE | vs CE-only | vs online | whole-doc KL(T‖S) | {modes[-1]} − {modes[0]} "
        "| held-out windows CE (own packing) | ms/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = ["teacher", *dict.fromkeys(n for mode in modes for n in settings[mode]["variants"])]
    for name in names:
        for mode in modes:
            run = settings[mode]
            r = run["teacher"] if name == "teacher" else run["variants"].get(name)
            if r is None:
                continue
            other = settings[modes[0]]["teacher"] if name == "teacher" else settings[modes[0]]["variants"].get(name)
            delta = f"{ref(r) - ref(other):+.4f}" if mode != modes[0] and other is not None else ""
            ce_only, online = (run["variants"].get(k, {}).get("heldout_doc_ce") for k in ("ce", "online"))
            kl = "" if name == "teacher" else f"{r['heldout_doc_kl']:.4f}"
            ms = "" if name == "teacher" else f"{1e3 * r['seconds_per_step']:.1f}"
            vs = ("", "") if name == "teacher" else (rel(ref(r), ce_only), rel(ref(r), online))
            lines.append(f"| {name} | {mode} | {ref(r):.4f} | {vs[0]} | {vs[1]} | {kl} | {delta} | "
                         f"{r['heldout_ce']:.4f} | {ms} |")
    lines += ["", "Held-out windows CE: the benchmark's usual metric (seq_length windows of the concatenated held-out "
              "split), each model run with its own packing: not comparable across the settings (windows start "
              "inside documents; kept apart, a model sees less context there).", ""]
    for mode in modes:
        lines += markdown_lines(settings[mode], heading="##")
    lines += [f"Total {results['seconds']:.0f} s (both settings, summed over resumed calls).", ""]
    return lines


def plot(results: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values, width):
        out, acc = [], 0.0
        for i, x in enumerate(values):
            acc += x - (values[i - width] if i >= width else 0.0)
            out.append(acc / min(i + 1, width))
        return out

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(14, 5.5))
    t = results["teacher"]
    steps, values = zip(*t["curve"])
    ax_t.plot(steps, smooth(values, 25), label="training (moving average)", linewidth=1)
    h_steps, h_values = zip(*t["heldout_curve"])
    ax_t.plot(h_steps, h_values, "o-", label=f"held-out (final {t['heldout_ce']:.3f})")
    ax_t.set(title="teacher", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_t.legend()
    ax_t.grid(alpha=0.3)
    # one colour per loss family (ce, online, each cache), one line style per tail; dash-dot: with ce_weight
    families = list(dict.fromkeys(r["kind"] if r["kind"] != "topk" else r["k"] for r in results["variants"].values()))
    palette = plt.get_cmap("tab10").colors
    for name, r in results["variants"].items():
        steps, values = zip(*r["curve"])
        family = families.index(r["kind"] if r["kind"] != "topk" else r["k"])
        reference = r["kind"] in ("ce", "online")
        style = "-" if reference else "-." if r["ce_weight"] else {"none": ":", "renorm": "--"}.get(r["tail"], "-")
        ax_s.plot(steps, smooth(values, 10), style, color=palette[family % len(palette)],
                  linewidth=2 if reference else 1.1, zorder=3 if reference else 2,
                  label=f"{name} (held-out {r['heldout_ce']:.3f})")
    ax_s.set(title="students: cross-entropy of each batch before learning from it", xlabel="step",
             ylabel="cross-entropy (nats/token, moving average)")
    # zoom past the first tenth of training, where every curve falls from log(vocabulary)
    curves = [[value for step, value in r["curve"]] for r in results["variants"].values()]
    ax_s.set_ylim(bottom=min(min(c) for c in curves) - 0.1, top=max(smooth(c, 10)[len(c) // 10] for c in curves))
    ax_s.legend(fontsize=7, ncol=2)
    ax_s.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# entry point


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """"auto": bf16 on CUDA, none (fp32) on the CPU."""
    if dtype == "bf16" and device.type != "cuda":
        # megatron-core's linear layers restore autocast in their backward on CUDA only
        raise ValueError("--dtype bf16 needs CUDA")
    return torch.bfloat16 if dtype == "bf16" or (dtype == "auto" and device.type == "cuda") else None


def run(size: str, out: str | Path, variants: list[str] | None = None, *, dtype: str = "auto", log=print,
        resume: bool = False, packing: str = "none", document_eval: bool = False, packing_ablation: bool = False,
        **overrides) -> dict:
    """The whole benchmark; returns results.json's content. ``overrides`` replace preset fields;
    ``resume`` continues a stopped run in ``out`` with the same settings where it stopped.
    ``packing``: how teacher and students treat packed documents (``Bench``); ``document_eval``:
    held-out metrics on whole documents too; ``packing_ablation``: the run once per
    ``PACKING_ABLATION`` setting, whole-document metrics in both (``run_packing_ablation``)."""
    if packing_ablation:
        if packing != "none":
            raise ValueError("the packing ablation runs every setting of PACKING_ABLATION: leave packing out")
        return run_packing_ablation(size, out, variants, dtype=dtype, log=log, resume=resume, **overrides)
    preset, chosen, device, autocast, out = _setup(size, out, variants, dtype, overrides)
    bench = Bench(preset, out, device, autocast, log, packing=packing, document_eval=document_eval)
    if not (resume and bench.resume()):
        shutil.rmtree(out / "work", ignore_errors=True)  # datasets and caches are rebuilt
        shutil.rmtree(out / "tensorboard", ignore_errors=True)
        (out / "results.partial.json").unlink(missing_ok=True)
    _start_process(preset, device)

    results = bench.run(chosen)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.partial.json").unlink(missing_ok=True)
    write_markdown(results, out / "results.md")
    plot(results, out / "curves.png")
    shutil.rmtree(out / "work")
    bench.log(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'curves.png'}")
    return results


def _setup(size: str, out, variants, dtype: str, overrides: dict):
    """(preset, variants, device, autocast dtype, out directory, made) of a run."""
    preset = replace(PRESETS[size], **overrides)
    chosen = [parse_variant(name) for name in (variants or DEFAULT_VARIANTS)]
    if len({v.name for v in chosen}) != len(chosen):
        raise ValueError(f"variants repeat: {[v.name for v in chosen]}")
    device = default_device()
    autocast = autocast_dtype(dtype, device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return preset, chosen, device, autocast, out


def write_results(out: Path, results: dict, report: str) -> None:
    """The end of a run: its work directory and partial results gone, results.json and results.md
    (``report``) written, the report printed."""
    shutil.rmtree(out / "work")
    (out / "results.partial.json").unlink(missing_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report)
    print(report)


def _start_process(preset: Preset, device: torch.device):
    from megatron_kd.demo import _init_single_process

    _init_single_process()
    if device.type == "cuda":  # megatron-core's CUDA RNG tracker, seeded as Megatron-LM seeds it
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(preset.seed)
    # the DataLoader workers are forked after the tokenizer ran its thread pool, and never use it
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def run_packing_ablation(size: str, out: str | Path, variants: list[str] | None = None, *, dtype: str = "auto",
                         log=print, resume: bool = False, **overrides) -> dict:
    """The benchmark once per ``PACKING_ABLATION`` setting (teacher, caches and students alike),
    over the same data: the first setting's tokenizer is the second's (each setting has its own
    OUT/work/packing-MODE, results.partial.packing-MODE.json and tensorboard/packing-MODE, so
    ``resume`` continues either). Every model is also evaluated on whole held-out documents, each on
    its own (``document_windows``): the metric that favours neither setting. Returns results.json's
    content: {"packing_ablation": the settings, "settings": {mode: that run's results}, ...}."""
    preset, chosen, device, autocast, out = _setup(size, out, variants, dtype, overrides)
    benches = [Bench(preset, out, device, autocast, log, packing=mode, document_eval=True, tag=f"packing-{mode}")
               for mode in PACKING_ABLATION]
    if not resume:
        shutil.rmtree(out / "work", ignore_errors=True)
    for bench in benches:
        if not (resume and bench.resume()):
            shutil.rmtree(bench.work, ignore_errors=True)
            shutil.rmtree(bench.tensorboard, ignore_errors=True)
            bench.partial.unlink(missing_ok=True)
    _start_process(preset, device)
    settings, first = {}, benches[0].work / "tokenizer.json"
    for bench in benches:
        if bench is not benches[0] and not (bench.work / "tokenizer.json").exists():  # the same data in both
            bench.work.mkdir(parents=True, exist_ok=True)
            shutil.copy(first, bench.work / "tokenizer.json")
        bench.log(f"packing ablation: setting {bench.packing_mode!r} ({packing_of(bench.packing_mode, 0).flags()})")
        settings[bench.packing_mode] = bench.run(chosen)
    results = {"preset": asdict(preset), "device": str(device), "autocast": str(autocast),
               "packing_ablation": list(PACKING_ABLATION), "settings": settings,
               "seconds": round(sum(r["seconds"] for r in settings.values()), 1)}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(packing_ablation_lines(results)))
    for bench in benches:
        plot(settings[bench.packing_mode], out / f"curves-packing-{bench.packing_mode}.png")
        bench.partial.unlink(missing_ok=True)
    shutil.rmtree(out / "work")
    benches[-1].log(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out}/curves-packing-*.png")
    return results
