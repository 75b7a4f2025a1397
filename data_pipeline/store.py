"""Sharded document stores between stages: UTF-8 texts + offsets, random access, atomic resumable shards.

A store is a folder of shards. Shard ``docs-00000`` of the stage that writes the texts (ingest) is:

* ``docs-00000.txt``: the cleaned texts, UTF-8, concatenated (no separator, no escaping);
* ``docs-00000.meta.jsonl``: per document one JSON line ``{"src": source id[, "uid": user id]}``;
* ``docs-00000.idx.npy``: int64 ``[n, 5]`` = (input index, text byte offset, text byte length, meta byte
  offset, meta byte length), rows in file order (offsets increasing);
* ``docs-00000.done.json``: the stage's counts for the shard and ``"files"``: the size and CRC-32 of every file
  of the shard (:mod:`data_pipeline.shard_sums`), written last (:func:`seal_shard`): the completion marker.

A document's text is one slice of the ``.txt`` file decoded as UTF-8 (read through ``mmap``): no stage
encodes or decodes JSON for a text (``docs/data_format.md`` §5). A later stage's store may hold only the
indexes, pointing into an earlier store's shard files (``_text_from.json`` names that folder relative to the
store's own, so a copied output folder reads its own texts: the filter keeps its documents' texts where ingest
wrote them).

Every read is checked: a shard's files against the checksums of its marker (once per reader, when the file is
first read: :class:`ShardCheck`), every index row against the sizes of the files it points into
(:func:`load_index`), a missing or unreadable work file is one :class:`StoreError` line naming the file and
``build --force``.

Opening a store reads only each shard's row count (:class:`DocStore`); a shard's index is loaded when a
document of it is read, and only a few are kept, so the reader's memory does not grow with the corpus.

Every file is written under a temporary name and ``os.replace``-d into place; a shard's ``.done.json``
(its counts) is written last and is the shard's completion marker, so a crash leaves either a finished
shard or nothing that counts (the ``.txt`` and ``.meta.jsonl`` of an aborted shard are never renamed).
"""
from __future__ import annotations

import fnmatch
import io
import json
import mmap
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.config import ConfigError
from data_pipeline.files import atomic_save_npy, atomic_write_json, read_json
from data_pipeline.shard_sums import ALGORITHM, SummingFile, data_sum, file_sum, mismatch
from megatron_ds_suite.core import atomic

#: the shard layout written by :class:`ShardWriter` (part of the ingest stage's fingerprint): v2 added the files'
#: checksums to the completion markers and made ``_text_from.json`` relative
STORE_FORMAT = f"utf8-offsets-v2-{ALGORITHM}"
#: columns of a shard index row
COL_I, COL_OFF, COL_LEN, COL_MOFF, COL_MLEN = range(5)


def shard_name(k: int) -> str:
    return f"docs-{k:05d}"


def text_path(folder: Path, k: int) -> Path:
    return folder / f"{shard_name(k)}.txt"


def meta_path(folder: Path, k: int) -> Path:
    return folder / f"{shard_name(k)}.meta.jsonl"


def index_path(folder: Path, k: int) -> Path:
    return folder / f"{shard_name(k)}.idx.npy"


def done_path(folder: Path, k: int) -> Path:
    """Shard ``k``'s completion marker."""
    return folder / f"{shard_name(k)}.done.json"


def seal_shard(folder: Path, k: int, counts: dict[str, Any], sums: dict[str, list[int]] | None = None,
               others: Iterable[str] = ()) -> None:
    """Publish shard ``k``: its marker ``docs-K.done.json`` = ``counts`` + ``"files"``: ``[bytes, crc32]`` per file
    suffix, from ``sums`` (summed while written) and by reading back the files of the suffixes ``others``.
    Written last: the shard's completion marker."""
    files = {sfx: file_sum(folder / f"{shard_name(k)}{sfx}") for sfx in others}
    files.update(sums or {})
    atomic_write_json(done_path(folder, k), {**counts, "files": files})


class ShardWriter:
    """Writes one shard's texts, metadata and index; :meth:`commit` publishes it with its counts."""

    def __init__(self, folder: Path, k: int):
        self.folder, self.k = folder, k
        self._files = [atomic.atomic_open(text_path(folder, k), "wb"),  # hidden temporary files until commit
                       atomic.atomic_open(meta_path(folder, k), "wb")]
        self.text_f, self.meta_f = (SummingFile(f.__enter__()) for f in self._files)
        self.index: list[tuple[int, int, int, int, int]] = []
        self.offset = self.meta_offset = 0

    def add(self, i: int, src: str, text: str, **extra: Any) -> None:
        data = text.encode("utf-8")
        meta = json.dumps({"src": src, **extra}, ensure_ascii=False).encode("utf-8") + b"\n"
        self.text_f.write(data)
        self.meta_f.write(meta)
        self.index.append((i, self.offset, len(data), self.meta_offset, len(meta)))
        self.offset += len(data)
        self.meta_offset += len(meta)

    def commit(self, counts: dict[str, Any], others: Iterable[str] = ()) -> None:
        """Publish the shard with ``counts``; ``others``: suffixes of further files of the shard already written
        (their checksums go in the marker too)."""
        for f in self._files:
            f.__exit__(None, None, None)  # fsync, rename into place
        idx = atomic_save_npy(index_path(self.folder, self.k), np.asarray(self.index, dtype=np.int64).reshape(-1, 5))
        seal_shard(self.folder, self.k, counts, {".txt": self.text_f.sum(), ".meta.jsonl": self.meta_f.sum(),
                                                 ".idx.npy": idx}, others)

    def abort(self) -> None:
        stop = RuntimeError("shard aborted")
        for f in self._files:
            f.__exit__(type(stop), stop, None)  # closes and removes the temporary file


def scan_names(folder: Path, pattern: str) -> Iterator[str]:
    """Names of the entries of ``folder`` matching the shell ``pattern`` (case-sensitive, as ``Path.glob`` on
    POSIX), read as a stream: ``Path.glob`` of Python 3.11 lists the whole folder first (~200 bytes per entry:
    +5 MiB on a driver for a 5,000-shard store, +35 MiB at the 174 GB corpus's 38,000). None if no folder."""
    if not folder.is_dir():
        return
    match = re.compile(fnmatch.translate(pattern)).match
    with os.scandir(folder) as entries:
        for e in entries:
            if match(e.name):
                yield e.name


def done_shards(folder: Path) -> list[int]:
    return sorted(int(name[5:10]) for name in scan_names(folder, "docs-*.done.json"))


#: what a damaged finished store's error line tells the user
REBUILD = "the finished stage output was damaged; rerun with `build --force` (it rebuilds the work files)"


def shard_counts(folder: Path, k: int) -> dict[str, Any]:
    """Shard ``k``'s completion marker: the stage's counts and ``"files"`` (one-line :class:`StoreError` when it is
    missing or not a JSON object)."""
    p = done_path(folder, k)
    try:
        rec = read_json(p)
    except FileNotFoundError:
        raise StoreError(f"{p} is missing: {REBUILD}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"{p} is damaged (not JSON: {e}): {REBUILD}") from None
    if not isinstance(rec, dict):
        raise StoreError(f"{p} is damaged (a JSON {type(rec).__name__}, not an object): {REBUILD}")
    return rec


class ShardCheck:
    """Checks the files of shards against the checksums of their completion markers, each file once (a reader
    holds one: the first read of a file checks it, later reads trust it)."""

    def __init__(self) -> None:
        self._files: dict[tuple[str, int], dict[str, Any]] = {}
        self._checked: set[tuple[str, int, str]] = set()

    def _recorded(self, folder: Path, k: int, suffix: str) -> Any:
        key = (str(folder), k)
        files = self._files.get(key)
        if files is None:
            files = shard_counts(folder, k).get("files")
            if not isinstance(files, dict):
                raise StoreError(f"{done_path(folder, k)} has no file checksums (an older version of the builder "
                                 f"wrote this folder): rerun with `build --force`")
            self._files[key] = files
        if suffix not in files:
            raise StoreError(f"{folder / (shard_name(k) + suffix)} is not recorded in {done_path(folder, k).name}: "
                             f"{REBUILD}")
        return files[suffix]

    def data(self, folder: Path, k: int, suffix: str, data: Any) -> None:
        """Check the bytes ``data`` read from shard ``k``'s ``suffix`` file (once)."""
        key = (str(folder), k, suffix)
        if key in self._checked:
            return
        self._fail(folder, k, suffix, mismatch(data_sum(data), self._recorded(folder, k, suffix)))
        self._checked.add(key)

    def file(self, folder: Path, k: int, suffix: str) -> Path:
        """Check shard ``k``'s ``suffix`` file by reading it (once); returns its path."""
        path = folder / f"{shard_name(k)}{suffix}"
        key = (str(folder), k, suffix)
        if key not in self._checked:
            want = self._recorded(folder, k, suffix)
            if not path.is_file():
                raise StoreError(f"{path} is missing: {REBUILD}")
            self._fail(folder, k, suffix, mismatch(file_sum(path), want))
            self._checked.add(key)
        return path

    @staticmethod
    def _fail(folder: Path, k: int, suffix: str, problem: str | None) -> None:
        if problem:
            raise StoreError(f"{folder / (shard_name(k) + suffix)} is {problem}: {REBUILD}")


def verify_files(folder: Path, k: int, suffixes: Iterable[str], caches: bool = False) -> None:
    """Check shard ``k``'s files of ``suffixes`` against its marker (one-line :class:`StoreError` otherwise).
    ``caches``: the files are caches the texts give again (word ids, exact-dedup keys): one that is absent is not
    checked (its reader recomputes it), one that is there must match."""
    check = ShardCheck()
    for sfx in suffixes:
        if not caches or (folder / f"{shard_name(k)}{sfx}").exists():
            check.file(folder, k, sfx)


def recorded_suffixes(folder: Path, k: int) -> list[str]:
    """The suffixes of the files shard ``k``'s marker lists."""
    files = shard_counts(folder, k).get("files")
    return sorted(files) if isinstance(files, dict) else []


class _Mapped:
    """A read-only file mapped into memory (an empty file maps to ``b""``)."""

    def __init__(self, path: Path):
        self._f = open(path, "rb")
        size = self._f.seek(0, 2)
        self.data: Any = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    def close(self) -> None:
        if isinstance(self.data, mmap.mmap):
            self.data.close()
        self._f.close()


class ShardReader:
    """One shard's ``.txt`` and ``.meta.jsonl`` in ``folder``, mapped when first read and then checked against
    the shard's checksums (``check``: a reader's :class:`ShardCheck`, so a file is checked once per reader):
    texts and records by index row. Use as a context manager (or :meth:`close`)."""

    def __init__(self, folder: Path, k: int, check: ShardCheck | None = None):
        self.folder, self.k = folder, k
        self._check = check or ShardCheck()
        self._txt: _Mapped | None = None
        self._meta: _Mapped | None = None

    def _map(self, path: Path, suffix: str) -> _Mapped:
        if not path.is_file():
            raise StoreError(f"{path} is missing: {REBUILD}")
        m = _Mapped(path)
        try:
            self._check.data(self.folder, self.k, suffix, m.data)
        except BaseException:
            m.close()
            raise
        return m

    @property
    def _text_data(self) -> Any:
        if self._txt is None:
            self._txt = self._map(text_path(self.folder, self.k), ".txt")
        return self._txt.data

    @property
    def _meta_data(self) -> Any:
        if self._meta is None:
            self._meta = self._map(meta_path(self.folder, self.k), ".meta.jsonl")
        return self._meta.data

    def text(self, row: np.ndarray) -> str:
        off = int(row[COL_OFF])
        return self._text_data[off:off + int(row[COL_LEN])].decode("utf-8")

    def texts(self, rows: np.ndarray) -> list[str]:
        """The texts of index rows ``rows`` (int64[m, 5]), in order."""
        data = self._text_data
        return [data[o:o + n].decode("utf-8") for o, n in rows[:, COL_OFF:COL_LEN + 1].tolist()]

    def record(self, row: np.ndarray) -> dict[str, Any]:
        """``{"i", "src", "text"[, "uid"]}`` of index row ``row``."""
        moff = int(row[COL_MOFF])
        meta = json.loads(self._meta_data[moff:moff + int(row[COL_MLEN])])
        return {"i": int(row[COL_I]), "src": meta.pop("src"), "text": self.text(row), **meta}

    def meta(self, row: np.ndarray) -> dict[str, Any]:
        """``{"i", "src"[, "uid"]}`` of index row ``row`` (the text not read)."""
        moff = int(row[COL_MOFF])
        return {"i": int(row[COL_I]), **json.loads(self._meta_data[moff:moff + int(row[COL_MLEN])])}

    def close(self) -> None:
        for m in (self._txt, self._meta):
            if m is not None:
                m.close()
        self._txt = self._meta = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_index(folder: Path, k: int, text_folder: Path | None = None, check: ShardCheck | None = None) -> np.ndarray:
    """Shard ``k``'s index rows (int64[n, 5]), checked: the file against the shard's checksum, its shape, and
    every row against the sizes of the ``.txt`` / ``.meta.jsonl`` it points into (in ``text_folder``, by default
    the store's own: :func:`text_folder_of`). One-line :class:`StoreError` otherwise."""
    path = index_path(folder, k)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{path} is missing: {REBUILD}") from None
    (check or ShardCheck()).data(folder, k, ".idx.npy", data)
    try:
        rows = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise StoreError(f"{path} is not a readable index ({e}): {REBUILD}") from None
    if rows.dtype != np.int64 or rows.ndim != 2 or rows.shape[1] != 5:
        raise StoreError(f"{path} is not an index (int64[n, 5]; got {rows.dtype}{list(rows.shape)}): {REBUILD}")
    check_rows(rows, path, text_folder if text_folder is not None else text_folder_of(folder), k)
    return rows


def check_rows(rows: np.ndarray, index_file: Path, text_folder: Path, k: int) -> None:
    """Every row of ``rows`` (shard ``k``'s, read from ``index_file``) lies inside shard ``k``'s ``.txt`` and
    ``.meta.jsonl`` in ``text_folder`` (vectorised: two comparisons per row); one-line :class:`StoreError`."""
    if not len(rows):
        return
    for f, col_off, col_len in ((text_path(text_folder, k), COL_OFF, COL_LEN),
                                (meta_path(text_folder, k), COL_MOFF, COL_MLEN)):
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise StoreError(f"{f} is missing: {REBUILD}") from None
        off, n = rows[:, col_off], rows[:, col_len]
        bad = np.flatnonzero((off < 0) | (n < 0) | (off > size - n))
        if len(bad):
            j = int(bad[0])
            raise StoreError(f"{index_file} row {j} points at bytes {int(off[j])}..{int(off[j]) + int(n[j])} of {f}, "
                             f"which has {size} ({len(bad)} such rows): {REBUILD}")


def iter_rows(folder: Path, k: int, rows: np.ndarray) -> Iterator[dict[str, Any]]:
    """The records of shard ``k``'s files in ``folder`` at the index ``rows`` (in file order)."""
    with ShardReader(folder, k) as r:
        for row in rows:
            yield r.record(row)


def iter_shard(folder: Path, k: int) -> Iterator[dict[str, Any]]:
    """Every record of shard ``k`` of the store that wrote the texts (``folder``)."""
    yield from iter_rows(folder, k, load_index(folder, k))


def shard_texts(folder: Path, k: int, rows: np.ndarray | None = None) -> list[str]:
    """The texts of shard ``k`` in ``folder`` at ``rows`` (default: all of them), in order."""
    with ShardReader(folder, k) as r:
        return r.texts(load_index(folder, k) if rows is None else rows)


class StoreError(ConfigError):
    """A finished stage's files are missing or damaged (one line: which file, how to rebuild)."""


TEXT_FROM = "_text_from.json"  # in an index-only store (the filter's, dedup's exact survivors): the text's folder


def write_text_from(folder: Path, text_folder: Path) -> None:
    """Record in the index-only store ``folder`` that its texts are in ``text_folder``, by a path relative to
    ``folder`` (a copied or moved output folder reads its own texts)."""
    atomic_write_json(folder / TEXT_FROM, {"folder": os.path.relpath(text_folder.resolve(), folder.resolve())})


def text_folder_of(folder: Path) -> Path:
    """The folder holding the texts of the store ``folder``: itself, or the one its ``_text_from.json`` names.
    An absolute path there (an older builder wrote them) is followed only inside the same ``work`` folder
    (``folder``'s grandparent): anywhere else it may be the folder this one was copied from."""
    f = folder / TEXT_FROM
    if not f.is_file():
        return folder
    try:
        ref = read_json(f)["folder"]
        if not isinstance(ref, str):
            raise TypeError(type(ref).__name__)
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise StoreError(f"{f} is damaged ({type(e).__name__}: {e}): {REBUILD}") from None
    p = Path(ref)
    if not p.is_absolute():
        return (folder.resolve() / p).resolve()
    root = folder.resolve().parent.parent
    if p.resolve() == root or root in p.resolve().parents:
        return p
    raise StoreError(f"{f} names the texts' folder {p} by an absolute path outside {root} (an older version of the "
                     f"builder wrote it; this folder may be a copy that would read another corpus's texts): rerun "
                     f"with `build --force`")
