"""One pool of forked workers for a whole build: every stage's tasks run on the same processes, a failure
closes it, and outside a build each use gets (and closes) a pool of its own."""
from __future__ import annotations

import os
import time

import pytest

from data_pipeline.dedup.sharded import local_pmap
from data_pipeline.workers import build_pool, worker_pool


def _pid(_: int) -> int:
    time.sleep(0.02)  # long enough that both workers take tasks
    return os.getpid()


def _fail(x: int) -> int:
    if x == 3:
        raise ValueError("task 3 failed")
    return x


def test_a_build_forks_its_workers_once() -> None:
    with build_pool(2):
        with worker_pool(2) as first:
            a = set(first.map(_pid, range(40), chunksize=1))
        with worker_pool(1) as second:  # fewer workers asked: the shared pool serves them
            b = set(second.map(_pid, range(40), chunksize=1))
        c = set(local_pmap(2)(_pid, list(range(40))))  # the dedup steps' pmap: the same processes
        assert second is first
        assert len(a) == 2 and os.getpid() not in a
        assert b <= a and c <= a
    with worker_pool(2) as outside:  # no build open: a new pool, other processes
        d = set(outside.map(_pid, range(40), chunksize=1))
    assert outside is not first and not d & a


def test_a_failed_task_ends_the_build_pool() -> None:
    with pytest.raises(ValueError, match="task 3 failed"):
        with build_pool(2):
            with worker_pool(2) as pool:
                list(pool.imap(_fail, range(8)))
    with build_pool(2):  # the next build starts clean: a fresh pool that works
        with worker_pool(2) as pool:
            assert pool is not None and pool.map(_fail, [1, 2]) == [1, 2]
