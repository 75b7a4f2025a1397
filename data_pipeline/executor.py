"""Where a build's tasks run: one executor, chosen once per build from ``executor:`` and handed to every stage.

A stage describes its work as self-contained tasks (``fn(job)``, the job a dataclass of paths and settings) and
asks the executor to run them; it never asks itself where they run. Two executors, one interface (as
datatrove's ``LocalPipelineExecutor`` / ``RayPipelineExecutor`` and NeMo Curator's executors):

* :class:`LocalExecutor`: the build's forked worker pool (:mod:`data_pipeline.workers`: forked once per build,
  workers ignore SIGINT, bounded stop); with one worker every task runs in the calling process;
* :class:`RayExecutor`: Ray tasks on an existing cluster (:mod:`data_pipeline.ray_executor`).

Methods: :meth:`~Executor.map` (results in job order, the dedup steps), :meth:`~Executor.imap` (lazily, in job
order: export), :meth:`~Executor.imap_unordered` (completion order, at most ``max_in_flight`` jobs taken from a
lazy ``jobs`` at once: ingest reads its sources as work frees up), and :attr:`~Executor.min_tasks` (how many
tasks a step should be cut into to keep every worker busy). :func:`executor_for` is the one place that reads
``cfg.executor`` (besides the runner, which calls it; enforced by ``tests/unit/test_architecture.py``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from data_pipeline.config import BuildConfig
from data_pipeline.ray_executor import connect, ray_map, ray_pmap, shuffle_tasks
from data_pipeline.workers import build_pool, worker_pool

Task = Callable[[Any], Any]


class Executor:
    """The interface every stage uses (module docstring)."""

    name = "?"

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @property
    def min_tasks(self) -> int:
        """The least number of tasks a step should be cut into (one per worker / the cluster's share)."""
        raise NotImplementedError

    def map(self, fn: Task, jobs: Sequence[Any]) -> list[Any]:
        """``[fn(job) for job in jobs]``, run by the workers."""
        return list(self.imap(fn, jobs))

    def imap(self, fn: Task, jobs: Sequence[Any]) -> Iterator[Any]:
        """``fn(job)`` of every job, yielded in job order."""
        raise NotImplementedError

    def imap_unordered(self, fn: Task, jobs: Iterable[Any], max_in_flight: int = 0) -> Iterator[Any]:
        """``fn(job)`` of every job, in completion order, at most ``max_in_flight`` (default: twice the workers)
        submitted at once, so a lazy ``jobs`` is read as work frees up."""
        raise NotImplementedError


class LocalExecutor(Executor):
    """Forked worker processes on this machine (:mod:`data_pipeline.workers`). Used as a context manager (the
    runner does, for a whole build), every stage shares one pool forked once; without, each call opens a
    pool of its own (tests, benchmarks). A single job runs in a worker too (when ``workers > 1``), so a
    task's memory (the dedup components task's) is never the driver's."""

    name = "local"

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._stack: ExitStack | None = None

    def __enter__(self) -> LocalExecutor:
        self._stack = ExitStack()
        self._stack.enter_context(build_pool(self.workers))
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)

    @property
    def min_tasks(self) -> int:
        return self.workers

    def imap(self, fn: Task, jobs: Sequence[Any]) -> Iterator[Any]:
        jobs = list(jobs)
        if self.workers == 1 or not jobs:
            yield from map(fn, jobs)
            return
        with worker_pool(min(self.workers, len(jobs))) as pool:
            yield from pool.imap(fn, jobs)

    def imap_unordered(self, fn: Task, jobs: Iterable[Any], max_in_flight: int = 0) -> Iterator[Any]:
        if self.workers == 1:
            yield from map(fn, jobs)
            return
        limit = max_in_flight or 2 * self.workers
        pending: deque[Any] = deque()
        with worker_pool(self.workers) as pool:
            for job in jobs:
                pending.append(pool.apply_async(fn, (job,)))
                while len(pending) > limit:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()


class RayExecutor(Executor):
    """Ray tasks on the cluster at ``ray.address`` (:mod:`data_pipeline.ray_executor`), reached on entry."""

    name = "ray"

    def __init__(self, cfg: BuildConfig) -> None:
        self.cfg = cfg

    def __enter__(self) -> RayExecutor:
        connect(self.cfg)  # reach the cluster before any work
        return self

    @property
    def min_tasks(self) -> int:
        return shuffle_tasks(self.cfg)

    def map(self, fn: Task, jobs: Sequence[Any]) -> list[Any]:
        return ray_pmap(self.cfg)(fn, jobs)

    def imap(self, fn: Task, jobs: Sequence[Any]) -> Iterator[Any]:
        return iter(self.map(fn, jobs))

    def imap_unordered(self, fn: Task, jobs: Iterable[Any], max_in_flight: int = 0) -> Iterator[Any]:
        return ray_map(self.cfg, fn, jobs, max_in_flight)


def executor_for(cfg: BuildConfig) -> Executor:
    """The executor ``cfg`` asks for (``executor: local | ray``), not yet entered."""
    if cfg.executor == "ray":
        return RayExecutor(cfg)
    return LocalExecutor(cfg.num_workers)
