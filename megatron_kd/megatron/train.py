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

import sys
from functools import partial

import torch

from megatron_kd.megatron.args import KDConfig, add_kd_args
from megatron_kd.megatron.kd_data import KDDataset
from megatron_kd.megatron.loss import KDForwardStep
from megatron_kd.megatron.model import build_gpt_model


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return build_gpt_model(
        config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )


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
    this too, so sample indices agree)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    tokenizer = get_tokenizer()
    builder = BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, is_built_on_rank,
                                            gpt_dataset_config(args, tokenizer))
    return builder.build(), tokenizer


def consumed_train_samples(args) -> int:
    return args.train_samples if args.train_samples else args.train_iters * args.global_batch_size


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.training import get_args, print_rank_0

    args = get_args()
    (train, valid, test), tokenizer = build_datasets(train_val_test_num_samples)
    if args.kd_cache and train is not None:
        train = KDDataset(train, args.kd_cache, tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                          required_samples=consumed_train_samples(args))
        print_rank_0(f"> distilling from {args.kd_cache}: K={train.meta.topk}, mode={train.meta.mode}, "
                     f"{train.meta.num_samples} samples")
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
        from megatron.training import get_args

        args = get_args()
        _FORWARD = _LoggedForwardStep(
            KDConfig.from_args(args), tp_group=parallel_state.get_tensor_model_parallel_group(),
            cp_group=parallel_state.get_context_parallel_group() if args.context_parallel_size > 1 else None,
            is_last_stage=parallel_state.is_pipeline_last_stage,
            is_first_stage=parallel_state.is_pipeline_first_stage,
        )
    return _FORWARD


def parse_megatron_args(argv: list[str] | None, args_defaults: dict | None = None):
    """Megatron-LM's argument parsing (global args, tokenizer) with the --kd-* group added; shared
    by ``megatron-kd train`` and ``megatron-kd cache build``."""
    from megatron.training.arguments import parse_and_validate_args

    from megatron_kd.megatron.compat import use_prebuilt_dataset_helpers

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    use_prebuilt_dataset_helpers()
    args = parse_and_validate_args(extra_args_provider=add_kd_args, args_defaults=args_defaults or {})
    KDConfig.from_args(args)  # validate --kd-* before any GPU work
    return args


def main(argv: list[str] | None = None) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    args = parse_megatron_args(argv)
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=partial(model_provider))


if __name__ == "__main__":
    main()
