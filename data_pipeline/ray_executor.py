"""``executor: ray``: the build's per-shard work as Ray tasks on an existing Ray cluster.

What runs where (the driver is the ``python -m data_pipeline build`` process):

* ingest: one task per input shard (``stages.ingest.ingest_shard``; the driver reads the sources and ships each
  shard's records, at most ``2 x cluster CPUs`` shards in flight);
* filter: one task per ingest shard (``stages.filter.filter_shard``);
* dedup with ``dedup.sharded`` (default): every task of ``dedup.sharded.dedup_sharded`` — signature chunks,
  bucket map / reduce over files, verification per document range, survivor Jaccards — through
  :func:`ray_pmap`; the driver streams the edge files (``dedup.components``);
* dedup with ``dedup.sharded: false``: one task per signature chunk (``dedup.minhash.sign_chunk``), then the LSH
  **shuffle by band key** in memory: one map task per chunk hashes every (band, band rows) key of its documents to one of ``P`` partitions, one
  reduce task per partition sorts its keys and emits the pairs of documents with equal (band, rows) —
  every key lands in exactly one partition, so the union of the reducers' pairs is exactly
  ``dedup.lsh.band_pairs`` (the local candidates); then the driver verifies candidates and takes connected
  components (union-find, lowest index survives) exactly as the local stage does;
* tokenizer training and export stay on the driver.

Every task reads and writes the build's folder, so all nodes need it at the same path (a shared file
system; on one machine it is simply the local disk) and the project importable (installed, or on
``PYTHONPATH``: the driver passes its own ``PYTHONPATH`` to the workers). Outputs are byte-identical to
``executor: local`` (``tests/e2e/test_ray_executor.py``): the tasks are the local stage's own functions on
the same shards, and results are assembled in shard/chunk order. Resume: a failed task is retried by
Ray (``max_retries``); a killed driver resumes like a local build (finished shards and chunks are kept).
This is the pipeline's only multi-machine path (the Redis-coordinated ``dedup-worker``/``dedup-merge`` flow
was retired in its favour).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

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
    import socket

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


def ray_sign_chunks(cfg: BuildConfig, store: Any, sig_dir: Path, num_perm: int, seed: int, shingle: Any,
                    chunk_size: int) -> None:
    """The signature chunks ``dedup.minhash.compute_signatures`` would compute, as Ray tasks (``sign_chunk``,
    same files); finished chunks are kept, so the stage then only loads them."""
    from data_pipeline.dedup.minhash import SignJob, chunk_files, sign_chunk

    sig_dir.mkdir(parents=True, exist_ok=True)
    n = len(store)
    jobs = [SignJob(str(store.folder), s, min(n, s + chunk_size), str(sig_dir), num_perm, seed, shingle)
            for s in range(0, n, chunk_size) if not chunk_files(sig_dir, s)["sig"].exists()]
    for _ in ray_map(cfg, sign_chunk, jobs):
        pass


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


# ------------------------------------------------------------------------------- LSH shuffle by band key
def band_map(args: tuple[str, int, int, int, int, int]) -> list[np.ndarray]:
    """Map task of one signature chunk: per partition, int64 rows ``[band, doc, r_0 .. r_{rows-1}]`` of
    the chunk's active documents (a document with no shingle has no key, as in ``band_pairs``)."""
    from data_pipeline.dedup.buckets import key_hash
    from data_pipeline.dedup.minhash import chunk_files

    sig_dir, start, bands, rows, parts, _ = args
    f = chunk_files(Path(sig_dir), start)
    sigs, nsh = np.load(f["sig"]), np.load(f["nsh"])
    docs = np.flatnonzero(nsh > 0)
    out: list[list[np.ndarray]] = [[] for _ in range(parts)]
    for b in range(bands):
        r = sigs[docs, b * rows:(b + 1) * rows].astype(np.int64)
        rec = np.concatenate([np.full((len(docs), 1), b, np.int64), (docs + start)[:, None], r], axis=1)
        dest = (key_hash(np.delete(rec, 1, axis=1)) % np.uint64(parts)).astype(np.int64)
        for p in np.unique(dest).tolist():
            out[p].append(rec[dest == p])
    return [np.concatenate(x) if x else np.zeros((0, 2 + rows), np.int64) for x in out]


def band_reduce(args: tuple[list[np.ndarray], int]) -> np.ndarray:
    """Reduce task of one partition: keys ``i * n + j`` (i < j) of every pair of documents with equal
    (band, rows), sorted unique."""
    from data_pipeline.dedup.buckets import equal_key_pairs

    pieces, n = args
    recs = np.concatenate(pieces) if pieces else np.zeros((0, 2), np.int64)
    i, j = equal_key_pairs(np.delete(recs, 1, axis=1), recs[:, 1])  # key (band, rows...), document
    return np.unique(i * n + j) if len(i) else np.zeros(0, np.int64)


def band_shuffle_pairs(cfg: BuildConfig, sig_dir: Path, n: int, chunk_size: int, bands: int, rows: int
                       ) -> np.ndarray:
    """Candidate pairs (sorted int64[k, 2]) by a map/shuffle/reduce over the cluster."""
    ray = connect(cfg)
    parts = shuffle_tasks(cfg)
    opts = {"num_cpus": cfg.ray.num_cpus_per_task, "max_retries": cfg.ray.max_retries}
    mapper = ray.remote(num_returns=parts, **opts)(band_map) if parts > 1 else ray.remote(**opts)(band_map)
    reducer = ray.remote(**opts)(_reduce_refs)
    maps = [mapper.remote((str(sig_dir), s, bands, rows, parts, n)) for s in range(0, n, chunk_size)]
    if parts == 1:
        maps = [[m] for m in maps]
    reds = [reducer.remote(n, *[m[p] for m in maps]) for p in range(parts)]
    keys = [k for k in ray.get(reds) if len(k)]
    if not keys:
        return np.zeros((0, 2), np.int64)
    k = np.unique(np.concatenate(keys))
    return np.stack([k // n, k % n], axis=1)


def _reduce_refs(n: int, *pieces: Any) -> np.ndarray:
    """``band_reduce`` with the map outputs passed as task arguments (Ray resolves them to arrays,
    fetching each from the node that produced it)."""
    return band_reduce(([p[0] if isinstance(p, list) else p for p in pieces], n))
