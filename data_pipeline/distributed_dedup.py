"""Near-duplicate removal across several machines that share one datasketch LSH index in Redis.

    python -m data_pipeline dedup-worker --config C --shard I/N --redis redis://host:6379/0   # on each machine
    python -m data_pipeline dedup-merge  --config C [--redis redis://host:6379/0]            # on one machine
    python -m data_pipeline build        --config C                                          # export as usual

Every machine holds the finished filter stage (a shared filesystem, or its own copy of ``work/`` and
``tokenizer/``). Shard ``I`` of ``N`` owns the signature chunks ``c`` with ``c % N == I`` (chunks of
``dedup.chunk_size`` store positions, the same chunks and files as the single-machine stage, so a
shared filesystem reuses them both ways). A worker

  1. computes its chunks' MinHash signatures + fingerprint sets (:func:`dedup.sign_chunk`);
  2. inserts its documents (key = store position) into ``MinHashLSH(params=(bands, rows))`` with Redis
     storage under a run-specific ``basename`` (the same index layout as ``dedup.storage=redis``);
  3. adds ``I`` to the Redis set ``<basename>_dpm_inserted`` and waits until it holds all ``N`` shards
     (the barrier; ``--barrier-timeout`` seconds, then a one-line error naming the missing shards);
  4. looks up every one of its documents ``j`` in every band (pipelined ``getmany`` per band) and keeps
     the partners ``i < j``: a candidate pair (i, j) is owned by the shard of its larger end, so each
     pair of documents sharing a bucket is found by exactly one shard — the candidate set equals
     :func:`dedup.band_pairs` of all signatures;
  5. measures the exact Jaccard of every owned candidate pair (:func:`dedup.verify_pairs`, fingerprint
     sets recomputed from the store's texts, so partners in other shards need no signature files) and
     writes the edges with J >= threshold to ``shard-IIIII-of-NNNNN.npz`` + ``.json`` (written last:
     the shard's completion marker).

``dedup-merge`` reads all N shards' edges and runs :func:`dedup.cluster` (union-find, the lowest input
index survives, ``linked_via`` = the first edge in sorted order touching a member). That is exactly the
single-machine result: the stage's own union-find skipping is proven (and tested) equal to clustering
every measured candidate pair, and the candidate pairs are the same. It then writes ``work/dedup/`` with
the dedup stage's fingerprint, so ``build`` reuses it and runs export.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from datasketch import LeanMinHash

from data_pipeline import dedup as dd
from data_pipeline.config import BuildConfig, ConfigError
from data_pipeline.report import StageTimer
from data_pipeline.stages import (StageError, _begin, _dedup_result_keys, _digest, _finish, _require, dedup_specs, fingerprint,
                     work_dir)
from data_pipeline.store import DocStore, atomic_save_npy, atomic_write_json, read_json, write_jsonl_atomic

log = logging.getLogger(__name__)

QUERY_BATCH = 2000  # documents per pipelined bucket lookup


# --------------------------------------------------------------------------------------------- settings
def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` → (I, N) with 0 <= I < N."""
    try:
        i_s, n_s = text.split("/")
        i, n = int(i_s), int(n_s)
    except ValueError:
        raise ConfigError(f"--shard must look like I/N (e.g. 0/3), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"--shard {text}: need N >= 1 and 0 <= I < N (shards are numbered from 0)")
    return i, n


def redis_params(url: str) -> dict[str, Any]:
    """``redis[s]://[user:password@]host:port/db[?ssl_ca_certs=…]`` or ``unix:///path`` → keyword arguments
    of ``redis.Redis`` (also what datasketch's ``storage_config["redis"]`` takes). ``rediss://`` is TLS."""
    from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

    try:
        params = parse_url(url)
    except ValueError as e:
        raise ConfigError(f"--redis {url!r}: {e} (expected redis://host:6379/0 or rediss://host:6380/0)") from None
    # parse_url names a connection class, which redis.Redis does not take: say it with its own arguments
    conn = params.pop("connection_class", None)
    if conn is SSLConnection:
        params["ssl"] = True
    elif conn is UnixDomainSocketConnection:
        params["unix_socket_path"] = params.pop("path")
    return params


def client_params(cfg: BuildConfig, url: str | None) -> tuple[dict[str, Any], str]:
    """(``redis.Redis`` arguments, URL for messages without the password): ``--redis URL`` or
    ``dedup.redis_host/port/db``, plus the password/TLS settings of ``dedup`` the URL does not give."""
    d = cfg.dedup
    auth = dd.redis_auth(d)
    if url is None:
        scheme = "rediss" if d.redis_tls else "redis"
        return {"host": d.redis_host, "port": d.redis_port, "db": d.redis_db, **auth}, \
            f"{scheme}://{d.redis_host}:{d.redis_port}/{d.redis_db}"
    params = redis_params(url)
    shown = re.sub(r"//([^@/]*?):[^@/]*@", r"//\1:***@", url)  # no password in messages or logs
    return {**auth, **params}, shown


def default_redis_url(cfg: BuildConfig) -> str:
    d = cfg.dedup
    return f"{'rediss' if d.redis_tls else 'redis'}://{d.redis_host}:{d.redis_port}/{d.redis_db}"


def corpus_key(store: DocStore) -> str:
    """Digest of the filter-stage store (input index and byte length of every document): the same on
    every machine that holds the same filter output, whatever its path."""
    h = hashlib.sha256(np.ascontiguousarray(store.table[:, [0, 2]]).tobytes())
    return h.hexdigest()[:16]


def run_basename(cfg: BuildConfig, key: str) -> str:
    """Redis key prefix of one distributed run: ``dedup.basename``, else derived from the corpus and the
    settings that change the result (machine-independent, unlike the stage fingerprint with its paths)."""
    return cfg.dedup.basename or f"dpm-{_digest([key, _dedup_result_keys(cfg)])}"


def edges_dir(cfg: BuildConfig, basename: str, given: str | None) -> Path:
    return Path(given) if given else cfg.out / "work" / "dedup-shards" / basename


def _shard_files(folder: Path, i: int, n: int) -> tuple[Path, Path]:
    stem = f"shard-{i:05d}-of-{n:05d}"
    return folder / f"{stem}.npz", folder / f"{stem}.json"


def _signature_dir(cfg: BuildConfig) -> Path:
    """The single-machine stage's signature folder (same expression as ``stages.run_dedup``)."""
    d = cfg.dedup
    return cfg.out / "work" / ("signatures-" + _digest([fingerprint(cfg, "filter"), d.num_perm, d.seed,
                                                        d.shingle_size, d.shingle_unit, dd.FINGERPRINT_VERSION,
                                                        d.chunk_size]))


@dataclass
class _Run:
    """What every command needs: config, store, specs, the run's identity."""

    cfg: BuildConfig
    store: DocStore
    shingle: dd.ShingleSpec
    lsh: dd.LshSpec
    key: str
    basename: str


def _open_run(cfg: BuildConfig) -> _Run:
    _require(cfg, "filter")
    if not cfg.dedup.enabled:
        raise ConfigError("dedup.enabled is false: nothing to distribute, run `python -m data_pipeline build`")
    store = DocStore(work_dir(cfg, "filter"))
    shingle, lsh = dedup_specs(cfg)
    key = corpus_key(store)
    return _Run(cfg, store, shingle, lsh, key, run_basename(cfg, key))


def _meta(run: _Run, num_shards: int) -> dict[str, Any]:
    l_ = run.lsh
    return {"corpus": run.key, "documents": len(run.store), "num_shards": num_shards,
            "lsh": [l_.threshold, l_.num_perm, l_.bands, l_.rows, l_.seed],
            "shingles": [run.shingle.n, run.shingle.unit], "fingerprint_version": dd.FINGERPRINT_VERSION}


# ---------------------------------------------------------------------------------------------- worker
def _sign_own_chunks(run: _Run, sig_dir: Path, starts: list[int]) -> None:
    from tqdm import tqdm

    cfg, n = run.cfg, len(run.store)
    sig_dir.mkdir(parents=True, exist_ok=True)
    dd.remove_stale_tmp(sig_dir)
    cs = cfg.dedup.chunk_size
    jobs = [(str(run.store.folder), s, min(n, s + cs), str(sig_dir), run.lsh.num_perm, run.lsh.seed,
             run.shingle.n, run.shingle.unit) for s in starts if not (sig_dir / f"sig-{s:012d}.npy").exists()]
    bar = tqdm(total=sum(j[2] - j[1] for j in jobs), desc="dedup-worker: minhash", unit="doc",
               disable=not cfg.progress)
    if cfg.num_workers > 1 and len(jobs) > 1:
        with get_context("fork").Pool(min(cfg.num_workers, len(jobs))) as pool:
            for _, k in pool.imap_unordered(dd.sign_chunk, jobs):
                bar.update(k)
    else:
        for j in jobs:
            bar.update(dd.sign_chunk(j)[1])
    bar.close()


def _own_signatures(sig_dir: Path, starts: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions of this shard's signed documents, their signatures, unsignatured count)."""
    pos, sigs, unsig = [], [], 0
    for s in starts:
        sig = np.load(sig_dir / f"sig-{s:012d}.npy")
        nsh = np.load(sig_dir / f"nsh-{s:012d}.npy")
        act = nsh > 0
        unsig += int((~act).sum())
        pos.append(s + np.flatnonzero(act))
        sigs.append(sig[act])
    if not pos:
        return np.zeros(0, np.int64), np.zeros((0, 0), np.uint32), 0
    return np.concatenate(pos).astype(np.int64), np.concatenate(sigs), unsig


def _barrier(client: Any, basename: str, shard: int, num_shards: int, timeout: float) -> float:
    """Register ``shard`` as inserted, then wait until all ``num_shards`` are; returns seconds waited."""
    key = f"{basename}_dpm_inserted"
    client.sadd(key, shard)
    t0 = time.monotonic()
    delay = 0.05
    while True:
        done = {int(x) for x in client.smembers(key)}
        if len(done) >= num_shards:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            missing = sorted(set(range(num_shards)) - done)
            raise StageError(f"barrier timed out after {timeout:g}s: {len(done)}/{num_shards} shards have "
                             f"inserted into Redis index '{basename}', missing shard(s) {missing}; start "
                             f"`dedup-worker --shard I/{num_shards}` for them (or raise --barrier-timeout)")
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


def query_own(index: Any, positions: np.ndarray, sigs: np.ndarray) -> list[tuple[int, int]]:
    """Every pair (i, j), i < j, of a document ``j`` of ``positions`` and a key ``i`` sharing one of its
    band buckets in ``index`` — the bucket lookup of ``MinHashLSH.query``, batched: one pipelined
    ``getmany`` per band per :data:`QUERY_BATCH` documents instead of one round trip per band and document."""
    pairs: set[tuple[int, int]] = set()
    for s in range(0, len(positions), QUERY_BATCH):
        js = positions[s:s + QUERY_BATCH].tolist()
        block = sigs[s:s + QUERY_BATCH]
        for (lo, hi), table in zip(index.hashranges, index.hashtables):
            keys = [index._H(row[lo:hi]) for row in block]
            for j, members in zip(js, table.getmany(*keys)):
                for m in members:
                    i = dd.redis_member(m)  # 8-byte id, length-checked: nothing from Redis is unpickled
                    if i < j:
                        pairs.add((int(i), j))
    return sorted(pairs)


def run_dedup_worker(cfg: BuildConfig, shard: str, redis_url: str | None = None, barrier_timeout: float = 3600.0,
                     edges: str | None = None) -> dict[str, Any]:
    """One machine's share of a distributed dedup (module docstring, steps 1-5). Returns its counts."""
    i, n_shards = parse_shard(shard)
    params, url = client_params(cfg, redis_url)
    run = _open_run(cfg)
    out_dir = edges_dir(cfg, run.basename, edges)
    npz, marker = _shard_files(out_dir, i, n_shards)
    meta = _meta(run, n_shards)
    client = dd.redis_client(params)
    meta_key = f"{run.basename}_dpm_meta"
    client.set(meta_key, json.dumps(meta, sort_keys=True), nx=True)
    try:
        other = json.loads(client.get(meta_key))
    except (TypeError, ValueError):
        other = "not JSON"
    if other != meta:
        raise StageError(f"Redis index '{run.basename}' at {url} belongs to another run ({other}, this one: "
                         f"{meta}); clear it with `dedup-merge --clear-only --redis {url}` or set dedup.basename")
    t0 = time.perf_counter()
    n = len(run.store)
    cs = cfg.dedup.chunk_size
    starts = [s for c, s in enumerate(range(0, n, cs)) if c % n_shards == i]
    sig_dir = _signature_dir(cfg)
    _sign_own_chunks(run, sig_dir, starts)
    positions, sigs, unsig = _own_signatures(sig_dir, starts)
    t1 = time.perf_counter()
    storage = {"type": "redis", "basename": run.basename.encode(), "redis": params}
    index = dd.make_lsh(run.lsh, storage)
    with index.insertion_session(buffer_size=10000) as session:
        for j, sig in zip(positions.tolist(), sigs):
            session.insert(dd.redis_key(j), LeanMinHash(seed=run.lsh.seed, hashvalues=sig, scheme="affine32"),
                           check_duplication=False)
    log.info("shard %d/%d: %d signatures inserted into '%s' at %s; waiting for the other shards", i, n_shards,
             len(positions), run.basename, url)
    waited = _barrier(client, run.basename, i, n_shards, barrier_timeout)
    t2 = time.perf_counter()
    pairs = query_own(index, positions, sigs)
    t3 = time.perf_counter()
    measured = dd.verify_pairs(run.store, pairs, run.shingle, cfg.dedup.verify_block_docs, cfg.num_workers,
                               cfg.progress, desc=f"dedup-worker {i}/{n_shards}: verify")
    kept = [e for e in measured if e[2] >= run.lsh.threshold]
    t4 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    tmp = npz.with_name(npz.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, i=np.array([e[0] for e in kept], np.int64), j=np.array([e[1] for e in kept], np.int64),
             jaccard=np.array([e[2] for e in kept], np.float64))
    os.replace(tmp, npz)
    info = {**meta, "shard": i, "basename": run.basename, "chunks": len(starts), "signed": len(positions),
            "unsignatured": unsig, "candidate_pairs": len(pairs), "measured_pairs": len(measured),
            "edges": len(kept), "rejected_candidates": len(measured) - len(kept),
            "seconds": {"minhash": round(t1 - t0, 3), "insert": round(t2 - t1 - waited, 3),
                        "barrier_wait": round(waited, 3), "query": round(t3 - t2, 3), "verify": round(t4 - t3, 3)}}
    atomic_write_json(marker, info)
    log.info("shard %d/%d: %d candidate pairs, %d edges with J >= %g -> %s", i, n_shards, len(pairs), len(kept),
             run.lsh.threshold, npz)
    run.store.close()
    return info


# ----------------------------------------------------------------------------------------------- merge
def clear_index(params: dict[str, Any], basename: str) -> int:
    """Delete every Redis key of one run's index and barrier (not those of a run whose basename merely
    starts with this one); returns how many."""
    return dd.delete_index_keys(dd.redis_client(params), basename, extra=("_dpm_",))


def _load_shards(run: _Run, folder: Path) -> tuple[list[dict[str, Any]], list[tuple[int, int, float]]]:
    markers = sorted(folder.glob("shard-*-of-*.json")) if folder.is_dir() else []
    if not markers:
        raise StageError(f"no finished shard in {folder}: run `dedup-worker --shard I/N` on every machine first "
                         "(or pass --edges-dir where their shard-*.json/.npz files were copied)")
    infos = [read_json(p) for p in markers]
    counts = {x["num_shards"] for x in infos}
    if len(counts) != 1:
        raise StageError(f"{folder} mixes runs with different shard counts {sorted(counts)}: keep one run's files")
    n_shards = counts.pop()
    have = {x["shard"] for x in infos}
    missing = sorted(set(range(n_shards)) - have)
    if missing:
        raise StageError(f"shard(s) {missing} of {n_shards} have not finished (no shard-*.json in {folder})")
    expect = _meta(run, n_shards)
    for x in infos:
        got = {k: x[k] for k in expect}
        if got != expect:
            raise StageError(f"{folder}: shard {x['shard']} was made from other data or settings ({got}) than "
                             f"this config's filter output ({expect})")
    edges: list[tuple[int, int, float]] = []
    for x in sorted(infos, key=lambda x: x["shard"]):
        with np.load(_shard_files(folder, x["shard"], n_shards)[0]) as z:
            edges += zip(z["i"].tolist(), z["j"].tolist(), z["jaccard"].tolist())
    return sorted(infos, key=lambda x: x["shard"]), edges


def run_dedup_merge(cfg: BuildConfig, edges: str | None = None, redis_url: str | None = None) -> dict[str, Any]:
    """Union-find over every shard's verified edges → ``work/dedup/`` exactly as the single-machine stage
    writes it (``removed.npy``, ``duplicates.jsonl``, ``_stage.json`` with the stage fingerprint)."""
    timer = StageTimer("dedup")
    run = _open_run(cfg)
    folder = edges_dir(cfg, run.basename, edges)
    infos, verified = _load_shards(run, folder)
    t0 = time.perf_counter()
    thr = run.lsh.threshold
    if any(e[2] < thr for e in verified):
        raise StageError(f"{folder}: an edge below the threshold {thr}: the shard files were made with another threshold")
    clusters, link = dd.cluster(verified, thr)
    jac = {(i, j): x for i, j, x in verified}
    need = [(root, m) for root, ms in sorted(clusters.items()) for m in ms[1:] if (root, m) not in jac]
    jac.update({(i, j): x for i, j, x in dd.verify_pairs(run.store, need, run.shingle, cfg.dedup.verify_block_docs,
                                                         cfg.num_workers, progress=False)})
    store = run.store
    rows, removed = dd.duplicate_rows(store, clusters, link, lambda root, m: jac[(root, m)])
    store.close()
    merging = len(removed)  # a spanning forest: one merging edge per removed member
    total = lambda k: sum(x[k] for x in infos)  # noqa: E731
    d = cfg.dedup
    info: dict[str, Any] = {
        "enabled": True, "threshold": d.threshold, "num_perm": d.num_perm, "bands": run.lsh.bands,
        "rows": run.lsh.rows, "seed": d.seed, "shingles": f"{run.shingle.unit} {run.shingle.n}-grams",
        "verification": "Jaccard of the shingle-fingerprint sets of every candidate pair, measured by the shard "
                        "owning its larger end; union-find over the edges with J >= threshold",
        "survivor": "lowest input index of each union-find cluster",
        "p_candidate": {str(s): round(dd.candidate_probability(s, run.lsh.bands, run.lsh.rows), 4)
                        for s in (0.5, 0.6, 0.7, 0.75, 0.8, 0.9)},
        "storage": f"redis, {len(infos)} shard workers (dedup-worker + dedup-merge)", "basename": run.basename,
        "documents": len(store), "unsignatured": total("unsignatured"), "candidate_pairs": total("candidate_pairs"),
        "measured_pairs": total("measured_pairs"), "verified_pairs": merging,
        "redundant_edges": len(verified) - merging, "rejected_candidates": total("rejected_candidates"),
        "skipped_candidates": total("candidate_pairs") - total("measured_pairs"), "clusters": len(clusters),
        "removed": len(removed),
        "phase_seconds": {"minhash": max(x["seconds"]["minhash"] for x in infos),
                          "lsh": max(x["seconds"]["insert"] + x["seconds"]["query"] for x in infos),
                          "verify_cluster": round(max(x["seconds"]["verify"] for x in infos)
                                                  + time.perf_counter() - t0, 3)},
        "shards": [{k: x[k] for k in ("shard", "chunks", "signed", "candidate_pairs", "edges", "seconds")}
                   for x in infos]}
    out = _begin(cfg, "dedup")
    atomic_save_npy(out / "removed.npy", np.asarray(sorted(removed), dtype=np.int64))
    write_jsonl_atomic(out / "duplicates.jsonl", rows)
    stats = _finish(cfg, "dedup", timer.finish(len(store), **info))
    if redis_url:
        log.info("dedup-merge: cleared %d Redis keys of '%s'", clear_index(client_params(cfg, redis_url)[0],
                                                                         run.basename), run.basename)
    log.info("dedup-merge: %d shards, %d edges, %d clusters, %d removed", len(infos), len(verified),
             len(clusters), len(removed))
    return stats


def run_clear(cfg: BuildConfig, redis_url: str | None) -> int:
    """Delete this config's run index from Redis (after a crash, or a run with other settings)."""
    run = _open_run(cfg)
    return clear_index(client_params(cfg, redis_url)[0], run.basename)
