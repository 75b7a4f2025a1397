"""The shared Redis index is untrusted input (issue 14): nothing read from it is unpickled, a foreign
member is one line; password and TLS work for the in-build path and the multi-machine workers."""
from __future__ import annotations

import pickle
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import dedup as dd
from data_pipeline.config import DedupConfig


class _Evil:
    """Unpickling this calls open(path, "w"): the marker file appears iff code from Redis ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], tmp_path: Path, client_kwargs: dict) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not found on PATH")
    import redis

    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):  # wait for the port (a plain connect: redis-py would retry with back-off)
        try:
            socket.create_connection(("127.0.0.1", client_kwargs["port"]), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    try:
        if redis.Redis(**client_kwargs).ping():
            return proc
    except redis.RedisError:
        pass
    proc.terminate()
    pytest.skip("redis-server did not start with these options")


def _sig_files(tmp_path: Path, lsh: dd.LshSpec) -> tuple[Path, np.ndarray, np.ndarray]:
    """12 random signatures, documents 3/7 and 5/9 identical (so they share every bucket)."""
    rng = np.random.default_rng(0)
    sigs = rng.integers(0, 2**32, size=(12, lsh.num_perm), dtype=np.uint64).astype(np.uint32)
    sigs[7], sigs[9] = sigs[3], sigs[5]
    active = np.ones(12, bool)
    np.save(tmp_path / "sigs.npy", sigs)
    np.save(tmp_path / "active.npy", active)
    return tmp_path / "sigs.npy", sigs, active


LSH = dd.LshSpec(0.7, 32, 8, 4, 1)


def _insert_and_query(sig_file: Path, storage: dict) -> set:
    """What candidates_redis's two worker processes do, in this process (no spawn start-up cost)."""
    for rank in range(2):
        dd.redis_insert_worker((str(sig_file), storage, LSH, rank, 2))
    return {p for rank in range(2) for p in dd.redis_query_worker((str(sig_file), storage, LSH, rank, 2))}


def _poison(port: int, basename: str, payload: bytes) -> int:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    keys = [k for k in r.scan_iter(match=basename + "_bucket_*") if r.type(k) == b"set"]  # the buckets
    for k in keys:
        r.sadd(k, payload)
    return len(keys)


def test_poisoned_buckets_are_refused_not_unpickled(redis_port, tmp_path):
    from data_pipeline.distributed_dedup import query_own

    sig_file, sigs, active = _sig_files(tmp_path, LSH)
    storage = dd.redis_storage_config("127.0.0.1", redis_port, 0, "poison")
    dd.redis_insert_worker((str(sig_file), storage, LSH, 0, 1))
    index = dd.make_lsh(LSH, storage)
    # clean index: the same pairs as the in-memory LSH
    assert dd.bucket_pairs(index) == dd.candidates_in_memory(sigs, active, LSH) == {(3, 7), (5, 9)}
    marker = tmp_path / "PWNED"
    assert _poison(redis_port, "poison", pickle.dumps(_Evil(marker))) > 0
    with pytest.raises(dd.RedisIndexError, match="did not write"):
        dd.bucket_pairs(index)  # the in-build path (dedup.storage: redis)
    with pytest.raises(dd.RedisIndexError, match="did not write"):
        query_own(index, np.arange(12), sigs)  # the dedup-worker path
    assert not marker.exists()
    assert dd.redis_clear("127.0.0.1", redis_port, 0, "poison") > 0


def test_clear_leaves_other_runs_sharing_a_prefix(redis_port, tmp_path):
    import redis

    sig_file, _, _ = _sig_files(tmp_path, LSH)
    for name in ("run", "run2"):
        dd.redis_insert_worker((str(sig_file), dd.redis_storage_config("127.0.0.1", redis_port, 0, name), LSH, 0, 1))
    r = redis.Redis(host="127.0.0.1", port=redis_port)
    before = r.dbsize()
    n = dd.redis_clear("127.0.0.1", redis_port, 0, "run")
    assert n > 0 and r.dbsize() == before - n and r.dbsize() > 0  # run2's keys are still there
    assert dd.bucket_pairs(dd.make_lsh(LSH, dd.redis_storage_config("127.0.0.1", redis_port, 0, "run2"))) == \
        {(3, 7), (5, 9)}


def test_password_required_and_used(tmp_path, monkeypatch):
    port = _free_port()
    proc = _start(["--port", str(port), "--requirepass", "s3cret"], tmp_path,
                  {"host": "127.0.0.1", "port": port, "password": "s3cret"})
    try:
        cfg = DedupConfig(storage="redis", redis_port=port, redis_password_env="TEST_REDIS_PW")
        monkeypatch.delenv("TEST_REDIS_PW", raising=False)
        with pytest.raises(dd.RedisIndexError, match="refused the login .no password was given.*dedup.redis_password_env"):
            dd.redis_clear("127.0.0.1", port, 0, "x", **dd.redis_auth(cfg))
        monkeypatch.setenv("TEST_REDIS_PW", "wrong")
        with pytest.raises(dd.RedisIndexError, match="refused the login .a wrong password"):
            dd.redis_clear("127.0.0.1", port, 0, "x", **dd.redis_auth(cfg))
        monkeypatch.setenv("TEST_REDIS_PW", "s3cret")
        sig_file, sigs, active = _sig_files(tmp_path, LSH)
        storage = dd.redis_storage_config("127.0.0.1", port, 0, "auth", **dd.redis_auth(cfg))
        assert _insert_and_query(sig_file, storage) == dd.candidates_in_memory(sigs, active, LSH)
        assert dd.redis_clear("127.0.0.1", port, 0, "auth", **dd.redis_auth(cfg)) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_unreachable_redis_is_one_line():
    with pytest.raises(dd.RedisIndexError, match=r"cannot reach Redis at 127.0.0.1:\d+/0: .*start redis-server"):
        dd.redis_clear("127.0.0.1", _free_port(), 0, "x")


def _tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found")
    ca_key, ca, key, csr, cert = (tmp_path / n for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-subj", "/CN=test-ca", "-keyout", str(ca_key), "-out", str(ca))
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
        "-keyout", str(key), "-out", str(csr))
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "2",
        "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


def test_tls_in_build_settings_and_rediss_url(tmp_path, monkeypatch):
    from data_pipeline.config import BuildConfig
    from data_pipeline.distributed_dedup import client_params, redis_params

    ca, cert, key = _tls_files(tmp_path)
    port = _free_port()
    proc = _start(["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                   "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no", "--requirepass", "pw"], tmp_path,
                  {"host": "127.0.0.1", "port": port, "ssl": True, "ssl_ca_certs": str(ca), "password": "pw"})
    try:
        monkeypatch.setenv("REDIS_PASSWORD", "pw")
        d = DedupConfig(storage="redis", redis_port=port, redis_tls=True, redis_ca_certs=str(ca))
        sig_file, sigs, active = _sig_files(tmp_path, LSH)
        storage = dd.redis_storage_config("127.0.0.1", port, 0, "tls", **dd.redis_auth(d))
        assert _insert_and_query(sig_file, storage) == dd.candidates_in_memory(sigs, active, LSH)
        assert dd.redis_clear("127.0.0.1", port, 0, "tls", **dd.redis_auth(d)) > 0
        # the workers' --redis rediss://:password@host:port/db?ssl_ca_certs=... (a TypeError before)
        monkeypatch.delenv("REDIS_PASSWORD")
        url = f"rediss://:pw@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        assert redis_params(url)["ssl"] is True
        params, shown = client_params(BuildConfig(), url)
        assert "pw@" not in shown and ":***@" in shown
        assert dd.redis_client(params).ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
