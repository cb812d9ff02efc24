"""``megatron-kd train`` / ``python -m megatron_kd.train``: a Megatron-LM GPT pretraining run
that distills from a teacher cache. Launch with torchrun; every usual Megatron-LM flag works, plus
``--kd-*`` (see ``args.py``). Without ``--kd-cache`` it is plain cross-entropy pretraining.

    torchrun --nproc-per-node 8 -m megatron_kd.train <Megatron-LM flags> --kd-cache PATH ...

Pieces (megatron.training.pretrain's hooks): ``model_provider`` (GPTModel; TE layer spec when
transformer-engine is importable, local spec with SDPA attention otherwise), ``datasets_provider``
(megatron-core GPTDataset splits as Megatron-LM builds them; the training split joined to the
cache and checked against it), and ``forward_step`` (``KDForwardStep``: teacher tensors broadcast
over TP, split for CP, fused loss through GPTModel's output_processor). Validation batches carry
no teacher: they report the student's cross-entropy.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from functools import partial

from megatron_kd.megatron.loss_mask import with_loss_masks
from megatron_kd.errors import FlagError, FlagParser, UserError
from megatron_kd.megatron.args import KDConfig, add_kd_args, check_kd_flags
from megatron_kd.megatron.data import repair_index_cache
from megatron_kd.megatron.hf_check import check_hf_dir
from megatron_kd.megatron.kd_data import KDDataset
from megatron_kd.megatron.loss import KDForwardStep
from megatron_kd.megatron.packing import DocumentPacking, check_packing_flags
from megatron_kd.models.gpt import gpt_model_from_args
from megatron_kd.models.hf import hf_vocab_rows, init_from_hf
from megatron_kd.optim.megatron import expand_optimizer_flags


def has_checkpoint(load_dir: str | None) -> bool:
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    return bool(load_dir) and os.path.isfile(get_checkpoint_tracker_filename(load_dir))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """The student (or teacher) GPTModel from the flags; ``--kd-student-hf`` weights unless resuming."""
    from megatron.training import get_args

    args = get_args()
    if args.record_memory_history:
        start_allocator_history(args)
    model = gpt_model_from_args(args, config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    if args.kd_student_hf and not has_checkpoint(args.load):
        init_from_hf(model, args.kd_student_hf, args)
    return model


_ALLOCATOR_HISTORY = []


def start_allocator_history(args) -> None:
    """``--record-memory-history``: megatron-core 0.19 starts the CUDA allocator's history (the call
    sites in the snapshots it dumps) only when it builds the model from a ModelConfig; with a model
    provider, ours, its snapshots hold no call sites. The same call, once per process, before the
    model's first allocation (this rank's device is set by then)."""
    if _ALLOCATOR_HISTORY:
        return
    from megatron.training.config import ProfilingConfig
    from megatron.training.utils import start_memory_history_recording

    start_memory_history_recording(ProfilingConfig(record_memory_history=True, profile_ranks=args.profile_ranks,
                                                   memory_snapshot_path=args.memory_snapshot_path))
    _ALLOCATOR_HISTORY.append(True)


def gpt_dataset_config(args, tokenizer):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False, num_dataset_builder_threads=args.num_dataset_builder_threads,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def is_dataset_built_on_rank(vp_stage=None):
    from megatron.core import parallel_state

    first_or_last = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    return first_or_last and parallel_state.get_tensor_model_parallel_rank() == 0


def build_datasets(train_val_test_num_samples, is_built_on_rank=is_dataset_built_on_rank):
    """GPT dataset splits exactly as Megatron-LM's pretrain_gpt builds them (the teacher pass uses
    this too, so sample indices agree), after removing torn cached index files; a data prefix with
    a chat loss mask (``megatron-kd data chat``) has it joined to each sample's loss mask."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    tokenizer = get_tokenizer()
    config = gpt_dataset_config(args, tokenizer)
    repair_index_cache(config)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, is_built_on_rank, config)
    return [with_loss_masks(split) for split in builder.build()], tokenizer


def consumed_train_samples(args) -> int:
    return args.train_samples if args.train_samples else args.train_iters * args.global_batch_size


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.training import get_args, print_rank_0

    args = get_args()
    (train, valid, test), tokenizer = build_datasets(train_val_test_num_samples)
    if args.kd_cache and train is not None:
        train = KDDataset(train, args.kd_cache, tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                          required_samples=consumed_train_samples(args),
                          packing=DocumentPacking.from_args(args, eod=tokenizer.eod).mode)
        print_rank_0(f"> distilling from {args.kd_cache}: K={train.meta.topk}, mode={train.meta.mode}, "
                     f"{train.meta.num_samples} samples")
        warning = KDConfig.from_args(args).divergence_warning
        if warning:
            print_rank_0(warning)
    return train, valid, test


datasets_provider.is_distributed = True


class _LoggedForwardStep(KDForwardStep):
    """Adds tokens/s to Megatron's TensorBoard writer every log interval."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = 0

    def __call__(self, data_iterator, model):
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args, get_tensorboard_writer

        out = super().__call__(data_iterator, model)
        self.calls += 1
        args = get_args()
        per_log = args.log_interval * get_num_microbatches()
        if model.training and self.calls % per_log == 0:
            writer = get_tensorboard_writer()
            rate = self.tokens_per_second()
            if writer is not None:
                writer.add_scalar("kd/tokens_per_s_per_rank", rate, self.calls // get_num_microbatches())
        return out


def forward_step(data_iterator, model):
    return _forward_step_impl()(data_iterator, model)


_FORWARD = None


def _forward_step_impl():
    global _FORWARD
    if _FORWARD is None:
        from megatron.core import parallel_state
        from megatron.training import get_args, get_tokenizer

        args = get_args()
        _FORWARD = _LoggedForwardStep(
            KDConfig.from_args(args), tp_group=parallel_state.get_tensor_model_parallel_group(),
            cp_group=parallel_state.get_context_parallel_group() if args.context_parallel_size > 1 else None,
            is_last_stage=parallel_state.is_pipeline_last_stage,
            is_first_stage=parallel_state.is_pipeline_first_stage,
            packing=DocumentPacking.from_args(args, eod=get_tokenizer().eod),
        )
    return _FORWARD


# Flags Megatron-LM's validation needs (it asserts without a message when one is missing).
REQUIRED_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "seq_length": "--seq-length", "micro_batch_size": "--micro-batch-size", "tokenizer_type": "--tokenizer-type",
}


def megatron_parser(prog: str = "megatron-kd") -> argparse.ArgumentParser:
    """Megatron-LM's own argument parser with the --kd-* group, raising FlagError instead of exiting."""
    from megatron.training.arguments import add_megatron_arguments

    parser = FlagParser(prog=prog, allow_abbrev=False, exit_on_error=False)
    return add_kd_args(add_megatron_arguments(parser))


def parse_flags(argv: list[str], prog: str = "megatron-kd") -> argparse.Namespace:
    """Megatron-LM's and our flags parsed (not validated); an unknown flag or a bad value is one
    ``FlagError``."""
    try:
        known, unknown = megatron_parser(prog).parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise FlagError(str(e)) from None
    if unknown:
        raise FlagError(f"unrecognized arguments: {' '.join(unknown)} (--help lists the --kd-* flags, "
                        f"--help-megatron all of Megatron-LM's)")
    return known


def hf_tokenizer_dir(flags: argparse.Namespace) -> str | None:
    """The Hugging Face directory the run takes its tokenizer from (``--tokenizer-model``'s default)."""
    return flags.kd_student_hf or flags.kd_teacher_hf


def _reads_tokenizer_model(tokenizer_type: str | None) -> bool:
    from megatron.core.tokenizers.utils.build_tokenizer import SP_TOKENIZERS

    return tokenizer_type in {*SP_TOKENIZERS, "TikTokenizer", "HuggingFaceTokenizer", "SFTTokenizer"}


def check_megatron_flags(argv: list[str]) -> argparse.Namespace:
    """Unknown flags, bad values, missing required flags, every --kd-* flag's range and the Hugging
    Face directories, as one ``FlagError`` (``HFDirError``) line, before Megatron-LM's parser prints
    its usage (hundreds of lines) or asserts without a message. Returns the parsed (not yet
    validated) flags."""
    known = parse_flags(argv)
    missing = [flag for dest, flag in REQUIRED_FLAGS.items() if getattr(known, dest, None) is None]
    if known.train_iters is None and known.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise FlagError(f"missing required flags: {', '.join(missing)}")
    check_kd_flags(known)
    check_packing_flags(known)
    tokenizer_dir = hf_tokenizer_dir(known) if known.tokenizer_model is None else None
    for flag, path in (("--kd-student-hf", known.kd_student_hf), ("--kd-teacher-hf", known.kd_teacher_hf)):
        if path:
            check_hf_dir(path, flag, tokenizer=path == tokenizer_dir and _reads_tokenizer_model(known.tokenizer_type))
    return known


def megatron_defaults(flags: argparse.Namespace, args_defaults: dict | None = None) -> dict:
    defaults = dict(args_defaults or {})
    if hf_tokenizer_dir(flags):  # a Hugging Face model brings its own tokenizer
        defaults.setdefault("tokenizer_model", hf_tokenizer_dir(flags))
    return defaults


class NoCudaError(UserError):
    """The command needs CUDA GPUs and this machine has none."""


def require_cuda(command: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise NoCudaError(f"megatron-kd {command} needs CUDA GPUs and this machine has none "
                          f"(torch.cuda.is_available() is False): launch it on a GPU node with torchrun "
                          f"(launch/torchrun.sh); megatron-kd plan sizes a run on CPU")


def _raised_by_cuda(e: BaseException) -> bool:
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and f"torch{os.sep}cuda{os.sep}" in frames[-1].filename


def check_megatron_run(argv: list[str], command: str, args_defaults: dict | None = None) -> argparse.Namespace:
    """Everything ``megatron-kd train`` / ``cache build`` can check before distributed start-up,
    in order, each mistake one line: our flag check, --kd-cache (train: it exists; cache build: it
    is given), Megatron-LM's own validation (on a private
    copy, quietly: the run validates again and prints it), then that this machine has CUDA.
    Megatron-LM's validation asks the GPU for its architecture under tensor or context
    parallelism; without CUDA that query is where the no-CUDA line comes from."""
    import contextlib
    import io
    import warnings

    import torch
    from megatron.training.arguments import parse_args, validate_args

    argv = expand_optimizer_flags(argv)  # --kd-optimizer's Megatron-LM flags, for Megatron's validation too
    flags = check_megatron_flags(argv)
    if command == "cache build" and not flags.kd_cache:
        raise FlagError("cache build needs --kd-cache PATH: where to write the teacher cache")
    if command == "train" and flags.kd_cache and not os.path.isdir(flags.kd_cache):
        raise FlagError(f"--kd-cache {flags.kd_cache}: no such directory (build it with megatron-kd cache build)")
    saved_argv = sys.argv
    sys.argv = [sys.argv[0], *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_args(parse_args(extra_args_provider=add_kd_args), megatron_defaults(flags, args_defaults))
    except (AssertionError, ValueError) as e:
        raise FlagError(f"Megatron-LM rejected the arguments: {_validation_text(e)}") from None
    except RuntimeError as e:
        if torch.cuda.is_available() or not _raised_by_cuda(e):
            raise
        require_cuda(command)
    finally:
        sys.argv = saved_argv
    require_cuda(command)
    return flags


def _validation_text(e: Exception) -> str:
    """Megatron-LM's validation (asserts, ValueErrors): the message, else the failing check itself."""
    return " ".join(str(e).split()) or traceback.extract_tb(e.__traceback__)[-1].line


def parse_megatron_args(argv: list[str] | None, args_defaults: dict | None = None):
    """Megatron-LM's argument parsing (global args, tokenizer) with the --kd-* group added; shared
    by ``megatron-kd train``, ``cache build`` and ``export-hf``. Mistakes raise ``FlagError``."""
    from megatron.training.arguments import parse_and_validate_args

    from megatron_kd.megatron.compat import use_prebuilt_dataset_helpers

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    sys.argv = [sys.argv[0], *expand_optimizer_flags(sys.argv[1:])]  # what --kd-optimizer stands for
    flags = check_megatron_flags(sys.argv[1:])
    use_prebuilt_dataset_helpers()
    hf_dir = hf_tokenizer_dir(flags)
    try:
        args = parse_and_validate_args(extra_args_provider=add_kd_args, args_defaults=megatron_defaults(flags, args_defaults))
    except (AssertionError, ValueError) as e:
        raise FlagError(f"Megatron-LM rejected the arguments: {_validation_text(e)}") from None
    if args.eval_interval is None and args.train_iters is not None:
        # megatron-core 0.19 documents an unset --eval-interval as "no evaluation during training", but
        # sizes the validation split with train_iters // eval_interval (a TypeError in every command
        # that builds the datasets): that is one evaluation, at the end of training
        args.eval_interval = args.train_iters + 1
    hf_rows = hf_vocab_rows(hf_dir) if hf_dir else 0
    if args.padded_vocab_size < hf_rows:
        # the checkpoint's embedding has more rows than the tokenizer has tokens (GPT-OSS: 201,088 rows):
        # keep them all, padded as Megatron pads (a multiple of --make-vocab-size-divisible-by x TP)
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.padded_vocab_size = -(-hf_rows // multiple) * multiple
    return args


def main(argv: list[str] | None = None, step=None) -> None:
    """The run; ``step``: another ``forward_step_func`` over the same model, data and optimizer
    (benchmarks/online_kd.py's, which adds a teacher in the process), ``forward_step`` by default."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_kd.optim import multi_tensor
    from megatron_kd.optim.megatron import install

    args = parse_megatron_args(argv)
    require_cuda("train")  # before Megatron's initialization asserts it
    install(args.kd_optimizer, seed=args.seed)  # the optimizer megatron-core's construction builds
    multi_tensor.install()  # the gradient norm and clip without TE / Apex: foreach kernels, no host syncs
    if args.kd_fused_adam:
        from megatron_kd.megatron.optimizer import use_fused_torch_adamw

        use_fused_torch_adamw()
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
             step or forward_step, model_provider=partial(model_provider))


if __name__ == "__main__":
    main()
