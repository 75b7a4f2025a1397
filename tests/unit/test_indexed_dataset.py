"""MMapIndexedDataset: byte layout against an independent struct-based writer, round trips, clear errors."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_ds_suite.core.indexed_dataset import (
    HEADER_SIZE,
    IndexedDatasetError,
    MMapIndexedDataset,
    read_index_header,
)
from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype


def reference_write(prefix: Path, docs: list[list[np.ndarray]], dtype: np.dtype, code: int) -> None:
    """Independent writer following megatron.md §7.2 field by field (struct + raw bytes)."""
    items = [it for doc in docs for it in doc]
    sizes = [len(it) for it in items]
    pointers, p = [], 0
    for s in sizes:
        pointers.append(p)
        p += s * np.dtype(dtype).itemsize
    doc_idx, n = [0], 0
    for doc in docs:
        n += len(doc)
        doc_idx.append(n)
    with open(f"{prefix}.bin", "wb") as f:
        for it in items:
            f.write(np.asarray(it, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def random_docs(seed: int, n_docs: int, vocab: int, max_sent: int = 4, max_len: int = 40) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, vocab, rng.integers(1, max_len)) for _ in range(rng.integers(1, max_sent + 1))]
        for _ in range(n_docs)
    ]


def write_ours(prefix: Path, docs: list[list[np.ndarray]], dtype: np.dtype) -> None:
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        for doc in docs:
            for it in doc:
                b.add_item(it)
            b.end_document()


def test_best_dtype_thresholds() -> None:
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(250_000) == np.int32
    with pytest.raises(ValueError):
        best_dtype(0)


@pytest.mark.parametrize("vocab,code", [(50257, 8), (120_000, 4)])
def test_bytes_identical_to_reference_writer(tmp_path: Path, vocab: int, code: int) -> None:
    docs = random_docs(1, 50, vocab)
    dtype = best_dtype(vocab)
    write_ours(tmp_path / "ours", docs, dtype)
    reference_write(tmp_path / "ref", docs, dtype, code)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_header_layout_byte_level(tmp_path: Path) -> None:
    docs = [[np.array([1, 2, 3]), np.array([65000])], [np.array([7, 8])], [np.array([], dtype=np.int64)]]
    write_ours(tmp_path / "d", docs, np.uint16)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9)[0] == 1
    assert raw[17] == 8
    n, d = struct.unpack_from("<QQ", raw, 18)
    assert (n, d) == (4, 4)
    assert HEADER_SIZE == 34
    assert list(struct.unpack_from("<4i", raw, 34)) == [3, 1, 2, 0]
    assert list(struct.unpack_from("<4q", raw, 34 + 16)) == [0, 6, 8, 12]
    assert list(struct.unpack_from("<4q", raw, 34 + 16 + 32)) == [0, 2, 3, 4]
    assert len(raw) == 34 + 4 * 4 + 8 * 4 + 8 * 4
    assert (tmp_path / "d.bin").read_bytes() == np.array([1, 2, 3, 65000, 7, 8], dtype="<u2").tobytes()


@pytest.mark.parametrize("vocab", [50257, 200_000])
def test_round_trip_reads_reference_files(tmp_path: Path, vocab: int) -> None:
    docs = random_docs(2, 200, vocab)
    dtype = best_dtype(vocab)
    reference_write(tmp_path / "ref", docs, dtype, 8 if dtype == np.uint16 else 4)
    ds = MMapIndexedDataset(tmp_path / "ref", verify=True)
    items = [it for doc in docs for it in doc]
    assert len(ds) == len(items)
    assert ds.dtype == dtype
    assert ds.num_documents == 200
    assert ds.num_tokens == sum(len(it) for it in items)
    np.testing.assert_array_equal(ds.sizes, [len(it) for it in items])
    expected_doc_idx = np.cumsum([0] + [len(doc) for doc in docs])
    np.testing.assert_array_equal(ds.doc_idx, expected_doc_idx)
    for i in (0, 1, len(items) // 2, len(items) - 1, -1):
        np.testing.assert_array_equal(ds[i], items[i])
    it = items[5]
    np.testing.assert_array_equal(ds.get(5, offset=1, length=len(it) - 2), it[1:-1])
    np.testing.assert_array_equal(ds.get(5, offset=2), it[2:])
    sl = ds[3:6]
    assert len(sl) == 3 and all(np.array_equal(a, b) for a, b in zip(sl, items[3:6]))
    doc7 = ds.document(7)
    assert len(doc7) == len(docs[7]) and all(np.array_equal(a, b) for a, b in zip(doc7, docs[7]))
    with pytest.raises(IndexError):
        ds[len(items)]
    with pytest.raises(IndexError):
        ds.get(5, offset=len(it), length=1)
    # pickling re-opens by path (DataLoader workers)
    ds2 = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 1000
    np.testing.assert_array_equal(ds2[10], items[10])


def test_empty_dataset_and_empty_documents(tmp_path: Path) -> None:
    with MMapIndexedDatasetBuilder(tmp_path / "e", np.uint16):
        pass
    ds = MMapIndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
    np.testing.assert_array_equal(ds.doc_idx, [0])
    b = MMapIndexedDatasetBuilder(tmp_path / "f", np.uint16)
    b.end_document()  # an empty document is recorded (Megatron semantics)
    b.add_item([4, 5])
    b.finalize()  # closes the trailing open document
    ds = MMapIndexedDataset(tmp_path / "f")
    np.testing.assert_array_equal(ds.doc_idx, [0, 0, 1])
    np.testing.assert_array_equal(ds[0], [4, 5])


def test_streaming_builder_keeps_tokens_out_of_memory(tmp_path: Path) -> None:
    b = MMapIndexedDatasetBuilder(tmp_path / "s", np.uint16)
    for _ in range(10):
        b.add_item(np.arange(1000))
    tmp_bin = b._tmp_bin  # noqa: SLF001 - tokens are on disk before finalize
    b._bin.flush()  # noqa: SLF001
    assert tmp_bin.stat().st_size == 10 * 1000 * 2
    assert not (tmp_path / "s.bin").exists() and not (tmp_path / "s.idx").exists()
    b.finalize()
    assert not tmp_bin.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]


def test_exception_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with MMapIndexedDatasetBuilder(tmp_path / "x", np.uint16) as b:
            b.add_item([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_out_of_range_tokens_rejected(tmp_path: Path) -> None:
    with MMapIndexedDatasetBuilder(tmp_path / "x", np.uint16) as b:
        with pytest.raises(IndexedDatasetError, match="out of range"):
            b.add_item([1, 70000])
        with pytest.raises(IndexedDatasetError, match="1-D"):
            b.add_item([[1, 2]])
        with pytest.raises(IndexedDatasetError, match="integers"):
            b.add_item([1.5])
        b.abort()
    assert list(tmp_path.iterdir()) == []


def _good(tmp_path: Path) -> Path:
    write_ours(tmp_path / "g", random_docs(3, 10, 1000), np.uint16)
    return tmp_path / "g"


def test_clear_errors_for_garbled_files(tmp_path: Path) -> None:
    with pytest.raises(IndexedDatasetError, match="does not exist"):
        MMapIndexedDataset(tmp_path / "nothing")
    p = _good(tmp_path)
    raw = Path(f"{p}.idx").read_bytes()
    n, d = struct.unpack_from("<QQ", raw, 18)

    def corrupt(data: bytes) -> None:
        Path(f"{p}.idx").write_bytes(data)

    corrupt(b"XXXXXXXXX" + raw[9:])
    with pytest.raises(IndexedDatasetError, match="bad magic"):
        MMapIndexedDataset(p)
    corrupt(b"TNTIDX\x00\x00" + raw[8:])
    with pytest.raises(IndexedDatasetError, match="legacy"):
        MMapIndexedDataset(p)
    corrupt(raw[:20])
    with pytest.raises(IndexedDatasetError, match="truncated"):
        MMapIndexedDataset(p)
    corrupt(raw[:-8])
    with pytest.raises(IndexedDatasetError, match="truncated"):
        MMapIndexedDataset(p)
    corrupt(raw + b"\x00" * 3)
    with pytest.raises(IndexedDatasetError, match="trailing"):
        MMapIndexedDataset(p)
    corrupt(raw + b"\x00" * n)  # HEAD's optional int8 'modes' array after doc_idx: accepted, ignored
    assert len(MMapIndexedDataset(p)) == n
    corrupt(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    with pytest.raises(IndexedDatasetError, match="version"):
        MMapIndexedDataset(p)
    corrupt(raw[:17] + bytes([99]) + raw[18:])
    with pytest.raises(IndexedDatasetError, match="dtype code"):
        MMapIndexedDataset(p)
    # doc_idx not ending at N
    bad = bytearray(raw)
    struct.pack_into("<q", bad, len(raw) - 8, n + 1)
    corrupt(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="doc_idx"):
        MMapIndexedDataset(p)
    # doc_idx decreasing
    bad = bytearray(raw)
    struct.pack_into("<q", bad, 34 + 12 * n + 8, n)
    corrupt(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="non-decreasing"):
        MMapIndexedDataset(p)
    # sizes disagree with the .bin
    bad = bytearray(raw)
    struct.pack_into("<i", bad, 34, struct.unpack_from("<i", raw, 34)[0] + 1)
    corrupt(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="bytes but"):
        MMapIndexedDataset(p)
    # a pointer off by one item, sizes intact (first/last pointer fine): caught on every open (issue 14)
    corrupt(raw)
    bad = bytearray(raw)
    struct.pack_into("<q", bad, 34 + 4 * n + 8, struct.unpack_from("<q", raw, 34 + 4 * n + 8)[0] + 2)
    corrupt(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="pointer of item 1 is .* running sum"):
        MMapIndexedDataset(p)
    with pytest.raises(IndexedDatasetError, match="running sum"):
        MMapIndexedDataset(p, verify=True)
    corrupt(raw)
    Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match="truncated or mismatched"):
        MMapIndexedDataset(p)
    Path(f"{p}.bin").unlink()
    with pytest.raises(IndexedDatasetError, match="no data file"):
        MMapIndexedDataset(p)
    assert read_index_header(Path(f"{p}.idx")) == (np.dtype(np.uint16), n, d)


def test_pointer_check_blocks_agree_with_the_running_sum():
    """The blockwise pointer check (issue 14) against a plain cumsum, across block boundaries."""
    from megatron_ds_suite.core.indexed_dataset import _first_bad_pointer

    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 50, size=1000).astype(np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)])
    for block in (1, 7, 1000, 4096):
        assert _first_bad_pointer(sizes, pointers, 2, block) is None
        for k in (1, 6, 7, 999):
            bad = pointers.copy()
            bad[k] += 2
            assert _first_bad_pointer(sizes, bad, 2, block) == k


def test_add_documents_equals_one_item_per_document(tmp_path: Path) -> None:
    """The bulk path export uses writes the same bytes as add_item + end_document per document, also after
    documents added one by one, and refuses ids that do not split or do not fit the dtype."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, int(n)).astype(np.uint16) for n in rng.integers(0, 40, 50)]
    ref = MMapIndexedDatasetBuilder(tmp_path / "ref", np.uint16)
    for d in docs:
        ref.add_item(d)
        ref.end_document()
    ref.finalize()
    bulk = MMapIndexedDatasetBuilder(tmp_path / "bulk", np.uint16)
    bulk.add_item(docs[0])
    bulk.end_document()
    bulk.add_documents(np.concatenate(docs[1:30]), np.asarray([len(d) for d in docs[1:30]]))
    bulk.add_documents(np.concatenate(docs[30:]), np.asarray([len(d) for d in docs[30:]]))
    bulk.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    b = MMapIndexedDatasetBuilder(tmp_path / "bad", np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not split into sizes"):
        b.add_documents(np.arange(5, dtype=np.int64), np.asarray([2, 2]))
    with pytest.raises(IndexedDatasetError, match="out of range"):
        b.add_documents(np.asarray([70000], dtype=np.int64), np.asarray([1]))
    b.abort()


def test_add_item_documents_equals_add_document(tmp_path: Path) -> None:
    """The bulk path of the BERT export (sentences as items, documents of several, some of none) writes the same
    bytes as add_document per document, and refuses item counts that do not add up."""
    rng = np.random.default_rng(1)
    docs = [[rng.integers(1, 60000, int(n)).astype(np.int64) for n in rng.integers(1, 9, int(k))]
            for k in rng.integers(0, 5, 40)]
    ref = MMapIndexedDatasetBuilder(tmp_path / "ref", np.uint16)
    for d in docs:
        ref.add_document(d)
    ref.finalize()
    bulk = MMapIndexedDatasetBuilder(tmp_path / "bulk", np.uint16)
    bulk.add_document(docs[0])
    for part in (docs[1:25], docs[25:]):
        items = [it for d in part for it in d]
        bulk.add_item_documents(np.concatenate(items), np.asarray([len(it) for it in items]),
                                np.asarray([len(d) for d in part]))
    bulk.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    b = MMapIndexedDatasetBuilder(tmp_path / "bad", np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not split into documents"):
        b.add_item_documents(np.arange(4, dtype=np.int64), np.asarray([2, 2]), np.asarray([1]))
    b.abort()
