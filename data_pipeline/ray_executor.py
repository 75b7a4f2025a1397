"""``executor: ray``: the build's per-shard work as Ray tasks on an existing Ray cluster.

What runs where (the driver is the ``python -m data_pipeline build`` process):

* ingest: one task per input shard (``stages.ingest.ingest_shard``; the driver reads the sources and ships each
  shard's records, at most ``2 x cluster CPUs`` shards in flight);
* filter: one task per ingest shard (``stages.filter.filter_shard``);
* dedup: every task of ``dedup.sharded.dedup_stage_files`` — exact-key map / reduce, signature chunks,
  bucket map / reduce over files, verification per document range, the components task — through
  :func:`ray_pmap`;
* tokenizer training and export stay on the driver.

Every task reads and writes the build's folder, so all nodes need it at the same path (a shared file
system; on one machine it is simply the local disk) and the project importable (installed, or on
``PYTHONPATH``: the driver passes its own ``PYTHONPATH`` to the workers). The stages reach these functions only
through :class:`data_pipeline.executor.RayExecutor`. Outputs are byte-identical to
``executor: local`` (``tests/e2e/test_ray_executor.py``): the tasks are the local stage's own functions on
the same shards, and results are assembled in shard/chunk order. Resume: a failed task is retried by
Ray (``max_retries``); a killed driver resumes like a local build (finished shards and chunks are kept).
This is the pipeline's only multi-machine path (the Redis-coordinated ``dedup-worker``/``dedup-merge`` flow
was retired in its favour).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from data_pipeline.config import BuildConfig, ConfigError


def connect(cfg: BuildConfig) -> Any:
    """``ray.init`` on the configured cluster (once per process); one-line error when it cannot."""
    try:
        import ray
    except ImportError:
        raise ConfigError("executor: ray needs Ray: pip install -e '.[ray]' (or executor: local)") from None
    if not ray.is_initialized():
        _check_reachable(cfg.ray.address)
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        try:
            ray.init(address=cfg.ray.address, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"executor: ray cannot reach a Ray cluster at ray.address={cfg.ray.address!r} "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); start one with "
                              "`ray start --head` or use executor: local") from None
    return ray


def _check_reachable(address: str) -> None:
    """Fail in seconds on a ``host:port`` nobody listens on (``ray.init`` would retry for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" / "local": Ray resolves it and fails fast itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"executor: ray: no Ray cluster at ray.address={address!r} ({e}); start one with "
                          "`ray start --head` or use executor: local") from None


def cluster_cpus(ray: Any) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def ray_map(cfg: BuildConfig, fn: Callable[[Any], Any], jobs: Iterable[Any], max_in_flight: int = 0) -> Iterator[Any]:
    """Results of ``fn(job)`` for every job, as Ray tasks (completion order), at most ``max_in_flight``
    submitted at once (default 2 x the cluster's CPUs) so a lazy ``jobs`` is read as work frees up."""
    ray = connect(cfg)
    task = ray.remote(num_cpus=cfg.ray.num_cpus_per_task, max_retries=cfg.ray.max_retries)(fn)
    limit = max_in_flight or 2 * cluster_cpus(ray)
    pending: list[Any] = []
    for job in jobs:
        pending.append(task.remote(job))
        while len(pending) >= limit:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        yield ray.get(done[0])


def _indexed(args: tuple[Callable[[Any], Any], int, Any]) -> tuple[int, Any]:
    fn, k, job = args
    return k, fn(job)


def ray_pmap(cfg: BuildConfig) -> Callable[[Callable[[Any], Any], Any], list[Any]]:
    """``pmap(fn, jobs)`` for ``dedup.sharded``: ``fn(job)`` of every job as Ray tasks, results in job order."""
    def pmap(fn: Callable[[Any], Any], jobs: Any) -> list[Any]:
        jobs = list(jobs)
        out: list[Any] = [None] * len(jobs)
        for k, res in ray_map(cfg, _indexed, ((fn, k, j) for k, j in enumerate(jobs))):
            out[k] = res
        return out
    return pmap


def shuffle_tasks(cfg: BuildConfig) -> int:
    """The least number of LSH partitions / verification ranges: ``ray.lsh_partitions``, else 2 x the cluster's CPUs."""
    return max(1, min(cfg.ray.lsh_partitions or 2 * cluster_cpus(connect(cfg)), 256))
