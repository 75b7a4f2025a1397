"""The one error base of the suite.

Every error that means "bad input or bad config" derives from :class:`SuiteError`: its message is one
line saying what is wrong and, where possible, how to fix it. Every command prints such an error as one
line (no traceback) and exits with code 2; anything else is a bug and keeps its traceback. See
``docs/errors.md`` for the hierarchy.
"""
from __future__ import annotations


class SuiteError(ValueError):
    """Bad input or configuration, reported to the user as one line (exit code 2)."""

    label = "error"
    """How a command introduces the message: ``<label>: <message>``."""

    def one_line(self) -> str:
        """``<label>: <message>`` on one line (a message that has line breaks gets them as spaces)."""
        return f"{self.label}: {' '.join(str(self).split())}"


class ConfigError(SuiteError):
    """A config file or ``a.b=value`` override that is invalid: printed as ``config error: ...``."""

    label = "config error"


class RaceDataError(SuiteError):
    """A RACE folder or file that cannot be read, or a tokenizer that cannot encode RACE."""
