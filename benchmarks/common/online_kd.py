"""Online KD, the baseline of ``bench_node.py --losses online``: the teacher's forward in the
student's process and dense KL on the full vocabulary. A benchmark path only, not part of the
product: megatron_kd distills from a teacher cache; this is what that replaces.

    torchrun --nproc-per-node 1 -m benchmarks.common.online_kd --online-teacher "<the teacher's model flags>" \\
        <megatron-kd train flags, no --kd-cache>

It runs what ``megatron-kd train`` runs (``megatron_kd.megatron.flags.parse_megatron_args``, then
``megatron_kd.megatron.run.pretrain``: the same parsing, student, data, optimizer and Megatron
schedule) with its forward step replaced. Per micro-batch:

1. the teacher's logits: a frozen megatron-core GPTModel in the student's ``params_dtype`` (bf16
   with ``--bf16``; eval mode, no grad) on the same tokens and positions; its weights are a Hugging
   Face directory's when the teacher's flags name one (``--kd-teacher-hf DIR``, imported as
   ``cache build`` imports it), else random (a throughput baseline);
2. the student's logits through Megatron's own output layer;
3. ``--kd-weight`` x KL(teacher || student) summed over the full vocabulary and the unmasked
   tokens, plus ``--kd-ce-weight`` x the student's cross-entropy, in fp32
   (``benchmarks.common.fidelity.kl_and_ce``, the fidelity benchmark's online reference); temperature 1.

The teacher is the student's arguments with every field the ``--online-teacher`` flags set
(``teacher_args``), e.g. examples/llama/8b.sh's sizes over the llama3.sh architecture both share.
It is built at the first micro-batch, so the peak Megatron logs includes its weights. Each rank
holds a whole teacher: one model-parallel rank (TP = PP = CP = 1), any data parallelism.
"""

from __future__ import annotations

import copy
import shlex
import sys

import torch

TEACHER_OPTION = "--online-teacher"
# the teacher runs forward only: nothing of it is recomputed
NO_RECOMPUTE = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the teacher's flags, the student's ``megatron-kd train`` flags)."""
    if len(argv) < 2 or argv[0] != TEACHER_OPTION:
        raise SystemExit(f"usage: -m benchmarks.common.online_kd {TEACHER_OPTION} \"<teacher model flags>\" "
                         "<megatron-kd train flags>")
    return shlex.split(argv[1]), argv[2:]


def teacher_args(student_args, teacher_flags: list[str]):
    """The student's (validated) arguments with every flag of ``teacher_flags`` that differs from
    Megatron-LM's default, and no recompute: the derived sizes (padded vocabulary, dtypes) stay
    the student's, as the cache's teacher shares the student's vocabulary."""
    from megatron_kd.megatron.flags import parse_flags

    given, default = parse_flags(teacher_flags, prog="online_kd"), parse_flags([], prog="online_kd")
    args = copy.copy(student_args)
    for name, value in vars(given).items():
        if value != getattr(default, name):
            setattr(args, name, value)
    for name, value in NO_RECOMPUTE.items():
        setattr(args, name, value)
    return args


def build_teacher(args) -> torch.nn.Module:
    """The teacher GPTModel of ``args`` (``teacher_args``), frozen: ``--kd-teacher-hf``'s weights, else
    random ones."""
    from megatron_kd.models.gpt import gpt_model_from_args
    from megatron_kd.models.hf import init_from_hf

    model = gpt_model_from_args(args)
    if torch.cuda.is_available():  # as Megatron's get_model: megatron-core builds the norms on the host
        model.cuda(torch.cuda.current_device())
    if args.kd_teacher_hf:
        init_from_hf(model, args.kd_teacher_hf, args)
    return model.requires_grad_(False).eval()


class OnlineKDForwardStep:
    """Megatron ``forward_step_func``: batch -> teacher logits (no grad) -> student logits -> loss.
    Returns what ``megatron_kd.megatron.loss.loss_func`` reads: (loss sum, [kd, ce, teacher mass,
    tokens]); the teacher's mass over the full vocabulary is 1 per token."""

    def __init__(self, teacher: torch.nn.Module, config, *, packing=None, device=None):
        from megatron_kd.megatron.packing import DocumentPacking

        self.teacher, self.config = teacher, config
        self.packing = packing or DocumentPacking()
        self.device = device

    def __call__(self, data_iterator, model):
        from functools import partial

        from benchmarks.common.fidelity import kl_and_ce
        from megatron_kd.megatron.kd_data import get_kd_batch
        from megatron_kd.megatron.loss import loss_func

        batch, packed = self.packing.apply(get_kd_batch(data_iterator, device=self.device))
        with torch.no_grad():
            teacher_logits = self.teacher(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed)
        logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed)
        mask = batch["loss_mask"].float()
        kl, ce = kl_and_ce(logits, teacher_logits, batch["labels"], mask)
        tokens = mask.sum()
        loss = self.config.weight * kl + self.config.ce_weight * ce
        # the report's layout (megatron/loss.py): the full distribution is the teacher's support, mass 1
        entries = tokens * teacher_logits.shape[-1]
        return (loss, torch.stack([kl.detach(), ce.detach(), tokens, tokens, entries])), partial(loss_func)


def megatron_step(teacher_flags: list[str]):
    """The forward step ``megatron_kd.megatron.run.pretrain`` runs: it builds the teacher and the
    step from Megatron's arguments at the first micro-batch (after Megatron's initialization)."""
    step = None

    def forward_step(data_iterator, model):
        nonlocal step
        if step is None:
            from megatron.core import parallel_state
            from megatron.training import get_args, get_tokenizer

            from megatron_kd.megatron.args import KDConfig
            from megatron_kd.megatron.packing import DocumentPacking

            args = get_args()
            sizes = {"TP": args.tensor_model_parallel_size, "PP": args.pipeline_model_parallel_size,
                     "CP": args.context_parallel_size}
            if any(v != 1 for v in sizes.values()):
                raise SystemExit(f"online_kd: one model-parallel rank only (TP = PP = CP = 1), got {sizes}")
            teacher = build_teacher(teacher_args(args, teacher_flags))
            parameters = sum(p.numel() for p in teacher.parameters())
            if parallel_state.get_data_parallel_rank() == 0:
                print(f"> online teacher: {parameters / 1e9:.2f} B parameters, {args.params_dtype}", flush=True)
            step = OnlineKDForwardStep(teacher, KDConfig.from_args(args),
                                       packing=DocumentPacking.from_args(args, eod=get_tokenizer().eod))
        return step(data_iterator, model)

    return forward_step


def main(argv: list[str] | None = None) -> None:
    from megatron_kd import console

    teacher_flags, student_flags = split_argv(sys.argv[1:] if argv is None else argv)
    console.setup(False)
    from megatron_kd.megatron.flags import parse_flags, parse_megatron_args, require_cuda
    from megatron_kd.megatron.run import pretrain

    parse_flags(teacher_flags, prog="online_kd")  # a mistake in the teacher's flags stops here, not at the first step

    args = parse_megatron_args(student_flags)
    require_cuda("train")  # before Megatron's initialization asserts it
    pretrain(args, step=megatron_step(teacher_flags))


if __name__ == "__main__":
    main()
