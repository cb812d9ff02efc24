"""What ``megatron-kd`` prints besides its answer: known third-party notices filtered, rank 0 speaks.

Importing megatron-core, nvidia-modelopt and torch's extension helpers prints a dozen notices on a
machine without Transformer Engine or Apex ("... not installed. Falling back to ..." once per
module, megatron's own SyntaxWarnings, ModelOpt's transformers-version notice, "GPTModel IS
DEPRECATED" per model built). They say nothing the user can act on, so the CLI entry filters
exactly those: each entry of ``KNOWN_WARNINGS`` is a warnings filter scoped by category, message
and the module that warns, each of ``KNOWN_LOG_RECORDS`` a logging filter on one third-party logger
and one message. Everything else, the user's own warnings included, passes. In their place the
commands that build a model print one line saying which code path runs (``code_path_line``).

Under torchrun every rank runs the CLI: ranks other than 0 (env ``RANK``) send their stdout to
/dev/null, so Megatron's per-rank logging (it logs to stdout) and prints appear once; stderr stays,
for errors.

``--verbose`` (before the command) or ``MEGATRON_KD_VERBOSE=1`` turns all of this off.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

VERBOSE_ENV = "MEGATRON_KD_VERBOSE"

# (category, message regex, module regex): matched as warnings.filterwarnings does (re.match, so
# from the start). SyntaxWarnings are raised while compiling, with the file's path as the module.
KNOWN_WARNINGS = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed", r"megatron\."),
    (UserWarning, r"Only transformer-engine>=\S+ supports MoE experts", r"megatron\."),
    (UserWarning, r"Could not determine (rank|world size) from torch\.distributed", r"megatron\."),
    (UserWarning, r"\s*It is recommended to use a ModelConfig", r"megatron\.training"),
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer"),
    (UserWarning, r"transformers \S+ is not tested with current version of modelopt", r"modelopt\."),
    (SyntaxWarning, r"invalid escape sequence", r".*[\\/](megatron|modelopt|torchao)[\\/]"),
)

# logger name -> message regex (re.match on the formatted message)
KNOWN_LOG_RECORDS = {
    "megatron.core.models.gpt.gpt_model": r"GPTModel IS DEPRECATED",
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
}


def is_verbose(flag: bool = False) -> bool:
    return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def rank() -> int:
    """This process's global rank under torchrun (0 outside it)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def filter_third_party_notices() -> None:
    """Install the filters above (idempotent); call before megatron / modelopt are imported."""
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, message in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern.pattern == message for f in logger.filters):
            logger.addFilter(_DropMessage(message))


_KEPT_STDOUT = None  # the stdout a quieted rank had: where its training log still goes


def quiet_other_ranks() -> None:
    """Ranks other than 0: stdout (the file descriptor, so C-level output too) to /dev/null, its
    former target kept for ``print_kept``."""
    global _KEPT_STDOUT
    if rank() == 0:
        return
    sys.stdout.flush()
    _KEPT_STDOUT = os.fdopen(os.dup(1), "w", buffering=1, closefd=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def print_kept(message: str) -> None:
    """A line this rank prints for the user even when quieted: Megatron-LM prints the training and
    validation log (lm loss, kd loss, teacher mass, throughput) on the last rank, which the last
    pipeline stage's losses live on, so that rank's log lines pass the quiet."""
    print(message, file=_KEPT_STDOUT or sys.stdout, flush=True)


def show_last_rank_log() -> None:
    """Megatron-LM's ``print_rank_last`` through ``print_kept``: on a quieted last rank its log
    lines would go to /dev/null (any world size > 1)."""
    import torch.distributed as dist
    from megatron.training import training, utils
    from megatron.training.utils import common_utils

    def print_rank_last(message):
        if not dist.is_initialized() or common_utils.is_last_rank():
            print_kept(message)

    for module in (training, utils, common_utils):
        module.print_rank_last = print_rank_last


def setup(verbose: bool) -> None:
    """The CLI entry's console: quiet unless verbose."""
    if is_verbose(verbose):
        return
    filter_third_party_notices()
    quiet_other_ranks()


def say(line: str) -> None:
    """One status line on stderr, from rank 0 only."""
    if rank() == 0:
        print(line, file=sys.stderr, flush=True)


def code_path_line(transformer_impl: str, *, planned: bool = False) -> str:
    """Which layer implementation a run with ``--transformer-impl`` uses here (``planned``: the
    one ``plan`` sizes, for the machine the run will have, whatever is installed here)."""
    from megatron_kd.models.gpt import have_transformer_engine

    local = "megatron-core local spec with megatron_kd attention and experts"
    if transformer_impl == "local":
        return f"megatron_kd: --transformer-impl local: {local}"
    if planned and not have_transformer_engine():
        # plan sizes the GPU machine's run, and the NGC image there has Transformer Engine
        return ("megatron_kd: plan sizes the Transformer Engine spec (--transformer-impl transformer_engine), what "
                "a machine with Transformer Engine builds; this one has none and would build the local spec "
                "(--transformer-impl local sizes that)")
    if have_transformer_engine():
        return "megatron_kd: Transformer Engine spec"
    return f"megatron_kd: no Transformer Engine: {local}"
