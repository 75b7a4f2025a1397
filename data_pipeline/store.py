"""Sharded document stores between stages, with random access and atomic, resumable shards.

A store is a folder of shards ``docs-00000.jsonl`` (one JSON object per line: ``{"i": input index,
"src": source id, "text": cleaned text}``) plus, per shard, ``docs-00000.idx.npy``: an int64 array of
shape ``[n, 3]`` = (input index, byte offset, byte length) that lets a later stage re-read any document
with one ``seek`` (dedup verification reads texts this way instead of keeping them in memory). A later
stage's store may hold only the indexes, pointing into an earlier store's shard files (``_text_from.json``
names that folder: the filter keeps its documents' texts where ingest wrote them).

Every file is written under a temporary name and ``os.replace``-d into place; a shard's ``.done.json``
(its counts) is written last and is the shard's completion marker, so a crash leaves either a finished
shard or nothing that counts.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.config import ConfigError
from megatron_ds_suite.core import atomic


def atomic_write_text(path: Path, text: str) -> None:
    atomic.write_text(path, text)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic.write_json(path, obj, indent=1, sort_keys=True, ensure_ascii=False)


def atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic.atomic_path(path) as tmp:
        np.save(tmp, arr)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def shard_name(k: int) -> str:
    return f"docs-{k:05d}"


class ShardWriter:
    """Writes one shard's jsonl + index; :meth:`commit` publishes it with its counts."""

    def __init__(self, folder: Path, k: int):
        self.folder, self.k = folder, k
        self.path = folder / f"{shard_name(k)}.jsonl"
        self._file = atomic.atomic_open(self.path, "wb")  # a hidden temporary file until commit
        self.f = self._file.__enter__()
        self.index: list[tuple[int, int, int]] = []
        self.offset = 0

    def add(self, i: int, src: str, text: str, **extra: Any) -> None:
        line = json.dumps({"i": i, "src": src, "text": text, **extra}, ensure_ascii=False).encode("utf-8") + b"\n"
        self.f.write(line)
        self.index.append((i, self.offset, len(line)))
        self.offset += len(line)

    def commit(self, counts: dict[str, Any]) -> None:
        self._file.__exit__(None, None, None)  # fsync, rename into place
        atomic_save_npy(self.folder / f"{shard_name(self.k)}.idx.npy",
                        np.asarray(self.index, dtype=np.int64).reshape(-1, 3))
        atomic_write_json(self.folder / f"{shard_name(self.k)}.done.json", counts)

    def abort(self) -> None:
        stop = RuntimeError("shard aborted")
        self._file.__exit__(type(stop), stop, None)  # closes and removes the temporary file


def done_shards(folder: Path) -> list[int]:
    return sorted(int(p.name[5:10]) for p in folder.glob("docs-*.done.json"))


def shard_counts(folder: Path, k: int) -> dict[str, Any]:
    return read_json(folder / f"{shard_name(k)}.done.json")


def iter_shard(folder: Path, k: int) -> Iterator[dict[str, Any]]:
    with open(folder / f"{shard_name(k)}.jsonl", "rb") as f:
        for line in f:
            yield json.loads(line)


def read_record(f: Any, row: np.ndarray) -> dict[str, Any]:
    """The record at index ``row`` (input index, byte offset, length) of the open shard file ``f``."""
    f.seek(int(row[1]))
    return json.loads(f.read(int(row[2])))


def iter_rows(folder: Path, k: int, rows: np.ndarray) -> Iterator[dict[str, Any]]:
    """The records of shard ``k``'s file in ``folder`` at the index ``rows`` (in file order)."""
    with open(folder / f"{shard_name(k)}.jsonl", "rb") as f:
        for row in rows:
            yield read_record(f, row)


class StoreError(ConfigError):
    """A finished stage's files are missing or damaged (one line: which file, how to rebuild)."""


TEXT_FROM = "_text_from.json"  # in an index-only store (the filter's, dedup's exact survivors): the text's folder


class DocStore:
    """Read side of a finished store: ordered iteration and random access by position.

    An index-only store (the filter stage's; :func:`data_pipeline.dedup.exact.write_subset`) holds only the
    per-shard indexes, whose offsets point into the shard files of the store named in its
    ``_text_from.json``."""

    def __init__(self, folder: Path):
        self.folder = folder
        text_from = folder / TEXT_FROM
        self.text_folder = Path(read_json(text_from)["folder"]) if text_from.is_file() else folder
        self.shards = done_shards(folder)
        idx = [np.load(folder / f"{shard_name(k)}.idx.npy") for k in self.shards]
        self.shard_of = np.concatenate([np.full(len(a), k, dtype=np.int64) for k, a in zip(self.shards, idx)]) \
            if idx else np.zeros(0, np.int64)
        self.table = np.concatenate(idx) if idx else np.zeros((0, 3), np.int64)  # (input idx, offset, len)
        self._files: dict[int, Any] = {}
        for k, a in zip(self.shards, idx):  # a deleted or cut shard is one line here, not a traceback later
            f = self.text_folder / f"{shard_name(k)}.jsonl"
            need = int((a[:, 1] + a[:, 2]).max()) if len(a) else 0
            have = f.stat().st_size if f.is_file() else None
            if have is None or have < need:
                raise StoreError(f"{f} is {'missing' if have is None else f'truncated ({have} of {need} bytes)'}: "
                                 f"the finished stage output was damaged; rerun with `build --force` (or delete "
                                 f"{self.text_folder} and run `build`)")

    def __len__(self) -> int:
        return len(self.table)

    @property
    def input_index(self) -> np.ndarray:
        return self.table[:, 0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.text_folder != self.folder:
            yield from self.iter_range(0, len(self))
            return
        for k in self.shards:
            yield from iter_shard(self.folder, k)

    def iter_range(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        """Records at positions [start, stop), read in file order."""
        pos = start
        while pos < stop:
            k = int(self.shard_of[pos])
            end = min(stop, int(np.searchsorted(self.shard_of, k, side="right")))  # shards are stored in order
            yield from iter_rows(self.text_folder, k, self.table[pos:end])
            pos = end

    def get(self, pos: int) -> dict[str, Any]:
        k = int(self.shard_of[pos])
        f = self._files.get(k)
        if f is None:
            f = self._files[k] = open(self.text_folder / f"{shard_name(k)}.jsonl", "rb")
        return read_record(f, self.table[pos])

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def reset_dir(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def write_jsonl_atomic(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    n = 0
    with atomic.atomic_open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n
