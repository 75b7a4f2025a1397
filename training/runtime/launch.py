"""How every distributed entry point starts and ends: pretraining, RACE fine-tuning and evaluation.

One skeleton, one table of exit codes (docs/errors.md):

    0    done
    1    the operating system refused (disk full, permissions): one line; checkpoints are atomic, ``latest`` kept
    2    bad input or config (:class:`~megatron_ds_suite.core.errors.SuiteError`): one line, from one rank
    3    a run that went wrong on purpose-checked grounds (the trainer's ``TrainingAborted``): ``training aborted: ...``
    130  interrupted (Ctrl-C, SIGINT or SIGTERM from the launcher): one line, from rank 0

:func:`run_locked` is the whole life of a training command: process group, the run directory's lock (rank 0
claims it, every rank learns the outcome), the body, the table above, then the lock released and the process
groups torn down on every path. :func:`shutdown` is the teardown alone, for commands that start their groups
lazily (evaluation): a process that leaves with its gloo/NCCL groups alive can abort at interpreter exit
("terminate called without an active exception") after its output was written.

Ctrl-C in a terminal signals the whole process group: the ``deepspeed`` runner, ``deepspeed.launcher.launch`` and
every rank. ``launch`` answers with SIGTERM to every rank at once (then SIGKILL after 30 s), which by default
killed a rank in the middle of its teardown (the run directory's lock left claimed: a "stale lock" warning on
the rerun). :func:`run_locked` therefore takes SIGTERM as an interrupt too, and once interrupted holds both
signals off until its teardown is done (the previous handlers restored on return). What DeepSpeed's own
processes print then is in docs/errors.md.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_ds_suite.core.errors import SuiteError
from training.cli import report_error
from training.runtime import run_lock
from training.runtime.distributed import init_distributed

RESUME_HINT = "the newest complete checkpoint is kept; rerun the same command to resume"


def shutdown() -> None:
    """Destroy the default process group (and with it every subgroup) if one exists; safe to call twice."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def os_error_line(error: OSError, where: str | Path, hint: str = RESUME_HINT) -> str:
    """One line for an OSError (disk full, permissions) met while writing under ``where``."""
    return (f"error: {error.strerror or error}: {error.filename or where} (check free disk space and permissions); "
            f"{hint}")


def run_locked(run_dir: str | Path, body: Callable[[], int | None], *, hint: str = RESUME_HINT) -> int:
    """Start the process group, claim ``run_dir`` for this run, run ``body`` on every rank, map what it raises to
    an exit code and tear everything down. ``body`` returns an exit code (None = 0).

    The claim is a collective right after the default group, so the order of collectives is the same on every
    rank, and a refused launch builds nothing and writes nothing into the busy run directory. Once DeepSpeed
    has been initialised its module globals (``deepspeed.utils.groups.mpu``, activation checkpointing's
    ``mpu``) keep the TP/DP/PP groups alive past ``destroy_process_group()`` until interpreter finalisation;
    a refused launch never gets there, so it exits 2 instead of aborting."""
    import torch.distributed as dist

    from training.trainer import TrainingAborted  # here: evaluation imports this module for shutdown() alone

    with interrupt_signals() as hold_off:
        try:
            init_distributed()
        except SuiteError as e:  # the rendezvous port taken: one line on every rank that met it
            return report_error(e)
        lock = None
        try:
            lock = run_lock.acquire_for_rank0(run_dir, dist.get_rank() == 0)
            return body() or 0
        except run_lock.RunDirBusy as e:  # every rank learnt it from rank 0 at once; one says it
            return report_error(e, dist.get_rank())
        except SuiteError as e:  # bad config, unsafe/truncated/missing checkpoint files, a bad `latest`, bad data
            return report_error(e)  # from whichever rank met it
        except TrainingAborted as e:  # loss NaN, an fp16 overflow streak: pretraining and RACE fine-tuning alike
            print(f"training aborted: {e}", file=sys.stderr)
            return 3
        except KeyboardInterrupt:  # Ctrl-C, SIGINT/SIGTERM from the launcher: checkpoints are atomic, latest intact
            hold_off()  # the launcher's SIGTERM follows its SIGINT at once: let the teardown below finish
            if int(os.environ.get("RANK", "0")) == 0:  # every rank got it; one says it
                print(f"interrupted: {hint}", file=sys.stderr)
            return 130
        except OSError as e:  # disk full, permissions: the checkpoint being written is discarded, `latest` kept
            print(os_error_line(e, run_dir, hint), file=sys.stderr)
            return 1
        finally:
            if lock is not None:  # rank 0's claim (an empty file: a clean exit)
                lock.release()
            shutdown()


def _ignore(signum: int, frame: object) -> None:
    """A Python handler that does nothing (not ``SIG_IGN``: CPython raises "Signal 15 ignored due to race condition"
    in whatever runs next when a signal already pending finds its handler set to ``SIG_IGN``)."""


def _interrupt(signum: int, frame: object) -> None:
    # the first SIGINT/SIGTERM starts the teardown; the ones after it do nothing from here on (DeepSpeed's launcher
    # sends SIGTERM right after the terminal's SIGINT: landing before run_locked's hold_off(), it raised a second
    # KeyboardInterrupt inside the first one's handling, a traceback instead of the one line)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    raise KeyboardInterrupt


@contextmanager
def interrupt_signals() -> Iterator[Callable[[], None]]:
    """While open, SIGINT and SIGTERM raise ``KeyboardInterrupt`` (Python's SIGINT handler is restored even when
    the process was started with SIGINT ignored); the function it yields ignores both from then on, for a
    teardown that must not be cut short. The previous handlers come back on exit. Outside the main thread
    (signals cannot be handled there) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def hold_off() -> None:
        for sig in previous:
            signal.signal(sig, _ignore)

    for sig in previous:
        signal.signal(sig, _interrupt)
    try:
        yield hold_off
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
