"""How a command was started, as its output needs to know it: the name it was started by, for usage lines
(``megatron-ds-eval --help`` says ``megatron-ds-eval``, ``python -m evaluation --help`` says ``python -m
evaluation``; console scripts set it in ``megatron_ds_suite.app.console``, parsers ask :func:`prog`), and whether its
stderr is a terminal (progress bars: :func:`stderr_is_terminal`)."""
from __future__ import annotations

import sys

_command: str | None = None


def set_command(name: str | None) -> None:
    """Record the console command this process runs as (None: started with ``python -m``)."""
    global _command
    _command = name


def prog(module_form: str) -> str:
    """The program name for an argparse usage line: the console command when there is one, else ``module_form``
    (e.g. ``python -m evaluation``)."""
    return _command or module_form


def stderr_is_terminal(stream=None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal: progress bars are drawn only there (a bar redrawn with
    carriage returns is noise in a Slurm, CI or piped log)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
