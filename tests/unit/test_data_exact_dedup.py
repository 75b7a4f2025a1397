"""Exact dedup before MinHash, users' ids in documents.jsonl, and export reusing the filter's token ids."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.config import config_from_dict
from data_pipeline.dedup.exact import exact_representatives, text_keys
from data_pipeline.doc_store import DocStore
from data_pipeline.planted import planted_corpus, real_words
from data_pipeline.stages import build, run_stage, work_dir
from tests.helpers.distributed import SHARED_DATA

DATA = Path(SHARED_DATA)
GPT2 = DATA / "tokenizers" / "gpt2"
CORPUS = DATA / "corpus"


def test_exact_representatives_match_dict_reference():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 6, size=(500, 2)).astype(np.uint64)  # many collisions on purpose
    first: dict[tuple[int, int], int] = {}
    ref = [first.setdefault((int(a), int(b)), p) for p, (a, b) in enumerate(keys)]
    assert exact_representatives(keys).tolist() == ref
    assert exact_representatives(keys[:1]).tolist() == [0]


def _cfg(tmp: Path, src: Path, name: str, exact: bool) -> object:
    return config_from_dict({
        "output_dir": str(tmp / name), "sources": [{"type": "jsonl", "path": str(src), "id_field": "uid"}],
        "workers": 2, "shard_size": 40, "progress": False,
        "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                      "merges_file": str(GPT2 / "gpt2-merges.txt")},
        "length": {"min_tokens": 16}, "dedup": {"chunk_size": 16, "exact": exact}})


def test_exact_first_keeps_the_same_documents(tmp_path):
    if not (CORPUS / "botchan.txt").exists() or not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip(f"shared data not found under {DATA}")
    words = real_words([CORPUS / "botchan.txt", CORPUS / "tinyshakespeare.txt"])
    docs, _ = planted_corpus(words, families=25, variants=3, max_edit_frac=0.08, seed=3)
    docs += [docs[3], docs[40], docs[3], "  " + docs[7].replace(" ", "  ") + "\n"]  # the last: equal once cleaned
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"uid": 1000 + k, "text": t}) + "\n" for k, t in enumerate(docs)))
    out_e, st_e = build(_cfg(tmp_path, src, "exact", True))
    out_f, st_f = build(_cfg(tmp_path, src, "fuzzy", False))
    # independent count of exact copies among the documents that passed the length filter
    store = DocStore(work_dir(_cfg(tmp_path, src, "exact", True), "filter"))
    texts = [r["text"] for r in store]
    cached = text_keys(store)  # the filter's key files, equal to hashing the texts again
    for f in store.folder.glob("*.key.npy"):
        f.unlink()
    np.testing.assert_array_equal(text_keys(store), cached)
    copies = len(texts) - len(set(texts))
    assert copies >= 4
    assert st_e["dedup"]["exact_duplicates"] == copies and st_f["dedup"]["exact_duplicates"] == 0
    assert st_e["dedup"]["exact"]["duplicates"] == copies
    assert st_e["dedup"]["fuzzy_removed"] == st_e["documents"]["duplicates"] - copies
    assert st_e["dedup"]["candidate_pairs"] < st_f["dedup"]["candidate_pairs"]  # copies never reach MinHash
    # the same kept documents, byte for byte, and the same removed set
    for name in ("documents.jsonl", "gpt_text_document.bin", "gpt_text_document.idx"):
        assert (out_e / name).read_bytes() == (out_f / name).read_bytes(), name
    assert st_e["documents"] == st_f["documents"] and st_e["documents"]["reconciles"]
    dups = [json.loads(x) for x in (out_e / "duplicates.jsonl").read_text().splitlines()]
    removed = {r["i"]: r for c in dups for r in c["removed"]}
    assert {len(docs) - 4, len(docs) - 2, len(docs) - 1} <= set(removed)
    assert removed[len(docs) - 2]["linked_via"] == 3 and removed[len(docs) - 2]["link_jaccard"] == 1.0
    # users' ids: "id" is the user's id (an int here, kept as is); provenance in "source"
    rows = [json.loads(x) for x in (out_e / "documents.jsonl").read_text().splitlines()]
    assert all(r["id"] == 1000 + r["i"] for r in rows)
    assert all(r["source"] == f"{src}:{r['i'] + 1}" for r in rows)


def test_export_reuses_filter_token_ids(tmp_path):
    """The cached ids (filter) give the same .bin/.idx as tokenizing again in export."""
    if not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip(f"shared data not found under {DATA}")
    src = tmp_path / "d.jsonl"
    words = (CORPUS / "botchan.txt").read_text(encoding="utf-8").split()
    src.write_text("".join(json.dumps({"text": " ".join(words[k * 50:k * 50 + 20 + k % 60])}) + "\n"
                           for k in range(120)))
    cfg = _cfg(tmp_path, src, "c", False)
    out, _ = build(cfg)
    cached = [(out / f).read_bytes() for f in ("gpt_text_document.bin", "gpt_text_document.idx")]
    files = sorted(work_dir(cfg, "filter").glob("*.tokoff.npy"))
    assert len(files) == 3
    for f in files:  # an older filter output without the token files: export tokenizes again
        f.unlink()
    run_stage(cfg, "export")
    assert [(out / f).read_bytes() for f in ("gpt_text_document.bin", "gpt_text_document.idx")] == cached
