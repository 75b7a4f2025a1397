"""The read side of a finished store (:class:`DocStore`): ordered iteration and random access by position over
the shards that :mod:`data_pipeline.store` writes and checks."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.store import (
    COL_I,
    COL_LEN,
    COL_MLEN,
    COL_MOFF,
    COL_OFF,
    REBUILD,
    ShardCheck,
    ShardReader,
    StoreError,
    done_shards,
    index_path,
    load_index,
    meta_path,
    text_folder_of,
    text_path,
)


class DocStore:
    """Read side of a finished store: ordered iteration and random access by position (0 .. len - 1).

    Opening it reads only each shard's row count and checks the shard files are whole; a shard's index is
    loaded when one of its documents is read and at most ``cache_shards`` indexes (and opened shard files)
    are kept, so the memory of a reader is bounded by its shards, not by the corpus. An index-only store
    (the filter stage's; :func:`data_pipeline.dedup.exact.write_subset`) holds only the per-shard indexes,
    whose offsets point into the shard files of the store named in its ``_text_from.json``."""

    def __init__(self, folder: Path, cache_shards: int = 4):
        self.folder = folder
        self.text_folder = text_folder_of(folder)
        self.shards = done_shards(folder)
        self._check = ShardCheck()  # each file checked against its checksum when first read
        counts = []
        for k in self.shards:  # a deleted or cut shard is one line here, not a traceback later
            try:
                idx = np.load(index_path(folder, k), mmap_mode="r")  # the header and the last row only
            except FileNotFoundError:
                raise StoreError(f"{index_path(folder, k)} is missing: {REBUILD}") from None
            except (ValueError, OSError, EOFError) as e:
                raise StoreError(f"{index_path(folder, k)} is not a readable index ({e}): {REBUILD}") from None
            if idx.ndim != 2 or idx.shape[1] != 5:
                raise StoreError(f"{index_path(folder, k)} is not an index (shape {list(idx.shape)}): {REBUILD}")
            counts.append(len(idx))
            if not len(idx):
                continue
            last = np.asarray(idx[-1])
            for f, need in ((text_path(self.text_folder, k), int(last[COL_OFF] + last[COL_LEN])),
                            (meta_path(self.text_folder, k), int(last[COL_MOFF] + last[COL_MLEN]))):
                have = f.stat().st_size if f.is_file() else None
                if have is None or have < need:
                    self._check.file(folder, k, ".idx.npy")  # the index changed rather than the file? name it
                    raise StoreError(f"{f} is {'missing' if have is None else f'truncated ({have} of {need} bytes)'}"
                                     f": {REBUILD}")
        #: store position of each shard's first document, and the total at the end (len(shards) + 1)
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self._cache_size = max(1, cache_shards)
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def slot_of(self, pos: int) -> int:
        """Which shard (its place in ``shards``) holds store position ``pos``."""
        return int(np.searchsorted(self.starts, pos, side="right")) - 1

    def rows(self, slot: int) -> np.ndarray:
        """The index rows (int64[m, 5]) of the shard at ``slot`` (loaded, a few kept)."""
        got = self._rows.get(slot)
        if got is None:
            got = self._rows[slot] = load_index(self.folder, self.shards[slot], self.text_folder, self._check)
            if len(self._rows) > self._cache_size:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(slot)
        return got

    def _reader(self, slot: int) -> ShardReader:
        r = self._readers.get(slot)
        if r is None:
            r = self._readers[slot] = ShardReader(self.text_folder, self.shards[slot], self._check)
            if len(self._readers) > self._cache_size:
                self._readers.popitem(last=False)[1].close()
        else:
            self._readers.move_to_end(slot)
        return r

    def row(self, pos: int) -> np.ndarray:
        slot = self.slot_of(pos)
        return self.rows(slot)[pos - int(self.starts[slot])]

    @property
    def input_index(self) -> np.ndarray:
        """int64[n]: every position's input index (reads every shard index: O(n) memory, for small stores
        and checks; the stages use :meth:`row` / :meth:`rows`)."""
        parts = [np.load(index_path(self.folder, k), mmap_mode="r")[:, COL_I] for k in self.shards]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.iter_range(0, len(self))

    def _spans(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        """(slot, index rows) covering positions [start, stop), shard by shard."""
        pos = max(0, start)
        while pos < stop:
            slot = self.slot_of(pos)
            lo, hi = int(self.starts[slot]), int(self.starts[slot + 1])
            end = min(stop, hi)
            rows = self.rows(slot) if end - pos == hi - lo else self.rows(slot)[pos - lo:end - lo]
            yield slot, rows
            pos = end

    def iter_range(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        """Records at positions [start, stop), read in file order (each shard's files opened for the span, so
        an iteration never shares a mapping with :meth:`get`)."""
        for slot, rows in self._spans(start, stop):
            with ShardReader(self.text_folder, self.shards[slot], self._check) as r:
                for row in rows:
                    yield r.record(row)

    def texts(self, start: int, stop: int) -> list[str]:
        """The texts at positions [start, stop) (no metadata read)."""
        out: list[str] = []
        for slot, rows in self._spans(start, stop):
            with ShardReader(self.text_folder, self.shards[slot], self._check) as r:
                out += r.texts(rows)
        return out

    def iter_texts(self) -> Iterator[str]:
        """Every text in store order, one shard's texts in memory at a time."""
        for slot in range(len(self.shards)):
            yield from self.texts(int(self.starts[slot]), int(self.starts[slot + 1]))

    def get(self, pos: int) -> dict[str, Any]:
        slot = self.slot_of(pos)
        return self._reader(slot).record(self.rows(slot)[pos - int(self.starts[slot])])

    def text(self, pos: int) -> str:
        slot = self.slot_of(pos)
        return self._reader(slot).text(self.rows(slot)[pos - int(self.starts[slot])])

    def meta(self, pos: int) -> dict[str, Any]:
        """``{"i", "src"[, "uid"]}`` of position ``pos`` (the text not read)."""
        slot = self.slot_of(pos)
        return self._reader(slot).meta(self.rows(slot)[pos - int(self.starts[slot])])

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._rows.clear()

    def __enter__(self) -> DocStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
