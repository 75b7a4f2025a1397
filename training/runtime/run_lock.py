"""One training run per run directory: an exclusive lock on RUN_DIR/.lock held by rank 0 while it trains.

Two launches into one ``run.dir`` would interleave checkpoints and truncate each other's
``metrics.jsonl``. The lock is ``fcntl.flock`` on an open file, so the kernel drops it when the holder
dies however it dies (kill -9, power loss of a node): a lock can never stay held by a dead process.
The file also records who holds it (pid, host, start time); a file still naming a holder when a new run
takes the lock means the previous run did not exit cleanly, which is reported (with whether that pid
is still alive on this host) and then taken over. A clean exit empties the file.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from training.config import ConfigError

logger = logging.getLogger("training")

LOCK_NAME = ".lock"


class RunDirBusy(ConfigError):
    """Another live process holds the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunDirLock:
    """``acquire()`` / ``release()`` of RUN_DIR/.lock (see module docstring)."""

    def __init__(self, run_dir: str | Path, name: str = "run.dir"):
        self.path = Path(run_dir) / LOCK_NAME
        self.name = name  # how the refusal names the folder: run.dir, --out
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
            raise RunDirBusy(f"{self.name} {self.path.parent} is in use by another training run ({who}): wait for it "
                             f"to finish or stop it, or choose another {self.name}") from None
        previous = self._read(fd)
        if previous:
            same_host = previous.get("host") == socket.gethostname()
            state = ("still running but not holding the lock" if same_host and _pid_alive(int(previous.get("pid", 0)))
                     else "no longer running" if same_host else "on another host")
            logger.warning("run.dir %s: stale lock of pid %s on %s (started %s, %s): that run ended without "
                           "releasing it (killed or crashed); taking it over", self.path.parent, previous.get("pid"),
                           previous.get("host"), previous.get("started"), state)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
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
            return json.loads(data) if data.strip() else {}
        except (OSError, ValueError):
            return {"pid": "?", "host": "?", "started": "?"}


def acquire_for_rank0(run_dir: str | Path, is_rank0: bool) -> RunDirLock | None:
    """Collective: rank 0 takes the lock and every rank learns the outcome, so all raise the same
    one-line error together instead of the other ranks waiting in a collective for a rank that left."""
    import torch.distributed as dist

    lock, error = None, None
    if is_rank0:
        lock = RunDirLock(run_dir)
        try:
            lock.acquire()
        except RunDirBusy as e:
            lock, error = None, str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RunDirBusy(error)
    return lock


def lock_existing_output(out: str | Path, name: str = "--out") -> RunDirLock | None:
    """For a tool about to replace the folder ``out`` (``import_hf``, ``export_hf``, ``reshard``): take its run
    lock when it exists, so a live training run there is refused in one line (:class:`RunDirBusy`) instead
    of being replaced under it; the caller releases the lock when done. None when ``out`` does not exist
    (nothing there to protect; nothing is created)."""
    if not Path(out).is_dir():
        return None
    lock = RunDirLock(out, name)
    lock.acquire()
    return lock


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
