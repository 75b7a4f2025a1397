"""``executor: ray``: the LSH band shuffle equals ``band_pairs``; a build on a real two-node local Ray
cluster (``ray start --head`` + ``ray start --address``) is byte-identical to the local build."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from data_pipeline.config import config_from_dict
from data_pipeline.planted import planted_corpus, real_words
from data_pipeline.stages import build
from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(SHARED_DATA)
GPT2 = DATA / "tokenizers" / "gpt2"
CORPUS = DATA / "corpus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _session_pids(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # zombies are gone, only not yet reaped
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop the processes this test started: every process of their sessions (ray start --block and the
    Ray services it spawned), SIGTERM then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            for pid in _session_pids(p.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 3
        while time.time() < deadline and any(_session_pids(p.pid) for p in procs):
            time.sleep(0.5)
    for p in procs:
        p.wait(timeout=10)


@pytest.fixture()
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip("the `ray` command is not installed next to this python")
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    common = dict(env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [subprocess.Popen([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=1",
                               "--include-dashboard=false", f"--temp-dir={tmp}", "--disable-usage-stats",
                               "--block"], **common)]
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.time() + 120
        while not _listening(port):  # the GCS is up
            if time.time() > deadline or procs[0].poll() is not None:
                pytest.fail("the Ray head did not start")
            time.sleep(1)
        procs.append(subprocess.Popen([str(ray_bin), "start", f"--address={address}", "--num-cpus=1", "--block"],
                                      **common))
        ray.init(address=address, log_to_driver=False)
        while len([x for x in ray.nodes() if x["Alive"]]) < 2:  # the second node joined
            if time.time() > deadline or procs[1].poll() is not None:
                pytest.fail("the second Ray node did not join")
            time.sleep(1)
        yield address
    finally:
        ray.shutdown()
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _cfg(tmp: Path, src: Path, name: str, executor: str, address: str = "auto") -> object:
    return config_from_dict({
        "output_dir": str(tmp / name), "sources": [{"type": "jsonl", "path": str(src)}],
        "workers": 2, "shard_size": 40, "progress": False, "executor": executor,
        "ray": {"address": address, "lsh_partitions": 3},
        "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                      "merges_file": str(GPT2 / "gpt2-merges.txt")},
        "length": {"min_tokens": 16}, "dedup": {"chunk_size": 32, "exact": True}})


def test_ray_build_equals_local_build(tmp_path, ray_cluster):
    if not (CORPUS / "botchan.txt").exists() or not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip(f"shared data not found under {DATA}")
    import ray

    words = real_words([CORPUS / "botchan.txt", CORPUS / "tinyshakespeare.txt"])
    docs, _ = planted_corpus(words, families=30, variants=3, max_edit_frac=0.08, seed=4)
    docs += [docs[5], "{not json", docs[50]]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join((json.dumps({"text": t}) if not t.startswith("{") else t) + "\n" for t in docs))
    out_l, st_l = build(_cfg(tmp_path, src, "local", "local"))
    out_r, st_r = build(_cfg(tmp_path, src, "ray", "ray", ray_cluster))
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 2  # the build ran on the 2-node cluster
    for name in ("documents.jsonl", "duplicates.jsonl", "rejects.jsonl", "contaminated.jsonl",
                 "gpt_text_document.bin", "gpt_text_document.idx"):
        assert (out_r / name).read_bytes() == (out_l / name).read_bytes(), name
    assert st_r["documents"] == st_l["documents"] and st_l["documents"]["duplicates"] >= 30
    assert st_r["dedup"]["executor"] == "ray" and st_l["dedup"]["executor"] == "local"
    for k in ("candidate_pairs", "measured_pairs", "verified_pairs", "clusters", "removed", "exact_duplicates",
              "skipped_candidates", "rejected_candidates", "unsignatured"):
        assert st_r["dedup"][k] == st_l["dedup"][k], k


def test_unreachable_cluster_fails_fast_before_any_work(tmp_path):
    pytest.importorskip("ray")
    from data_pipeline.config import ConfigError

    cfg = config_from_dict({"output_dir": str(tmp_path / "o"), "sources": [{"type": "default"}], "executor": "ray",
                            "ray": {"address": f"127.0.0.1:{_free_port()}"}, "progress": False})
    t = time.time()
    with pytest.raises(ConfigError, match="no Ray cluster at ray.address"):
        build(cfg)
    assert time.time() - t < 30 and not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="executor must be one of"):
        config_from_dict({"sources": [{"type": "default"}], "executor": "spark"})
