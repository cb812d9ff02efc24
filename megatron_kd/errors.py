"""User-facing errors: the CLI prints each as one line and exits with status 2.

Raise a subclass of ``UserError`` for anything a user can fix (a flag, a file, a mismatch); its
message names the flag or file, the field and the expected value. Bugs stay ordinary exceptions.

- ``FlagParser``: an argparse parser whose mistakes (unknown flag, bad value, missing argument)
  raise ``FlagError`` instead of printing a usage block and exiting.
- ``OneLineAcrossProcesses``: a mixin for errors raised in DataLoader worker processes. torch
  re-raises a worker's exception in the main process as ``type(e)(text)``, where ``text`` is
  "Caught <type> in DataLoader worker process N.\\nOriginal Traceback ...". Such a class takes
  that text back to the worker's own one-line message (the traceback's last line).
"""

from __future__ import annotations

import argparse


class UserError(ValueError):
    """A mistake in the input: one line, exit status 2 in the CLI."""


class FlagError(UserError):
    """A command-line flag is missing, unknown or out of range."""


class ModelConfigError(UserError):
    """A model flag does not match a Hugging Face config, or describes an architecture that cannot
    be imported or exported."""


class FlagParser(argparse.ArgumentParser):
    """argparse, with every parsing mistake raised as one ``FlagError`` line (``--help`` still
    prints the usage)."""

    def error(self, message: str):
        raise FlagError(f"{message} (see {self.prog} --help)")


class OneLineAcrossProcesses(Exception):
    """Keeps its one-line message when torch's DataLoader re-raises it from a worker process."""

    def __init__(self, message: str = ""):
        super().__init__(self._original(str(message)))

    @classmethod
    def _original(cls, message: str) -> str:
        lines = message.rstrip().splitlines()
        if len(lines) < 2 or not lines[0].startswith(f"Caught {cls.__name__} "):
            return message
        # format_exception's last line is "<module>.<qualname>: <the worker's message>"
        prefix = f"{cls.__module__}.{cls.__qualname__}: "
        last = lines[-1]
        return last[len(prefix):] if last.startswith(prefix) else last
