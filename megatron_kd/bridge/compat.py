"""Which Megatron-Bridge ``megatron_kd.bridge`` runs with, known before Bridge is imported.

megatron-bridge is an extra (``pip install 'megatron_kd[bridge]'``). Importing it takes seconds and
imports Transformer Engine, so its presence and version are read from the installed distribution
(``importlib.metadata``) and found with ``importlib.util.find_spec`` (which imports nothing of it):
``require_bridge`` raises one ``BridgeError`` line when it is missing or outside ``SUPPORTED``.
The adapter calls Bridge's training API (``ConfigContainer``, ``pretrain`` / ``finetune``, the
forward-step signature with ``GlobalState``, callbacks, the dataset provider of ``GPTDatasetConfig``),
which Bridge marks experimental: another minor version may change it, so only the tested one runs.

``use_prebuilt_dataset_helpers``: ``megatron_kd.megatron.compat``'s fix (the megatron-core wheel
ships the dataset helpers prebuilt, without their Makefile, and ``initialize_megatron`` runs
``make`` and exits when it fails) for Bridge's ``initialize_megatron``, which binds
``compile_helpers`` when it is imported and so does not see megatron-core's module patched.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging

from megatron_kd.errors import UserError

logger = logging.getLogger(__name__)

DISTRIBUTION = "megatron-bridge"
SUPPORTED = (">=0.6.2", "<0.7")
"""The versions of megatron-bridge the adapter runs with: 0.6.2 is the one tested."""
INSTALL = "pip install 'megatron_kd[bridge]'"


class BridgeError(UserError):
    """megatron-bridge missing, of a version the adapter does not run with, or a Bridge config it
    cannot distill (one line)."""


def installed_version() -> str | None:
    """The version of the megatron-bridge that ``import megatron.bridge`` would load; None when
    there is none."""
    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            return None
    except ModuleNotFoundError:  # no megatron namespace at all
        return None
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(",".join(SUPPORTED))
    except InvalidVersion:
        return False


def require_bridge() -> str:
    """The installed megatron-bridge's version, or one ``BridgeError`` line saying what to install."""
    wanted = ",".join(SUPPORTED)
    version = installed_version()
    if version is None:
        raise BridgeError(f"megatron-bridge is not installed: megatron_kd.bridge needs megatron-bridge{wanted} "
                          f"({INSTALL})")
    if not supported(version):
        raise BridgeError(f"megatron-bridge {version} is installed: megatron_kd.bridge runs with "
                          f"megatron-bridge{wanted} (pip install 'megatron-bridge{wanted}')")
    return version


def use_prebuilt_dataset_helpers() -> None:
    """megatron-core's prebuilt dataset helpers for Bridge's ``initialize_megatron`` too (idempotent)."""
    from megatron.bridge.training import initialize

    from megatron_kd.megatron.compat import use_prebuilt_dataset_helpers as for_megatron_core

    for_megatron_core()
    from megatron.core.datasets import utils

    if initialize.compile_helpers is not utils.compile_helpers:
        initialize.compile_helpers = utils.compile_helpers
        logger.info("megatron_kd: Bridge's initialize_megatron uses megatron-core's prebuilt dataset helpers")


def import_bridge_module(name: str):
    """``importlib.import_module(name)`` for a module that imports megatron.bridge, after
    ``require_bridge``: a module Bridge's import needs and lacks (Transformer Engine, which
    megatron-bridge 0.6 imports unconditionally; a requirement a ``--no-deps`` install left out) is one
    ``BridgeError`` line naming it."""
    require_bridge()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or str(e)
        if missing.startswith(("megatron_kd", "megatron.core", "megatron.training", "megatron.bridge")):
            raise  # not a missing requirement: a bug
        how = ("install Transformer Engine (launch/install_te.sh, or NGC's PyTorch container)"
               if missing.startswith("transformer_engine") else INSTALL)
        raise BridgeError(f"megatron-bridge's import needs the module {missing!r}, which is not installed: {how}") \
            from None
