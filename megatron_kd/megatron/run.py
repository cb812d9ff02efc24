"""What a Megatron-LM GPT run of ours is built from: megatron.training.pretrain's hooks, shared by
``megatron-kd train`` (``commands/train.py``), the teacher pass (``teacher/build.py``), pruning
(``prune/run.py``) and ``export-hf``.

- ``model_provider``: the student (or teacher) GPTModel from the flags (TE layer spec when
  transformer-engine is importable, local spec with SDPA attention otherwise), ``--kd-student-hf``
  weights unless resuming;
- ``build_datasets`` / ``datasets_provider``: megatron-core GPTDataset splits as Megatron-LM builds
  them (the teacher pass uses the same code, so sample indices agree); the training split joined to
  the cache and checked against it;
- ``forward_step``: ``KDForwardStep`` (teacher tensors broadcast over TP, split for CP, fused loss
  through GPTModel's output_processor), logging tokens/s. Validation batches carry no teacher: they
  report the student's cross-entropy.

Every hook reads Megatron-LM's global arguments (``megatron.training.get_args``), set by
``flags.MegatronRun.megatron_args`` or ``flags.parse_megatron_args``.
"""

from __future__ import annotations

import os

from megatron_kd.megatron.args import KDConfig
from megatron_kd.megatron.data import repair_index_cache
from megatron_kd.megatron.kd_data import KDDataset
from megatron_kd.megatron.loss import KDForwardStep
from megatron_kd.megatron.loss_mask import with_loss_masks
from megatron_kd.megatron.packing import DocumentPacking
from megatron_kd.models.experts import quantize_experts
from megatron_kd.models.gpt import gpt_model_from_args
from megatron_kd.models.hf import init_from_hf


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
    if args.kd_quant:
        quantize_experts(model, args.kd_quant)
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
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    tokenizer = get_tokenizer()
    config = gpt_dataset_config(args, tokenizer)
    repair_index_cache(config)
    # --mock-data (no --data-path): synthetic samples, as pretrain_gpt builds them
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_built_on_rank, config)
    return [with_loss_masks(split) for split in builder.build()], tokenizer


def run_sizes(args) -> list[int]:
    """The run's (train, valid, test) sample counts as Megatron-LM's ``pretrain`` sizes them, for
    commands that build the datasets without it (cache build, prune): a sample-based run
    (``--train-samples``) gets its iterations first (``update_train_iters``, after
    ``initialize_megatron``: a step schedule needs the batch-size calculator)."""
    from megatron.training.training import get_train_valid_test_num_samples, update_train_iters

    update_train_iters(args)
    return list(get_train_valid_test_num_samples())


def consumed_train_samples(args) -> int:
    """Training samples the run consumes, as Megatron-LM's loop counts them: per iteration the
    global batch size of that iteration. A batch-size schedule (``--step-batch-size-schedule``;
    megatron-core 0.19 keeps ``--rampup-batch-size`` only as a flag it ignores) makes it less than
    iterations x the final batch; a sample-based run consumes its ``--train-samples`` (or, under a
    schedule, up to the end of the batch that reaches them). Needs ``initialize_megatron`` (its
    batch-size calculator) where the batch size changes."""
    if getattr(args, "step_batch_size_schedule", None) is None:
        return args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, update_num_microbatches

    consumed, iteration = 0, 0
    while (iteration < args.train_iters) if args.train_iters else (consumed < args.train_samples):
        update_num_microbatches(consumed, consistency_check=False)
        consumed += get_current_global_batch_size()
        iteration += 1
    update_num_microbatches(0, consistency_check=False)  # as Megatron-LM's update_train_iters leaves it
    return max(consumed, args.train_samples or 0)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.training import get_args, print_rank_0

    args = get_args()
    (train, valid, test), tokenizer = build_datasets(train_val_test_num_samples)
    if args.kd_cache and train is not None:
        train = KDDataset(train, args.kd_cache, tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                          required_samples=consumed_train_samples(args),
                          packing=DocumentPacking.from_args(args, eod=tokenizer.eod).mode)
        print_rank_0(f"> distilling from {args.kd_cache}: K={train.meta.topk}, mode={train.meta.mode}, "
                     f"{train.meta.num_samples} samples; the run's {len(train.rows)} found by their tokens in "
                     f"{train.match_seconds:.1f} s ({train.relocated} at another index than their own)")
        if train.meta.mode == "sampled":
            print_rank_0("> teacher mass is 1 for a sampled cache (its draws' frequencies sum to 1); teacher "
                         "entries, the distinct tokens drawn per position, say how spread the teacher is")
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


def pretrain(args, step=None) -> None:
    """megatron.training's ``pretrain`` over our hooks, with the optimizer ``--kd-optimizer`` /
    ``--kd-fused-adam`` choose; ``step``: another ``forward_step_func`` over the same model, data and
    optimizer (benchmarks/common/online_kd.py's, which adds a teacher in the process), ``forward_step`` by
    default. ``args``: Megatron-LM's global arguments."""
    from functools import partial

    from megatron.core.enums import ModelType
    from megatron.training import pretrain as megatron_pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_kd.console import show_last_rank_log
    from megatron_kd.optim import multi_tensor
    from megatron_kd.optim.megatron import install

    show_last_rank_log()  # the training log: printed on the last rank, which the console quiets
    install(args.kd_optimizer, seed=args.seed)  # the optimizer megatron-core's construction builds
    multi_tensor.install()  # the gradient norm and clip without TE / Apex: foreach kernels, no host syncs
    if args.kd_fused_adam:
        from megatron_kd.megatron.optimizer import use_fused_torch_adamw

        use_fused_torch_adamw()
    megatron_pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                      step or forward_step, model_provider=partial(model_provider))
