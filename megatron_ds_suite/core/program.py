"""The name a command was started by, for usage lines: ``megatron-ds-eval --help`` says ``megatron-ds-eval``,
``python -m evaluation --help`` says ``python -m evaluation``. Console scripts set it
(``megatron_ds_suite.console``); parsers ask :func:`prog`."""
from __future__ import annotations

_command: str | None = None


def set_command(name: str | None) -> None:
    """Record the console command this process runs as (None: started with ``python -m``)."""
    global _command
    _command = name


def prog(module_form: str) -> str:
    """The program name for an argparse usage line: the console command when there is one, else ``module_form``
    (e.g. ``python -m evaluation``)."""
    return _command or module_form
