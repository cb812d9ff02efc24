"""Compatibility with the megatron-core wheel (opt-in, idempotent, logged).

The PyPI wheel of megatron-core ships the dataset index helpers prebuilt (``helpers_cpp``) but not
their Makefile, while ``megatron.training.initialize`` always runs ``make`` on rank 0 and exits when
it fails. ``use_prebuilt_dataset_helpers`` makes that step a no-op whenever the prebuilt module
imports (a source checkout, which has the Makefile, still compiles).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def use_prebuilt_dataset_helpers() -> None:
    from megatron.core.datasets import utils

    if getattr(utils.compile_helpers, "_megatron_kd", False):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # nothing prebuilt: let megatron compile as usual
    original = utils.compile_helpers

    def compile_helpers():
        logger.info("megatron_kd: using megatron-core's prebuilt dataset helpers (helpers_cpp)")

    compile_helpers._megatron_kd = True
    compile_helpers.original = original
    utils.compile_helpers = compile_helpers
