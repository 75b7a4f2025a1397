"""One training run per run directory: an exclusive lock on RUN_DIR/.lock held by rank 0 while it trains
(the lock itself: :mod:`megatron_ds_suite.core.folder_lock`, shared with the corpus builder).

Two launches into one ``run.dir`` would interleave checkpoints and truncate each other's
``metrics.jsonl``. The lock is ``fcntl.flock`` on an open file, so the kernel drops it when the holder
dies however it dies (kill -9, power loss of a node): a lock can never stay held by a dead process.
The file also records who holds it (pid, host, start time); a file still naming a holder when a new run
takes the lock means the previous run did not exit cleanly, which is reported (with whether that pid
is still alive on this host) and then taken over. A clean exit empties the file.
"""
from __future__ import annotations

from pathlib import Path

from megatron_ds_suite.core.folder_lock import LOCK_NAME, FolderBusy, FolderLock, overlapping_input, pid_alive

__all__ = ["LOCK_NAME", "RunDirBusy", "RunDirLock", "acquire_for_rank0", "lock_existing_output", "overlapping_input",
           "pid_alive"]


class RunDirBusy(FolderBusy):
    """Another live process holds the run directory."""


class RunDirLock(FolderLock):
    """``acquire()`` / ``release()`` of RUN_DIR/.lock (:class:`megatron_ds_suite.core.folder_lock.FolderLock`)."""

    busy = RunDirBusy

    def __init__(self, run_dir: str | Path, name: str = "run.dir"):
        super().__init__(run_dir, name, "training run")


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
