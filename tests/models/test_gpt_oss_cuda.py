"""The GPT-OSS workflow on a GPU through the CLI (skipped without CUDA; CI is CPU-only):

1. ``cache build --kd-teacher-hf HF`` with GPT-OSS flags: the teacher is the Megatron model the flags
   describe, its weights imported from the Hugging Face directory (ModelOpt), written to a cache
2. ``train --kd-student-hf HF --lr 0``: the student starts from the same directory, distills for two
   steps without moving, saves; ``export-hf`` gives back the directory's tensors (bf16) exactly
3. ``train --kd-student-hf HF`` with a learning rate: kd loss and teacher mass reported; its export
   loads in transformers and differs from where it started
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures.cli_utils import run_cli
from tests.fixtures.tiny_gpt_oss import EOD, TOKENIZER_TOKENS, cli_flags, make_tiny_gpt_oss

pytestmark = pytest.mark.cuda


def _tensors(path: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_gpt_oss_teacher_student_export(tmp_path):
    from megatron_kd.megatron.data import write_indexed_dataset

    hf = make_tiny_gpt_oss(tmp_path / "hf")
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(3, TOKENIZER_TOKENS, int(rng.integers(50, 200)))) + [EOD] for _ in range(200)]
    data = str(write_indexed_dataset(tmp_path / "data" / "docs", docs, TOKENIZER_TOKENS))
    cache = tmp_path / "cache"
    log = run_cli(["cache", "build", *cli_flags(tmp_path, data, 2), "--kd-teacher-hf", str(hf), "--kd-cache",
                   str(cache), "--kd-cache-mode", "topk", "--kd-topk", "16"], tmp_path, "build", 1)
    assert "8 samples" in log, log[-3000:]

    def distill_and_export(name: str, lr: str) -> tuple[str, Path]:
        """Distill from the HF start for two steps at ``lr``, save, export; (training log, HF directory)."""
        ckpt, out = tmp_path / name, tmp_path / f"{name}-hf"
        log = run_cli(["train", *cli_flags(tmp_path, data, 2), "--kd-student-hf", str(hf), "--kd-cache", str(cache),
                       "--lr", lr, "--save", str(ckpt), "--save-interval", "2"], tmp_path, name, 1)
        run_cli(["export-hf", *cli_flags(tmp_path, data, 2), "--load", str(ckpt), "--kd-student-hf", str(hf),
                 "--out", str(out)], tmp_path, f"export-{name}", 1)
        return log, out

    log, frozen = distill_and_export("frozen", "0")
    assert "kd loss" in log, log[-3000:]
    before, after = _tensors(hf), _tensors(frozen)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key].to(torch.bfloat16), after[key]), key

    log, trained = distill_and_export("trained", "1e-3")
    assert "teacher mass" in log, log[-3000:]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    logits = model(input_ids=torch.tensor([docs[0][:32]])).logits
    assert torch.isfinite(logits).all()
    moved = _tensors(trained)
    assert not torch.equal(before["lm_head.weight"].to(torch.bfloat16), moved["lm_head.weight"])
