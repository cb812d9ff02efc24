"""Megatron-LM's command line for our commands: parsed, checked before any work, validated once.

``train``, ``cache build``, ``prune`` and ``export-hf`` take every Megatron-LM flag plus the
``--kd-*`` group (``args.add_kd_args``). ``check_megatron_run`` checks everything it can before
distributed start-up, in order, each mistake one line (a ``UserError``):

1. our flag check (``check_megatron_flags``): unknown flags, bad values, the flags Megatron-LM's
   validation asserts on without a message, every ``--kd-*`` rule, the document-packing flags, the
   flags that need Transformer Engine or Apex where they are missing, and the Hugging Face
   directories (``hf_check``);
2. what the command itself needs (its ``needs``: ``--kd-cache``, ``--kd-teacher-hf``, ``--load``);
3. Megatron-LM's own ``validate_args``, its output held back;
4. that the machine has CUDA (``require_cuda``); Megatron-LM's validation asks the GPU for its
   architecture under tensor or context parallelism, and that query failing without CUDA gives the
   same line.

The run starts from what the check validated (``MegatronRun.megatron_args``): Megatron-LM's
validation runs once per command, and what it printed is printed when the run starts, where
``parse_and_validate_args`` would have printed it. ``parse_megatron_args`` parses, checks and
validates in one step, for code that has no check of its own (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from megatron_kd.errors import FlagError, FlagParser, UserError
from megatron_kd.megatron.args import add_kd_args, check_kd_flags, refuse_renamed_flags
from megatron_kd.megatron.hf_check import check_hf_dir
from megatron_kd.megatron.packing import check_packing_flags
from megatron_kd.optim.megatron import expand_optimizer_flags

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


# flags of Megatron-LM's own scripts that megatron-core's parser lacks, and what stands for them here
FOREIGN_FLAGS = {
    "--enable-gpt-oss": "--enable-gpt-oss is Megatron-LM's post-training flag: here GPT-OSS is its model flags "
                        "(examples/gpt_oss/gpt_oss.sh) or a GPT-OSS directory given to --kd-student-hf / --kd-teacher-hf",
    "--export-force-local-attention": "--export-force-local-attention is Megatron-LM's export flag: here "
                                      "megatron-kd export-hf writes the Hugging Face directory; drop it",
}


def parse_flags(argv: list[str], prog: str = "megatron-kd") -> argparse.Namespace:
    """Megatron-LM's and our flags parsed (not validated); an unknown flag or a bad value is one
    ``FlagError``."""
    try:
        known, unknown = megatron_parser(prog).parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise FlagError(str(e)) from None
    if unknown:
        refuse_renamed_flags(unknown)
        hints = [FOREIGN_FLAGS[flag.split("=", 1)[0]] for flag in unknown if flag.split("=", 1)[0] in FOREIGN_FLAGS]
        raise FlagError(f"unrecognized arguments: {' '.join(unknown)} (" + "; ".join(
            [*hints, "--help lists the --kd-* flags, --help-megatron all of Megatron-LM's"]) + ")")
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
    check_transformer_engine_flags(known)
    check_apex_flags(known)
    check_quant_flags(known)
    tokenizer_dir = hf_tokenizer_dir(known) if known.tokenizer_model is None else None
    for flag, path in (("--kd-student-hf", known.kd_student_hf), ("--kd-teacher-hf", known.kd_teacher_hf)):
        if path:
            check_hf_dir(path, flag, tokenizer=path == tokenizer_dir and _reads_tokenizer_model(known.tokenizer_type))
    return known


# Megatron-LM flags only Transformer Engine's layers implement (dest -> flag): on the local spec
# megatron-core fails on them at model build (layernorm 1p, permute fusion) or trains in bf16
# without a word (FP8 / FP4)
TRANSFORMER_ENGINE_FLAGS = {"layernorm_zero_centered_gamma": "--apply-layernorm-1p",
                            "moe_permute_fusion": "--moe-permute-fusion", "fp8": "--fp8-format",
                            "fp4": "--fp4-format"}


def check_transformer_engine_flags(flags: argparse.Namespace) -> None:
    """One line for a flag that needs Transformer Engine in a run that builds the local spec
    (``--transformer-impl local``, or Transformer Engine not installed)."""
    from megatron_kd.models.gpt import have_transformer_engine

    local = flags.transformer_impl == "local" or not have_transformer_engine()
    given = [flag for dest, flag in TRANSFORMER_ENGINE_FLAGS.items() if getattr(flags, dest, None)]
    if local and given:
        why = "--transformer-impl local" if flags.transformer_impl == "local" else "Transformer Engine is not installed"
        raise FlagError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} Transformer Engine's layers and this "
                        f"run builds megatron-core's local spec ({why}): drop the flag, or run with Transformer "
                        f"Engine (the NGC image)")


def check_quant_flags(flags: argparse.Namespace) -> None:
    """``--kd-quant`` fake-quantizes megatron_kd's grouped experts: one line where a run has none
    (a dense model, the TE spec's experts) or where they would take the sequential loop."""
    from megatron_kd.models.gpt import have_transformer_engine

    if flags.kd_quant is None:
        return
    where = f"--kd-quant {flags.kd_quant} fake-quantizes megatron_kd's grouped MoE experts"
    if not flags.num_experts:
        raise FlagError(f"{where}, and this model has none (no --num-experts)")
    if flags.transformer_impl != "local" and have_transformer_engine():
        raise FlagError(f"{where} (the local spec), and this run builds Transformer Engine's: add "
                        f"--transformer-impl local")
    given = [flag for dest, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")) if getattr(flags, dest, None)]
    if given or (flags.expert_tensor_parallel_size or 1) != 1 or flags.moe_apply_probs_on_input:
        why = ", ".join(given) or ("--moe-apply-probs-on-input" if flags.moe_apply_probs_on_input
                                   else "--expert-tensor-parallel-size above 1")
        raise FlagError(f"{where}, which {why} sends down megatron-core's sequential loop")


def check_apex_flags(flags: argparse.Namespace) -> None:
    """One line where megatron-core would stop at model build with a traceback: its gradient
    accumulation fusion (on by default) needs Apex's ``fused_weight_gradient_mlp_cuda`` in every
    ColumnParallelLinear, on either spec (the TE spec's output layer is one)."""
    import importlib.util

    if flags.gradient_accumulation_fusion and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        raise FlagError("gradient accumulation fusion (on by default) needs Apex's fused_weight_gradient_mlp_cuda "
                        "extension, which is not installed: add --no-gradient-accumulation-fusion")


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


def _validation_text(e: Exception) -> str:
    """Megatron-LM's validation (asserts, ValueErrors): the message, else the failing check itself."""
    return " ".join(str(e).split()) or traceback.extract_tb(e.__traceback__)[-1].line


@dataclass
class MegatronRun:
    """A command line that passed ``check_megatron_run``: what the run starts from."""

    argv: list[str]
    """The command line, with the Megatron-LM flags ``--kd-optimizer`` stands for."""
    flags: argparse.Namespace
    """Our parse of it (not validated): the ``--kd-*`` flags, ``--transformer-impl``, the sizes."""
    args_defaults: dict
    """The command's defaults for Megatron-LM's arguments (``--no-load-optim`` for a teacher)."""
    args: argparse.Namespace
    """Megatron-LM's arguments, validated."""
    printed: str
    """What the validation printed (rank 0: the arguments, the derived sizes)."""
    warned: list
    """The warnings it gave (``warnings.WarningMessage``), past the filters in force."""

    def megatron_args(self) -> argparse.Namespace:
        """Megatron-LM's global arguments and tokenizer for the run, from the validated arguments:
        what the validation printed and warned is shown now, where the run's own validation would
        have shown it. ``--use-checkpoint-args`` and ``--yaml-cfg`` make Megatron-LM take arguments
        from elsewhere (a checkpoint, a YAML file) before it validates: those runs parse and validate
        again, as ``parse_megatron_args``."""
        import warnings

        from megatron.training.global_vars import set_global_variables

        from megatron_kd.megatron.compat import use_prebuilt_dataset_helpers

        if self.args.use_checkpoint_args or self.args_defaults.get("use_checkpoint_args") or self.args.yaml_cfg:
            return parse_megatron_args(self.argv, self.args_defaults)
        sys.argv = [sys.argv[0], *self.argv]
        sys.stdout.write(self.printed)
        sys.stdout.flush()
        for w in self.warned:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
        use_prebuilt_dataset_helpers()
        set_global_variables(self.args)
        return _complete(self.args, self.flags)


def check_megatron_run(argv: list[str], command: str, args_defaults: dict | None = None,
                       needs: Callable[[argparse.Namespace], None] | None = None) -> MegatronRun:
    """Everything ``megatron-kd <command>`` can check before distributed start-up, in the order of
    the module's docstring, each mistake one line; ``needs(flags)`` raises the command's own
    (``--kd-cache`` for ``train``). Megatron-LM's validation runs on the run's own arguments and
    defaults, quietly: ``MegatronRun.megatron_args`` shows its output when the run starts."""
    import contextlib
    import io
    import warnings

    import torch
    from megatron.training.arguments import parse_args, validate_args

    argv = expand_optimizer_flags(argv)  # --kd-optimizer's Megatron-LM flags, for Megatron's validation too
    flags = check_megatron_flags(argv)
    if needs is not None:
        needs(flags)
    args_defaults = dict(args_defaults or {})
    saved_argv, printed = sys.argv, io.StringIO()
    sys.argv = [sys.argv[0], *argv]
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True) as warned:
            args = validate_args(parse_args(extra_args_provider=add_kd_args), megatron_defaults(flags, args_defaults))
    except (AssertionError, ValueError) as e:
        raise FlagError(f"Megatron-LM rejected the arguments: {_validation_text(e)}") from None
    except RuntimeError as e:
        if torch.cuda.is_available() or not _raised_by_cuda(e):
            raise
        args = None  # the validation's query of the GPU: no CUDA, said next
    finally:
        sys.argv = saved_argv
    require_cuda(command)
    return MegatronRun(argv, flags, args_defaults, args, printed.getvalue(), warned)


def parse_megatron_args(argv: list[str] | None, args_defaults: dict | None = None):
    """Megatron-LM's argument parsing (global args, tokenizer) with the --kd-* group added, checked
    as ``check_megatron_flags`` checks; for code without a check of its own (the commands start from
    ``check_megatron_run``). Mistakes raise ``FlagError``."""
    from megatron.training.arguments import parse_and_validate_args

    from megatron_kd.megatron.compat import use_prebuilt_dataset_helpers

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    sys.argv = [sys.argv[0], *expand_optimizer_flags(sys.argv[1:])]  # what --kd-optimizer stands for
    flags = check_megatron_flags(sys.argv[1:])
    use_prebuilt_dataset_helpers()
    try:
        args = parse_and_validate_args(extra_args_provider=add_kd_args, args_defaults=megatron_defaults(flags, args_defaults))
    except (AssertionError, ValueError) as e:
        raise FlagError(f"Megatron-LM rejected the arguments: {_validation_text(e)}") from None
    return _complete(args, flags)


def _complete(args: argparse.Namespace, flags: argparse.Namespace) -> argparse.Namespace:
    """What every run adds to Megatron-LM's global arguments once they are set (the tokenizer built)."""
    from megatron_kd.models.hf import hf_vocab_rows

    if args.eval_interval is None:
        # megatron-core 0.19 documents an unset --eval-interval as "no evaluation during training", but
        # sizes the validation split with train_iters // eval_interval (a TypeError in every command
        # that builds the datasets): that is one evaluation, at the end of training. A sample-based
        # run (--train-samples) has its iterations only later; it runs at most one per sample.
        args.eval_interval = (args.train_iters or args.train_samples) + 1
    hf_dir = hf_tokenizer_dir(flags)
    hf_rows = hf_vocab_rows(hf_dir) if hf_dir else 0
    if args.padded_vocab_size < hf_rows:
        # the checkpoint's embedding has more rows than the tokenizer has tokens (GPT-OSS: 201,088 rows):
        # keep them all, padded as Megatron pads (a multiple of --make-vocab-size-divisible-by x TP)
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.padded_vocab_size = -(-hf_rows // multiple) * multiple
    return args
