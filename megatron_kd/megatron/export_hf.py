"""``megatron-kd export-hf``: a trained student's Megatron checkpoint -> a Hugging Face directory.

    torchrun --nproc-per-node 1 -m megatron_kd.cli export-hf <the student's model flags> \\
        --load CKPT --out /models/my-student [--kd-student-hf /models/gpt-oss-20b]

(``examples/gpt_oss/export_hf.sh 20b --load CKPT --out DIR`` passes the recipe's model flags.)
The checkpoint is loaded with tensor- and pipeline-parallel size 1 whatever layout it was trained
with (Megatron's distributed checkpoints reshard on load; its padded vocabulary size is read from
the checkpoint), and written through nvidia-modelopt's exporter with the Hugging Face config
that computes the same function (``models.hf.hf_config_from_args``: GPT-OSS, Llama or Qwen3). The vocabulary has the
rows of the Hugging Face directory the student started from (``--kd-student-hf``, remembered in
the checkpoint's arguments), else the tokenizer's; the tokenizer files are copied alongside.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str]) -> int:
    from megatron.core.utils import unwrap_model
    from megatron.training import print_rank_0
    from megatron.training.checkpointing import load_args_from_checkpoint, load_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    from megatron_kd.megatron.train import model_provider, parse_megatron_args, require_cuda
    from megatron_kd.errors import ModelConfigError
    from megatron_kd.models.hf import export_hf_weights, hf_config_from_args, hf_vocab_rows

    ours = argparse.ArgumentParser(prog="megatron-kd export-hf", add_help=False)
    ours.add_argument("--out", required=True)
    known, megatron_argv = ours.parse_known_args(argv)
    # one model replica, unsharded: the exporter writes whole tensors
    megatron_argv += ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                      "--no-load-optim", "--no-load-rng"]
    args = parse_megatron_args(megatron_argv)
    if args.load is None:
        raise ModelConfigError("export-hf needs the student's checkpoint: --load CKPT_DIR")
    require_cuda("export-hf")  # before Megatron's initialization asserts it
    initialize_megatron()
    saved = load_args_from_checkpoint(argparse.Namespace(**vars(args)))
    saved_args = saved[1] if isinstance(saved, tuple) else None
    if saved_args is None:
        raise ModelConfigError(f"{args.load}: no Megatron checkpoint with saved arguments there")
    args.padded_vocab_size = saved_args.padded_vocab_size  # the rows the checkpoint was trained with
    template = args.kd_student_hf or getattr(saved_args, "kd_student_hf", None)
    from megatron.training import get_tokenizer

    vocab = hf_vocab_rows(template) if template else get_tokenizer().vocab_size
    hf_config = hf_config_from_args(args, vocab_size=vocab)

    model = get_model(model_provider, wrap_with_ddp=False)
    iteration, _ = load_checkpoint(model, None, None, strict=True)
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    export_hf_weights(unwrap_model(model[0]), known.out, hf_config, dtype=dtype,
                      tokenizer_dir=template or args.tokenizer_model)
    experts = getattr(hf_config, "num_local_experts", None)
    print_rank_0(f"exported {args.load} (iteration {iteration}) to {known.out}: {hf_config.architectures[0]}, "
                 f"{hf_config.num_hidden_layers} layers" + (f", {experts} experts" if experts else "")
                 + f", vocabulary {vocab}, {dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
