"""The pruning pass on GPUs (``megatron-kd prune``, ``commands/prune.py``): a Hugging Face teacher
built as ``cache build`` builds it (the same model flags, layout and data flags, so one ``cache
build`` serves every pruned candidate), run over the first training samples with the importance
hooks of ``importance.py``; the parts the targets keep are chosen by those scores (``cuts.py``) and
rank 0 writes the student as a Hugging Face directory of the teacher's own tensors, cut
(``hf_checkpoint.py``).
"""

from __future__ import annotations

from megatron_kd.prune.cuts import KeptParts, PruneTargets, choose_kept
from megatron_kd.prune.hf_checkpoint import write_pruned_hf
from megatron_kd.prune.importance import calibrate


def layer_group_size(args) -> int:
    """Layers dropped together: GPT-OSS's window / full-attention pairs (``--window-attn-skip-freq 2``)."""
    freq = getattr(args, "window_attn_skip_freq", None)
    return freq if isinstance(freq, int) and args.window_size is not None else 1


def teacher_sizes(args) -> dict:
    """The teacher's sizes that ``check_targets`` / ``choose_kept`` cut, from Megatron-LM's validated
    arguments."""
    return dict(num_layers=args.num_layers, num_experts=args.num_experts, experts_per_token=args.moe_router_topk,
                # every layer of an MoE teacher is MoE: no dense MLP width to cut
                ffn_hidden_size=None if args.num_experts else args.ffn_hidden_size,
                num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups if args.group_query_attention else None,
                moe_ffn_hidden_size=(args.moe_ffn_hidden_size or args.ffn_hidden_size) if args.num_experts else None,
                hidden_size=args.hidden_size,
                # the student's head dim is written out (head_dim, --kv-channels), never derived
                tensor_parallel_size=args.tensor_model_parallel_size, head_dim_derived=False)


def prune_hf_teacher(args, targets: PruneTargets, *, calib_samples: int, out: str) -> tuple[KeptParts, int]:
    """Starts Megatron, scores the ``--kd-teacher-hf`` teacher over ``calib_samples`` training samples
    (split over data parallelism), and writes the student the targets keep to ``out`` (rank 0).
    Returns the parts kept and the calibration tokens. ``args``: Megatron-LM's global arguments."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    from megatron_kd.megatron.packing import DocumentPacking
    from megatron_kd.megatron.run import build_datasets, model_provider, run_sizes
    from megatron_kd.models.hf import init_from_hf
    from megatron_kd.teacher.sources import MegatronTeacher

    initialize_megatron()
    (train, _, _), tokenizer = build_datasets(run_sizes(args), is_built_on_rank=lambda *a, **k: True)
    model = get_model(model_provider, wrap_with_ddp=False)
    init_from_hf(unwrap_model(model[0]), args.kd_teacher_hf, args)
    teacher = MegatronTeacher(model[0].eval(), tp_group=parallel_state.get_tensor_model_parallel_group(),
                              sequence_parallel=args.sequence_parallel,
                              packing=DocumentPacking.from_args(args, eod=tokenizer.eod))
    scores = calibrate(teacher, train, num_samples=min(calib_samples, len(train)),
                       micro_batch_size=args.micro_batch_size, group_size=layer_group_size(args),
                       dp_rank=parallel_state.get_data_parallel_rank(),
                       dp_size=parallel_state.get_data_parallel_world_size(),
                       dp_group=parallel_state.get_data_parallel_group())
    kept = choose_kept(scores, targets, **teacher_sizes(args))
    if _torch_rank() == 0:
        write_pruned_hf(args.kd_teacher_hf, out, kept)
    return kept, scores.tokens


def _torch_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
