"""The local executor's worker processes: one pool of forked workers for a whole build.

Every stage of a local build runs its tasks on worker processes (ingest shards, filter shards, the dedup
steps, export shards, decontamination). A ``multiprocessing`` pool per stage, or per dedup step, forks
``workers`` processes each time, and each fork copies the driver's page tables and then its touched
pages: ~0.3 CPU-s per 20,000-document build on two workers went to that alone (the dedup stage opened
eight pools). While :func:`build_pool` is open (``stages.runner.build``), :func:`worker_pool` hands
every stage the same pool, forked on first use (before the ingest stage has loaded anything), so a build
forks ``workers`` processes once. Tasks are self-contained (their jobs carry paths and settings, as
Ray tasks need), so a worker forked early runs any stage's task; per-process caches such as
``filter.cached_tokenizer`` simply last across stages. Outside a build (tests, benchmarks, a single
stage), :func:`worker_pool` opens a pool of its own and closes it on exit.

Ctrl-C: a terminal sends SIGINT to the whole process group, workers included. A worker that died of it could
hold the pool's task-queue lock (``Pool.terminate`` then waits for that lock forever) and print its own
traceback, so workers ignore SIGINT (:func:`new_pool` forks them with SIGINT blocked, and their initializer
ignores it before unblocking it); only the driver takes the interrupt, and on any exception it stops its
workers with :func:`stop_pool` (terminate and join within a bound, then kill what is left).

Damaged work files: a task reads files an earlier stage wrote; one cut or overwritten (a garbled ``.npy`` header, a
``.txt`` that is no longer UTF-8, offsets past the end) fails in the worker with numpy's, json's or the codec's
exception, whose traceback the driver used to print. Every task runs through :func:`run_task`, which turns those
into one :class:`~data_pipeline.store.StoreError` (exit 2) naming the task, its folder and the remedy; a
``SuiteError`` a task raises crosses to the driver as it is. Other exceptions (bugs) keep their traceback.
"""
from __future__ import annotations

import functools
import logging
import pickle
import signal
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import get_context
from multiprocessing.pool import Pool
from typing import Any

from megatron_ds_suite.core.errors import SuiteError

log = logging.getLogger(__name__)

STOP_SECONDS = 10.0
"""How long :func:`stop_pool` waits for ``Pool.terminate`` + ``join`` before it kills the workers."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def ignore_interrupts() -> None:
    """Pool initializer: a worker ignores SIGINT (the driver handles Ctrl-C and stops the workers), and leaves on
    SIGTERM (``Pool.terminate``) through ``SystemExit``, so a task cut short removes its temporary files (the
    atomic writers' cleanup runs) instead of leaving them in the stage folder."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


DAMAGED_DATA = (ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, zlib.error, struct.error)
"""What reading a damaged work file raises (UnicodeDecodeError and JSONDecodeError are ValueErrors)."""


def damaged_work_file(error: BaseException, reader: str, folder: str = "") -> SuiteError:
    """The one line for ``error`` (one of :data:`DAMAGED_DATA`) met by ``reader`` reading the work files."""
    from data_pipeline.store import StoreError

    log.debug("%s failed", reader, exc_info=error)  # the traceback with -v
    where = f" in {folder}" if folder else ""
    detail = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    return StoreError(f"a work file{where} is damaged: {reader} could not read it ({detail}); rerun with `build "
                      f"--force` (or delete the output folder's work/ and run `build`)")


def run_task(fn: Callable[[Any], Any], job: Any) -> Any:
    """``fn(job)`` in a worker; a damaged work file read by it becomes one ``StoreError`` line in the driver."""
    try:
        return fn(job)
    except SuiteError:
        raise
    except DAMAGED_DATA as e:
        folder = next((str(getattr(job, k)) for k in ("folder", "text_folder", "path") if getattr(job, k, None)), "")
        raise damaged_work_file(e, getattr(fn, "__name__", "a task"), folder) from None


@contextmanager
def reading_work_files(stage: str) -> Iterator[None]:
    """The driver's side of :func:`run_task`: while a stage runs, a damaged work file that the driver itself reads
    (a stage with one worker runs its tasks here; the shard indexes opened to plan the tasks) is the same line."""
    try:
        yield
    except SuiteError:
        raise
    except DAMAGED_DATA as e:
        raise damaged_work_file(e, f"stage {stage}") from None


class TaskPool(Pool):
    """``multiprocessing`` pool whose ``map``/``imap``/``imap_unordered``/``apply_async`` run each task through
    :func:`run_task`."""

    def map(self, func, iterable, chunksize=None):  # type: ignore[override]
        return super().map(functools.partial(run_task, func), iterable, chunksize)

    def imap(self, func, iterable, chunksize=1):  # type: ignore[override]
        return super().imap(functools.partial(run_task, func), iterable, chunksize)

    def imap_unordered(self, func, iterable, chunksize=1):  # type: ignore[override]
        return super().imap_unordered(functools.partial(run_task, func), iterable, chunksize)

    def apply_async(self, func, args=(), kwds=None, callback=None, error_callback=None):  # type: ignore[override]
        if len(args) == 1 and not kwds:
            return super().apply_async(run_task, (func, args[0]), {}, callback, error_callback)
        return super().apply_async(func, args, kwds or {}, callback, error_callback)


def open_pool(workers: int) -> Pool:
    """A pool of ``workers`` forked processes that ignore SIGINT.

    SIGINT is blocked in the calling thread while the pool forks, so a Ctrl-C at that moment cannot reach a
    worker before :func:`ignore_interrupts` runs (a child inherits the mask, not the pending signal); the
    driver gets it as ``KeyboardInterrupt`` once the mask is restored. The pool's own threads, started here,
    keep SIGINT blocked, so the workers they fork to replace dead ones start the same way."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return TaskPool(workers, initializer=ignore_interrupts, context=get_context("fork"))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_pool(pool: Pool, seconds: float = STOP_SECONDS) -> None:
    """Stop ``pool`` without waiting for its tasks: ``terminate`` and ``join`` within ``seconds``, then SIGKILL
    any worker still alive (``terminate`` can wait forever for a queue lock that a killed worker held)."""
    done = threading.Event()

    def terminate() -> None:
        pool.terminate()
        pool.join()
        done.set()

    threading.Thread(target=terminate, name="stop_pool", daemon=True).start()
    if done.wait(seconds):
        return
    workers = list(getattr(pool, "_pool", []))  # CPython's list of the pool's worker processes
    log.warning("the worker pool did not stop within %.0f s: killing its %d worker(s)", seconds, len(workers))
    for w in workers:
        if w.is_alive():
            w.kill()
    for w in workers:
        w.join(seconds)


@contextmanager
def new_pool(workers: int) -> Iterator[Pool]:
    """A pool of its own (:func:`open_pool`), closed and joined on exit, stopped (:func:`stop_pool`) on an
    exception (Ctrl-C included)."""
    pool = open_pool(workers)
    try:
        yield pool
    except BaseException:
        stop_pool(pool)
        raise
    pool.close()
    pool.join()


class _Shared:
    """The open build's pool: its size, and the pool once forked."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pool: Pool | None = None


_shared: _Shared | None = None


@contextmanager
def build_pool(workers: int) -> Iterator[None]:
    """While open, :func:`worker_pool` with ``workers`` workers returns one shared pool (forked on first use,
    terminated on exit)."""
    global _shared
    if _shared is not None:  # nested (a build inside a build's task): the outer pool stays the shared one
        yield
        return
    shared = _shared = _Shared(workers)
    try:
        yield
    except BaseException:
        _shared = None
        if shared.pool is not None:  # a failed or interrupted stage: its unfinished tasks are not waited for
            stop_pool(shared.pool)
        raise
    _shared = None
    if shared.pool is not None:
        shared.pool.close()
        shared.pool.join()


@contextmanager
def worker_pool(workers: int) -> Iterator[Pool]:
    """A pool of ``workers`` forked processes: the build's shared one (left open) when :func:`build_pool` is
    open with at least that many workers, else a new one, closed and joined on exit."""
    shared = _shared
    if shared is not None and workers <= shared.workers:
        if shared.pool is None:
            shared.pool = open_pool(workers)
        yield shared.pool
        return
    with new_pool(workers) as pool:
        yield pool
