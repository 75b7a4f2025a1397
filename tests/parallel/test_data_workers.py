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


def _square(x: int) -> int:
    return x * x


def test_the_local_executor_runs_every_stage_on_the_build_pool() -> None:
    """``LocalExecutor`` (the executor a local build hands its stages): entered, its map / imap / imap_unordered
    run on the one shared pool; map and imap keep job order; imap_unordered reads a lazy job list at most
    ``max_in_flight`` ahead of the results it has given; with one worker everything runs in this process."""
    from data_pipeline.executor import LocalExecutor

    with LocalExecutor(2) as ex:
        with worker_pool(2) as shared:
            a = set(shared.map(_pid, range(20), chunksize=1))
        assert set(ex.map(_pid, list(range(20)))) <= a and set(ex.imap(_pid, list(range(20)))) <= a
        assert set(ex.imap_unordered(_pid, iter(range(20)))) <= a and os.getpid() not in a
        assert ex.map(_square, list(range(30))) == [x * x for x in range(30)] == list(ex.imap(_square, range(30)))
        taken: list[int] = []

        def jobs():
            for k in range(50):
                taken.append(k)
                yield k

        got = []
        for r in ex.imap_unordered(_square, jobs(), max_in_flight=3):
            got.append(r)
            assert len(taken) <= len(got) + 4  # bounded read-ahead
        assert sorted(got) == [x * x for x in range(50)]
    one = LocalExecutor(1)
    assert set(one.map(_pid, [1, 2])) == {os.getpid()} and one.min_tasks == 1
