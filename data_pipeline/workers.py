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
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import get_context
from multiprocessing.pool import Pool


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
        if shared.pool is not None:  # a failed stage: its unfinished tasks are not waited for
            shared.pool.terminate()
            shared.pool.join()
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
            shared.pool = get_context("fork").Pool(workers)
        yield shared.pool
        return
    pool = get_context("fork").Pool(workers)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()
