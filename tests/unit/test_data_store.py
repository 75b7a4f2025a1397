"""The binary document store (UTF-8 texts + offsets): round trip, atomic shards, damage detection, bounded reader."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_pipeline.doc_store import DocStore
from data_pipeline.store import ShardWriter, StoreError, done_shards, iter_shard, meta_path, shard_texts, text_path

TEXTS = ["plain ascii", "naïve café — “quotes”\nsecond line", "emoji 🙂 and CJK 漢字", "\x00nul and \\ backslash \"",
         "tab\there", "x" * 5000]


def _write(folder, texts, shard=2, uid=True):
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(texts), shard):
        w = ShardWriter(folder, s // shard)
        for i in range(s, min(len(texts), s + shard)):
            extra = {"uid": [f"u{i}", i, 1.5, True][i % 4]} if uid else {}
            w.add(10 + i, f"src:{i}", texts[i], **extra)
        w.commit({"n": min(len(texts), s + shard) - s})


def test_round_trip_texts_records_and_positions(tmp_path):
    _write(tmp_path / "s", TEXTS)
    store = DocStore(tmp_path / "s", cache_shards=1)
    assert len(store) == len(TEXTS) and store.shards == [0, 1, 2]
    assert list(store.iter_texts()) == TEXTS and store.texts(1, 5) == TEXTS[1:5]
    recs = list(store)
    assert [r["text"] for r in recs] == TEXTS and [r["i"] for r in recs] == [10 + i for i in range(len(TEXTS))]
    assert [r["uid"] for r in recs] == ["u0", 1, 1.5, True, "u4", 5] and recs[3]["src"] == "src:3"
    for pos in (5, 0, 3, 1, 4, 2):  # random access across shards with a one-shard cache
        assert store.get(pos) == recs[pos] and store.text(pos) == TEXTS[pos]
        assert store.meta(pos) == {k: v for k, v in recs[pos].items() if k != "text"}
    assert len(store._rows) == 1 and len(store._readers) == 1
    assert store.input_index.tolist() == [10 + i for i in range(len(TEXTS))]
    assert [r["text"] for r in iter_shard(tmp_path / "s", 1)] == TEXTS[2:4] == shard_texts(tmp_path / "s", 1)
    # the texts are stored as their UTF-8 bytes, nothing else
    assert text_path(tmp_path / "s", 0).read_bytes() == (TEXTS[0] + TEXTS[1]).encode("utf-8")
    store.close()


def test_aborted_shard_leaves_no_file(tmp_path):
    w = ShardWriter(tmp_path, 0)
    w.add(0, "a", "some text")
    w.abort()
    assert list(tmp_path.iterdir()) == [] and done_shards(tmp_path) == []


def test_damaged_shard_files_are_one_line(tmp_path):
    _write(tmp_path / "s", TEXTS, uid=False)
    f = text_path(tmp_path / "s", 1)
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(StoreError, match="truncated"):
        DocStore(tmp_path / "s")
    _write(tmp_path / "t", TEXTS, uid=False)
    meta_path(tmp_path / "t", 2).unlink()
    with pytest.raises(StoreError, match="missing"):
        DocStore(tmp_path / "t")


def test_empty_shard_and_empty_store(tmp_path):
    w = ShardWriter(tmp_path, 0)
    w.commit({})
    store = DocStore(tmp_path)
    assert len(store) == 0 and list(store) == [] and store.texts(0, 0) == []
    assert np.asarray(store.input_index).shape == (0,)


def test_scan_names_matches_path_glob(tmp_path: Path) -> None:
    """The streamed folder scan keeps ``Path.glob``'s matches (hidden temporary files included, case-sensitive,
    folders too) and a missing folder has none."""
    from data_pipeline.store import scan_names

    names = ["docs-00000.done.json", "docs-00012.done.json", "docs-00003.idx.npy", ".docs-00004.done.json.tmp-ab.json",
             "DOCS-00005.done.json", "sig-0.npy.tmp-x.npy", "docs-00007.done.json.bak", "x.tmp"]
    for n in names:
        (tmp_path / n).write_text("")
    (tmp_path / "docs-00009.done.json").mkdir()
    for pattern in ("docs-*.done.json", "*.tmp*", "*", "docs-0000?.*"):
        assert sorted(scan_names(tmp_path, pattern)) == sorted(p.name for p in tmp_path.glob(pattern)), pattern
    assert done_shards(tmp_path) == [0, 9, 12]
    assert done_shards(tmp_path / "missing") == [] and list(scan_names(tmp_path / "missing", "*")) == []
