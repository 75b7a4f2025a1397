"""Dedup across several machines: N `dedup-worker` OS processes share one datasketch LSH index in a real
redis-server on loopback, `dedup-merge` joins their verified edges; the result must equal the in-memory
single-machine build of the same planted near-duplicate corpus."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from data_pipeline.config import load_config
from data_pipeline.planted import planted_corpus, real_words
from data_pipeline.stages import build, run_stage, work_dir
from data_pipeline.store import DocStore

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".." / "shared" / "data"
CORPUS = DATA / "corpus"
GPT2 = DATA / "tokenizers" / "gpt2"


@pytest.fixture()
def redis_url(redis_port):
    return f"redis://127.0.0.1:{redis_port}/0"


def _config(tmp_path: Path, docs: list[str], out: str) -> Path:
    src = tmp_path / "docs.jsonl"
    if not src.exists():
        with open(src, "w", encoding="utf-8") as f:
            for k, t in enumerate(docs):
                f.write(json.dumps({"id": f"d{k}", "text": t}) + "\n")
    cfg = {"output_dir": str(tmp_path / out), "sources": [{"type": "jsonl", "path": str(src), "id_field": "id"}],
           "workers": 1, "shard_size": 40, "progress": False,
           "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                         "merges_file": str(GPT2 / "gpt2-merges.txt")},
           "length": {"min_tokens": 16}, "dedup": {"threshold": 0.7, "num_perm": 128, "chunk_size": 16}}
    p = tmp_path / f"{out}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "data_pipeline", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ref_jaccard(a: str, b: str, n: int = 5) -> float:
    """Independent reference: lower-cased \\w+ word n-gram sets."""
    ua, ub = re.findall(r"\w+", a.lower()), re.findall(r"\w+", b.lower())
    sa = {tuple(ua[i:i + n]) for i in range(len(ua) - n + 1)}
    sb = {tuple(ub[i:i + n]) for i in range(len(ub) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def test_three_machines_equal_single_machine(tmp_path, redis_url):
    if not (CORPUS / "botchan.txt").exists() or not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip(f"shared data not found under {DATA}")
    import redis

    words = real_words([CORPUS / "botchan.txt", CORPUS / "tinyshakespeare.txt"])
    docs, _ = planted_corpus(words, families=30, variants=4, max_edit_frac=0.08, seed=5)
    docs += [docs[3], docs[70], docs[3]]  # exact copies, far from their originals (other chunks/shards)
    # reference: the single-machine in-memory build
    ref_cfg = load_config(_config(tmp_path, docs, "ref"))
    ref_out, ref_stats = build(ref_cfg)
    assert ref_stats["documents"]["duplicates"] >= 30  # the planted families really collapse
    # the machines: their own copy of the finished ingest/tokenizer/filter stages
    cfg_path = _config(tmp_path, docs, "multi")
    cfg = load_config(cfg_path)
    for stage in ("ingest", "tokenizer", "filter"):
        run_stage(cfg, stage)
    n = 3
    procs = [_cli("dedup-worker", "--config", str(cfg_path), "--shard", f"{i}/{n}", "--redis", redis_url,
                  "--barrier-timeout", "60") for i in range(n)]  # concurrent OS processes
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-2000:]
    assert redis.Redis.from_url(redis_url).dbsize() > 0  # the shared index lived in Redis
    p = _cli("dedup-merge", "--config", str(cfg_path), "--redis", redis_url)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0, e[-2000:]
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # merge cleared the run's keys
    out, stats = build(cfg)  # reuses ingest/tokenizer/filter and the merged dedup, runs export
    assert [k for k, s in stats["stages"].items() if not s["reused"]] == ["export"]
    # identical result: clusters, links, survivors, kept documents
    ref_dup = (ref_out / "duplicates.jsonl").read_text()
    assert (out / "duplicates.jsonl").read_text() == ref_dup
    np.testing.assert_array_equal(np.load(work_dir(cfg, "dedup") / "removed.npy"),
                                  np.load(work_dir(ref_cfg, "dedup") / "removed.npy"))
    assert (out / "documents.jsonl").read_text() == (ref_out / "documents.jsonl").read_text()
    assert stats["documents"] == ref_stats["documents"]
    d, rd = stats["dedup"], ref_stats["dedup"]
    # the shards' candidate sets partition the single-machine candidate set
    assert d["candidate_pairs"] == rd["candidate_pairs"] == d["measured_pairs"]
    assert d["clusters"] == rd["clusters"] and d["removed"] == rd["removed"] == d["verified_pairs"]
    assert sum(s["signed"] for s in d["shards"]) == rd["documents"] - rd["unsignatured"]
    assert all(s["candidate_pairs"] > 0 for s in d["shards"])
    # every edge a shard wrote is a measured Jaccard >= threshold, equal to an independent reference
    store = DocStore(work_dir(cfg, "filter"))
    shard_dir = next((cfg.out / "work" / "dedup-shards").iterdir())
    n_edges = 0
    for f in sorted(shard_dir.glob("*.npz")):
        z = np.load(f)
        for i, j, jac in zip(z["i"].tolist(), z["j"].tolist(), z["jaccard"].tolist()):
            assert i < j and jac >= 0.7
            assert jac == pytest.approx(_ref_jaccard(store.get(i)["text"], store.get(j)["text"]), abs=1e-12)
            n_edges += 1
    store.close()
    assert n_edges == d["verified_pairs"] + d["redundant_edges"] >= d["removed"]
    dups = [json.loads(x) for x in ref_dup.splitlines()]
    assert any(r["jaccard"] == 1.0 for c in dups for r in c["removed"])  # the exact copies were found

    # a missing shard: the barrier times out with one clear line, exit code 2
    p = _cli("dedup-worker", "--config", str(cfg_path), "--shard", "0/2", "--redis", redis_url,
             "--barrier-timeout", "0.5", "dedup.basename=lonely")
    o, e = p.communicate(timeout=60)
    assert p.returncode == 2 and "1/2 shards" in e and "missing shard(s) [1]" in e, e[-2000:]
