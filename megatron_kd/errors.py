"""User-facing errors: the CLI prints each as one line and exits with status 2.

Raise a subclass of ``UserError`` for anything a user can fix (a flag, a file, a mismatch); its
message names the flag or file, the field and the expected value. Bugs stay ordinary exceptions.
"""


class UserError(ValueError):
    """A mistake in the input: one line, exit status 2 in the CLI."""


class FlagError(UserError):
    """A command-line flag is missing, unknown or out of range."""
