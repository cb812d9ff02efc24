"""``python -m megatron_kd.bridge``: a Bridge recipe distilled from a teacher cache, and the
Megatron-LM data flags ``megatron-kd cache build`` takes for it.

    torchrun --nproc-per-node 8 -m megatron_kd.bridge pretrain examples/bridge/recipes.py:gpt_oss_20b \\
        --kd-cache /data/cache --kd-ce-weight 0.1
    python -m megatron_kd.bridge data-flags examples/bridge/recipes.py:gpt_oss_20b

``RECIPE`` is ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``: a function that returns a Bridge
``ConfigContainer`` (a Bridge recipe with the run's data set: ``examples/bridge/``). ``pretrain`` and
``finetune`` give it the ``kd`` block of the ``--kd-*`` flags (``KDConfig``: ``megatron-kd train``'s)
and run Bridge's function of that name with the KD forward step (``step.py``); ``--local-spec`` builds
the student on megatron_kd's local spec (``model.py``). ``data-flags`` prints the recipe's data as
Megatron-LM flags (``flags.py``), shell-quoted on one line.

Every mistake is one line on stderr and exit status 2: the flags, a missing or unsupported
megatron-bridge (before Bridge is imported), the recipe's name, a config the cache cannot serve, and
a cache that lacks the run's samples (when training starts, as ``megatron-kd train`` finds it). Bridge
logs a failed run with its traceback; for those mistakes that record is dropped, the line says it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import shlex
import sys
from pathlib import Path

from megatron_kd.errors import FlagError, FlagParser, UserError

PROG = "python -m megatron_kd.bridge"
COMMANDS = {
    "pretrain": "Run Bridge's pretrain on RECIPE with the kd block of the --kd-* flags and the KD forward step.",
    "finetune": "Run Bridge's finetune (from cfg.checkpoint.pretrained_checkpoint) likewise.",
    "data-flags": "Print RECIPE's data, tokenizer and sample count as Megatron-LM flags (for megatron-kd cache "
                  "build).",
}


def build_parser() -> argparse.ArgumentParser:
    from megatron_kd.megatron.args import PREFIX, KDConfig
    from megatron_kd.options import add_option_group

    parser = FlagParser(prog=PROG, description="Offline KD inside Megatron-Bridge recipes.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("recipe", metavar="RECIPE", help="FILE.py:FUNCTION or MODULE:FUNCTION returning Bridge's "
                                                          "ConfigContainer.")
        if name != "data-flags":
            sub.add_argument("--local-spec", action="store_true",
                             help="Build the student on megatron_kd's local spec (megatron-core's local layers with "
                                  "megatron_kd's attention and experts) instead of the recipe's layer spec.")
            add_option_group(sub, KDConfig, prefix=PREFIX)
    return parser


def load_recipe(spec: str):
    """The ConfigContainer ``spec`` (``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``) returns."""
    from megatron_kd.bridge.compat import BridgeError, import_bridge_module

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise FlagError(f"RECIPE must be FILE.py:FUNCTION or MODULE:FUNCTION, got {spec!r}")
    config = import_bridge_module("megatron.bridge.training.config")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise FlagError(f"RECIPE {spec}: no such file {where}")
        module_spec = importlib.util.spec_from_file_location(f"_megatron_kd_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise FlagError(f"RECIPE {spec}: no module {e.name!r}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise FlagError(f"RECIPE {spec}: {where} has no function {name!r}")
    cfg = function()
    if not isinstance(cfg, config.ConfigContainer):
        raise BridgeError(f"RECIPE {spec} returned a {type(cfg).__name__}, expected Bridge's ConfigContainer")
    return cfg


class _DropOurFailures(logging.Filter):
    """Drops Bridge's "Pretrain failed" record (its traceback) for a mistake the CLI says in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from megatron_kd.cache import CacheError

        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, (UserError, CacheError))


def _run(args) -> int:
    from megatron_kd.bridge.compat import import_bridge_module, require_bridge
    from megatron_kd.megatron.args import PREFIX, KDConfig
    from megatron_kd.options import from_args

    require_bridge()
    kd = None if args.command == "data-flags" else from_args(KDConfig, args, prefix=PREFIX)  # its checks run here
    cfg = load_recipe(args.recipe)
    if args.command == "data-flags":
        flags = import_bridge_module("megatron_kd.bridge.flags")
        print(shlex.join(flags.megatron_data_flags(cfg)), flush=True)
        return 0
    config = import_bridge_module("megatron_kd.bridge.config")
    step = import_bridge_module("megatron_kd.bridge.step")
    cfg = config.with_kd(cfg, kd)
    if args.local_spec:
        import_bridge_module("megatron_kd.bridge.model").use_local_spec(cfg.model)
    logging.getLogger("megatron.bridge.training.pretrain").addFilter(_DropOurFailures())
    getattr(step, args.command)(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    from megatron_kd import console
    from megatron_kd.cache import CacheError

    argv = sys.argv[1:] if argv is None else list(argv)
    console.filter_third_party_notices()
    try:
        return _run(build_parser().parse_args(argv))
    except (CacheError, UserError) as e:
        where = "" if console.rank() == 0 else f" (rank {console.rank()})"
        print(f"{PROG}: error{where}: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        return 2
