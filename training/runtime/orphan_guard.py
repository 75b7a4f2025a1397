"""Ranks stop when the ``deepspeed`` command that started them is gone.

``deepspeed`` (the runner) starts ``deepspeed.launcher.launch``, which starts the ranks. Only ``launch``
forwards SIGINT/SIGTERM to the ranks; the runner installs no handler for single-node runs, so a SIGINT
(or SIGHUP, SIGKILL) sent to the runner alone ends it and leaves ``launch`` and every rank training on,
orphaned, writing into a run directory a rerun will then also use. Each rank therefore watches the
runner's pid from a daemon thread and, when it has gone, sends itself SIGTERM (default action: exit; a training
rank's :func:`training.runtime.launch.run_locked` takes it as an interrupt and tears down first; the other ranks
do the same, so ``launch`` then exits too). A rank still there ``EXIT_SECONDS`` later leaves with ``os._exit``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

EXIT_SECONDS = 30.0
"""How long a rank told to stop may take to tear down before the guard ends it."""


def _ppid_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the parenthesised command name


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launcher_runner_pid() -> int | None:
    """The ``deepspeed`` runner's pid when this process is a rank started by ``deepspeed.launcher.launch``
    (our parent), else None (plain ``python -m``, torchrun, tests)."""
    parent = os.getppid()
    if "deepspeed.launcher.launch" not in _cmdline(parent):
        return None
    runner = _ppid_of(parent)
    return runner if runner and runner > 1 else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited already: its parent just has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def exit_when_gone(pid: int | None, interval: float = 2.0) -> threading.Thread | None:
    """Start a daemon thread that SIGTERMs this process once ``pid`` has exited; None if ``pid`` is None."""
    if pid is None:
        return None

    def watch() -> None:
        stop = threading.Event()
        while _alive(pid):
            stop.wait(interval)
        print(f"rank {os.environ.get('RANK', '?')}: the deepspeed launcher (pid {pid}) is gone; stopping",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # a training rank takes it as an interrupt (training.runtime.launch)
        stop.wait(EXIT_SECONDS)  # a rank whose teardown waits on a peer that is gone: leave anyway
        os._exit(128 + signal.SIGTERM)

    t = threading.Thread(target=watch, name="orphan-guard", daemon=True)
    t.start()
    return t
