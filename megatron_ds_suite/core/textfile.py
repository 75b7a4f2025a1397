"""Reading a text file a user named: UTF-8 or one line saying it is not (never a decode traceback, never
replacement characters)."""
from __future__ import annotations

import json
from pathlib import Path

from megatron_ds_suite.core.errors import SuiteError


def read_utf8(path: str | Path, what: str, error: type[Exception]) -> str:
    """The text of ``path``; a file that is not UTF-8 raises ``error`` naming ``what``, the byte and the reason."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}): a binary file? pass a UTF-8 "
                    f"text file") from None


class BadJsonLine(SuiteError):
    """One line of a user's jsonl file that cannot become a JSON value; ``str()`` is the short reason (each reader
    turns it into its own one-line error, naming the file and line, or a counted skip)."""


def json_line(line: str | bytes):
    """``json.loads`` of one line of a user's file, where every way a line can fail is a :class:`BadJsonLine`:
    malformed JSON, nesting past Python's stack (2 KB of ``[`` raise RecursionError) and a number past
    Python's 4,300-digit int limit (a ValueError that is not a JSONDecodeError). Callers turn it into their
    own one-line error or a counted skip."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise BadJsonLine(f"{e.msg} at column {e.colno}") from None
    except RecursionError:
        raise BadJsonLine("nested too deep") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion: ..."
        raise BadJsonLine(str(e).split(":")[0]) from None
