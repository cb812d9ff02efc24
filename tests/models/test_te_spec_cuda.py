"""Llama 3 and Qwen3 students on megatron-core's Transformer Engine spec (``--transformer-impl
transformer_engine``, what NGC's image builds), on the GPU, imported and exported through the
product. Skipped without CUDA or Transformer Engine (GPT-OSS on the TE spec is the ``cuda-bf16-te``
variant of tests/models/test_gpt_oss_cuda_equality.py).

For each of a tiny random LlamaForCausalLM (Llama 3.1's RoPE scaling) and Qwen3ForCausalLM
(QK-norm), built by ``model_provider`` from ``--kd-student-hf`` as ``megatron-kd train`` builds it:

1. fp32 (TF32 off): transformers' fp32 logits to 1e-4; HF -> Megatron (TE) -> HF gives back
   identical tensors; a fused KD step through the TE model's output layer equals the dense
   reference (loss 1e-5, every gradient 1e-4) and one step lowers the loss
2. bf16 (``--bf16``, Float16Module as megatron.training wraps it): transformers' fp32 logits within
   3x the error of transformers' own bf16 model plus 2^-8 (the yardstick of
   test_gpt_oss_cuda_equality.py)
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.fixtures.dist_utils import spawn
from tests.fixtures.hf_equality import assert_same_tensors, build_student, forget_megatron, kd_step
from tests.fixtures.kd_inputs import rel_err
from tests.fixtures.tiny_gpt_oss import TE_IMPL, TOKENIZER_TOKENS, VOCAB_ROWS
from tests.fixtures.tiny_llama import KINDS, SEQ, make_tiny, tiny_flags

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="megatron-core's TE spec needs Transformer Engine")]


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)[..., :VOCAB_ROWS].float()


def _transformers(hf_dir, dtype, tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(tokens.device).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def _worker(rank, world, tmp, seed):
    from megatron.core.transformer.module import Float16Module

    from megatron_kd.models.hf import export_hf_weights, hf_config_from_args

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tokens = torch.randint(0, TOKENIZER_TOKENS, (2, SEQ), generator=torch.Generator().manual_seed(seed)).cuda()
    for kind in KINDS:
        hf_dir = make_tiny(kind, Path(tmp) / kind / "hf", seed=seed)
        want = _transformers(hf_dir, torch.float32, tokens)

        args, model = build_student(tiny_flags(hf_dir, *TE_IMPL))
        assert args.transformer_impl == "transformer_engine"
        assert any("layer_norm_weight" in n for n, _ in model.named_parameters()), "not TE's fused norm + linear"
        model.cuda()
        err = rel_err(_logits(model.eval(), tokens), want)
        assert err < 1e-4, f"{kind} fp32 on the TE spec: {err:.2e}"
        out = Path(tmp) / kind / "export"
        export_hf_weights(model, out, hf_config_from_args(args, vocab_size=VOCAB_ROWS), dtype=torch.float32,
                          tokenizer_dir=hf_dir)
        assert_same_tensors(hf_dir, out)
        kd_step(model.train(), None, seed, SEQ, experts=False, device="cuda")
        forget_megatron()

        args, model = build_student(tiny_flags(hf_dir, *TE_IMPL, "--bf16"))
        model = Float16Module(model.config, model.cuda())
        ours = _logits(model.eval(), tokens)
        yardstick = rel_err(_transformers(hf_dir, torch.bfloat16, tokens), want)
        err = rel_err(ours, want)
        print(f"{kind} bf16 on the TE spec: {err:.2e} against transformers fp32; transformers bf16: {yardstick:.2e}")
        assert err <= 3 * yardstick + 2.0 ** -8, (kind, err, yardstick)
        forget_megatron()


def test_llama_and_qwen3_on_the_te_spec_are_transformers(tmp_path, seed):
    spawn(_worker, str(tmp_path), seed, world_size=1, backend="nccl")
