"""Reading a text file a user named: UTF-8 or one line saying it is not (never a decode traceback, never
replacement characters)."""
from __future__ import annotations

from pathlib import Path


def read_utf8(path: str | Path, what: str, error: type[Exception]) -> str:
    """The text of ``path``; a file that is not UTF-8 raises ``error`` naming ``what``, the byte and the reason."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}): a binary file? pass a UTF-8 "
                    f"text file") from None
