"""How close a healed student is to its teacher, scored by ``transformers`` on Hugging Face directories:
the models as ``export-hf`` wrote them, so what is measured is what a user ships.

Two kinds of token windows, ``[n, seq_length + 1]`` each with a loss mask ``[n, seq_length]``:

- ``megatron_windows``: the samples megatron-core's GPTDataset yields for a run's data flags, with
  the loss masks ``megatron-kd train`` applies (a chat dataset's answer-only mask included); the
  validation split's first ``--eval-iters`` x ``--global-batch-size`` are what ``train``'s own
  evaluation at the end of a run reads, so its CE and this one's must agree;
- ``text_windows``: documents of a JSONL file tokenized as ``megatron-kd data text`` tokenizes them
  (no BOS, the EOD after each), concatenated and cut into windows spread evenly over the text:
  text from other sources than the healing data (out of domain).

``score`` runs every model over the same windows next to the teacher and returns, per model, the
cross-entropy of the next token, KL(teacher || model) over the full vocabulary and the fraction of
positions where its top-1 token is the teacher's (the mean over the masked positions; logits in
fp32 from the models' own dtype).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Windows:
    tokens: torch.Tensor  # [n, seq_length + 1] int64
    loss_mask: torch.Tensor  # [n, seq_length] float32

    def batches(self, size: int):
        for i in range(0, len(self.tokens), size):
            yield self.tokens[i:i + size], self.loss_mask[i:i + size]


def megatron_windows(flags: list[str], *, split: str = "valid", count: int | None = None) -> Windows:
    """The first ``count`` samples (default: what one evaluation reads) of ``split`` as megatron-core
    builds it for ``flags`` (a ``megatron-kd train`` command's Megatron-LM flags)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_kd.data.chat import build_tokenizer
    from megatron_kd.megatron.loss_mask import with_loss_masks
    from megatron_kd.megatron.flags import parse_flags
    from megatron_kd.megatron.run import gpt_dataset_config

    args = parse_flags(flags)
    if args.tokenizer_model is None:
        args.tokenizer_model = args.kd_student_hf or args.kd_teacher_hf
    tokenizer = build_tokenizer(args)
    gbs = args.global_batch_size
    # the sample counts Megatron-LM's get_train_valid_test_num_samples asks for: the same index files
    eval_interval = args.eval_interval or args.train_iters + 1
    sizes = [args.train_iters * gbs, (args.train_iters // eval_interval + 1) * args.eval_iters * gbs,
             args.eval_iters * gbs]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gpt_dataset_config(args, tokenizer))
    dataset = with_loss_masks(builder.build()[("train", "valid", "test").index(split)])
    count = min(args.eval_iters * gbs if count is None else count, len(dataset))
    tokens, masks = [], []
    for i in range(count):
        sample = dataset[i]
        tokens.append(torch.cat([torch.as_tensor(sample["tokens"]), torch.as_tensor(sample["labels"][-1:])]))
        masks.append(torch.as_tensor(sample["loss_mask"], dtype=torch.float32))
    return Windows(torch.stack(tokens).long(), torch.stack(masks))


def text_windows(jsonl: str | Path, tokenizer, *, seq_length: int, count: int, eod: int,
                 json_key: str = "text") -> Windows:
    """``count`` windows of ``seq_length + 1`` tokens spread evenly over the documents of ``jsonl``."""
    ids: list[int] = []
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids += tokenizer.encode(json.loads(line)[json_key], add_special_tokens=False) + [eod]
    stream = torch.tensor(ids, dtype=torch.int64)
    full = (len(stream) - 1) // seq_length
    if full < 1:
        raise ValueError(f"{jsonl}: {len(stream)} tokens, fewer than one window of {seq_length + 1}")
    starts = np.unique(np.linspace(0, full - 1, min(count, full)).round().astype(np.int64)) * seq_length
    tokens = torch.stack([stream[s:s + seq_length + 1] for s in starts.tolist()])
    return Windows(tokens, torch.ones(len(tokens), seq_length))


@dataclass
class Score:
    ce: float
    kl: float
    top1: float
    tokens: int


@torch.no_grad()
def score(models: dict[str, torch.nn.Module], teacher: str, windows: Windows, *, batch_size: int = 4,
          device: torch.device | str = "cpu") -> dict[str, Score]:
    """CE, KL(teacher || model) and top-1 agreement with the teacher of every model (the teacher's own
    KL is 0 and agreement 1), over the masked positions of ``windows``."""
    sums = {name: torch.zeros(4, dtype=torch.float64, device=device) for name in models}
    for tokens, mask in windows.batches(batch_size):
        tokens, mask = tokens.to(device), mask.to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        log_p = models[teacher](input_ids=inputs).logits.float().log_softmax(-1)
        p, top_t = log_p.exp(), log_p.argmax(-1)
        for name, model in models.items():
            log_q = log_p if name == teacher else model(input_ids=inputs).logits.float().log_softmax(-1)
            ce = -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            kl = (p * (log_p - log_q)).sum(-1)
            top1 = (log_q.argmax(-1) == top_t).float()
            sums[name] += torch.stack([(x * mask).sum().double() for x in (ce, kl, top1, mask)])
    out = {}
    for name, (ce, kl, top1, n) in sums.items():
        n = float(n)
        out[name] = Score(ce=float(ce) / n, kl=float(kl) / n, top1=float(top1) / n, tokens=int(n))
    return out


def load_models(dirs: dict[str, str | Path], *, dtype=torch.bfloat16, device="cpu") -> dict[str, torch.nn.Module]:
    import transformers

    return {name: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
            for name, d in dirs.items()}
