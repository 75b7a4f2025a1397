"""One writer per folder: an exclusive lock on FOLDER/.lock held while a command writes there.

Two training runs in one ``run.dir`` would interleave checkpoints and truncate each other's
``metrics.jsonl``; two corpus builds in one ``output_dir`` would wipe each other's stage folders and publish
a mixture. The lock is ``fcntl.flock`` on an open file, so the kernel drops it when the holder dies however
it dies (kill -9, power loss of a node): a lock can never stay held by a dead process. The file also records
who holds it (pid, host, start time, what it is doing); a file still naming a holder when a new writer takes
the lock means the previous one did not exit cleanly, which is reported (with whether that pid is still
alive on this host) and then taken over. A clean exit empties the file.

Used by training (``training.runtime.run_lock``: the run directory) and the corpus builder
(``data_pipeline.stages.runner``: the output folder); one file name, so a training run and a corpus build
never write into one folder at once either.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_ds_suite.core.errors import ConfigError

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class FolderBusy(ConfigError):
    """Another live process holds the folder's lock."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class FolderLock:
    """``acquire()`` / ``release()`` of FOLDER/.lock (see module docstring). ``name`` is how a refusal names the
    folder (``run.dir``, ``--out``, ``output_dir``), ``purpose`` what the holder does (``training run``,
    ``corpus build``): it is recorded in the file, so a refusal says what the other holder is doing."""

    busy: type[FolderBusy] = FolderBusy

    def __init__(self, folder: str | Path, name: str, purpose: str):
        self.path = Path(folder) / LOCK_NAME
        self.name = name
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"
                   if holder else "another process")
            raise self.busy(f"{self.name} {self.path.parent} is in use by another {holder.get('purpose', self.purpose)} "
                            f"({who}): wait for it to finish or stop it, or choose another {self.name}") from None
        previous = self._read(fd)
        if previous:
            same_host = previous.get("host") == socket.gethostname()
            pid = previous.get("pid")
            state = ("still running but not holding the lock" if same_host and isinstance(pid, int) and pid_alive(pid)
                     else "no longer running" if same_host else "on another host")
            logger.warning("%s %s: stale lock of pid %s on %s (started %s, %s): that %s ended without releasing it "
                           "(killed or crashed); taking it over", self.name, self.path.parent, pid,
                           previous.get("host"), previous.get("started"), state, previous.get("purpose", self.purpose))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
              "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Empty the file (a clean exit) and drop the lock; idempotent."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            data = os.pread(fd, 4096, 0)
            got = json.loads(data) if data.strip() else {}
            return got if isinstance(got, dict) else {"pid": "?", "host": "?", "started": "?"}
        except (OSError, ValueError):
            return {"pid": "?", "host": "?", "started": "?"}


@contextmanager
def folder_lock(folder: str | Path, name: str, purpose: str) -> Iterator[FolderLock]:
    """Hold ``folder``'s lock for the ``with`` block (created with the folder when missing)."""
    lock = FolderLock(folder, name, purpose)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


def overlapping_input(out: str | Path, inputs: dict[str, str | Path]) -> str | None:
    """The first ``{flag: path}`` of ``inputs`` that ``out`` would destroy or write into: the same folder
    (symlinks resolved), an ancestor of it or inside it, as a one-line reason; None when they are apart."""
    target = Path(out).resolve()
    for flag, path in inputs.items():
        src = Path(path).resolve()
        if target == src:
            return f"is {flag} itself"
        if target in src.parents:
            return f"contains {flag} {path}"
        if src in target.parents:
            return f"lies inside {flag} {path}"
    return None
