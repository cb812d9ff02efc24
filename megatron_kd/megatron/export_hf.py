"""A trained student's Megatron checkpoint -> a Hugging Face directory.

    torchrun --nproc-per-node 1 -m megatron_kd.cli export-hf <the student's model flags> \\
        --load CKPT --out /models/my-student [--kd-student-hf /models/gpt-oss-20b]

(``examples/gpt_oss/export_hf.sh 20b --load CKPT --out DIR`` passes the recipe's model flags.)
The checkpoint is loaded with tensor- and pipeline-parallel size 1 whatever layout it was trained
with (Megatron's distributed checkpoints reshard on load; its padded vocabulary size is read from
the checkpoint), and written through nvidia-modelopt's exporter with the Hugging Face config
that computes the same function (``models.hf.hf_config_from_args``: GPT-OSS, Llama or Qwen3). The vocabulary has the
rows of the Hugging Face directory the student started from (``--kd-student-hf``, remembered in
the checkpoint's arguments), else the tokenizer's; the tokenizer files are copied alongside. A
student trained with ``--kd-quant`` (remembered in the checkpoint's arguments) is written with its
experts' weights quantized, as its forward computed with them: GPT-OSS with ``mxfp4`` in the
release's MXFP4 layout (``models/mxfp4_release.py``), otherwise dense in the run's dtype.
The command, its flags and its checks: ``commands/export_hf.py``.
"""

from __future__ import annotations

import argparse

import torch

# one model replica, unsharded, weights only: the exporter writes whole tensors
EXPORT_FLAGS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--no-load-optim",
                "--no-load-rng"]


def export_hf(args, out: str) -> dict:
    """Starts Megatron, loads the ``--load`` checkpoint into the model Megatron-LM's global arguments
    ``args`` describe (given ``EXPORT_FLAGS``) and writes it to ``out`` as a Hugging Face directory.
    Returns what was written: the checkpoint's ``iteration``, the Hugging Face ``config``, the
    ``vocab`` rows and the ``dtype``."""
    from megatron.core.utils import unwrap_model
    from megatron.training import get_tokenizer
    from megatron.training.checkpointing import load_args_from_checkpoint, load_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    from megatron_kd.errors import ModelConfigError
    from megatron_kd.megatron.run import model_provider
    from megatron_kd.models.hf import export_hf_weights, hf_config_from_args, hf_vocab_rows

    initialize_megatron()
    saved = load_args_from_checkpoint(argparse.Namespace(**vars(args)))
    saved_args = saved[1] if isinstance(saved, tuple) else None
    if saved_args is None:
        raise ModelConfigError(f"{args.load}: no Megatron checkpoint with saved arguments there")
    args.padded_vocab_size = saved_args.padded_vocab_size  # the rows the checkpoint was trained with
    template = args.kd_student_hf or getattr(saved_args, "kd_student_hf", None)
    vocab = hf_vocab_rows(template) if template else get_tokenizer().vocab_size
    hf_config = hf_config_from_args(args, vocab_size=vocab)

    model = get_model(model_provider, wrap_with_ddp=False)
    iteration, _ = load_checkpoint(model, None, None, strict=True)
    quant = args.kd_quant or getattr(saved_args, "kd_quant", None)
    if quant:  # a QAD student: its experts as its forward saw them, not the optimizer's weights
        from megatron_kd.models.experts import bake_quantized_experts, quantize_experts

        quantize_experts(unwrap_model(model[0]), quant)
        bake_quantized_experts(unwrap_model(model[0]))
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    export_hf_weights(unwrap_model(model[0]), out, hf_config, dtype=dtype,
                      tokenizer_dir=template or args.tokenizer_model)
    layout = "dense"
    if quant == "mxfp4" and hf_config.model_type == "gpt_oss":
        from megatron_kd.models.mxfp4_release import write_mxfp4_experts

        write_mxfp4_experts(out)
        layout = "mxfp4"
    return {"iteration": iteration, "config": hf_config, "vocab": vocab, "dtype": dtype, "experts": layout}
