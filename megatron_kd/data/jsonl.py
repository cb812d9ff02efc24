"""JSON Lines input of the data commands, read as bytes and decoded line by line, so a byte that is
not UTF-8 is reported on its own line; every mistake names FILE:LINE."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path


def json_lines(path: Path, error: type[Exception], progress: Callable[[int], None] | None = None
               ) -> Iterator[tuple[str, object]]:
    """("FILE:LINE", value) of each non-blank line of ``path``; a file that cannot be read, a line
    that is not UTF-8 or not JSON is one ``error``. ``progress(n)``: the bytes of each line read."""
    try:
        handle = path.open("rb")
    except OSError as e:
        raise error(f"--input {path}: cannot read it ({e.strerror})") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            if progress is not None:
                progress(len(raw))
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 ({e.reason} at byte {e.start + 1} of the line)") from None
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not a JSON line ({e.msg} at column {e.colno})") from None
            yield where, value
