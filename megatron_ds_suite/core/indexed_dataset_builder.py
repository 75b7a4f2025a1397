"""Writing a Megatron indexed dataset: :class:`MMapIndexedDatasetBuilder` streams token arrays into ``prefix.bin``
and writes ``prefix.idx`` (the format and the reader: :mod:`megatron_ds_suite.core.indexed_dataset`);
:func:`best_dtype` picks the token dtype of a vocabulary.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from megatron_ds_suite.core.indexed_dataset import (
    DTYPE_CODE,
    HEADER,
    MAGIC,
    VERSION,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
)

logger = logging.getLogger(__name__)


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when ``vocab_size < 65500`` (Megatron's threshold), else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)



class _GrowableArray:
    """A numpy buffer that doubles when full (amortised O(1) append, no Python-list overhead)."""

    def __init__(self, dtype: npt.DTypeLike, capacity: int = 1024) -> None:
        self._a = np.empty(capacity, dtype=dtype)
        self._n = 0

    def append(self, v: int) -> None:
        if self._n == len(self._a):
            self._a = np.resize(self._a, 2 * len(self._a))
        self._a[self._n] = v
        self._n += 1

    def extend(self, values: np.ndarray) -> None:
        need = self._n + len(values)
        if need > len(self._a):
            self._a = np.resize(self._a, max(need, 2 * len(self._a)))
        self._a[self._n:need] = values
        self._n = need

    def __len__(self) -> int:
        return self._n

    def view(self) -> np.ndarray:
        return self._a[: self._n]


class MMapIndexedDatasetBuilder:
    """Streams items into ``prefix.bin`` and writes ``prefix.idx`` on :meth:`finalize`.

    Tokens go straight to disk; only the per-item sizes (int32) and document starts (int64) stay in memory.
    Both files are written under temporary names and renamed into place by :meth:`finalize` (``.bin``
    first, ``.idx`` last, so an ``.idx`` on disk always describes a complete ``.bin``).

    As a context manager: an exception removes the temporary files; a normal exit finalizes if that has
    not been done.  ``finalize`` closes a trailing document (items added after the last
    :meth:`end_document`).
    """

    def __init__(self, prefix: str | Path, dtype: npt.DTypeLike) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODE:
            raise IndexedDatasetError(f"unsupported dtype {self.dtype}; use megatron_ds_suite.core.indexed_dataset_builder.best_dtype")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_path = data_file_path(self.prefix)
        self._idx_path = index_file_path(self.prefix)
        self._tmp_bin = self._bin_path.with_name(self._bin_path.name + tag)
        self._tmp_idx = self._idx_path.with_name(self._idx_path.name + tag)
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = _GrowableArray(np.int32)
        self._doc_idx = _GrowableArray(np.int64)
        self._doc_idx.append(0)
        self._num_tokens = 0
        self._done = False
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        else:
            self._lo = self._hi = None

    # -- writing -----------------------------------------------------------------------------------
    def _check_ids(self, arr: np.ndarray) -> None:
        """Integer ids that fit the dtype (one line naming the range otherwise)."""
        if arr.size and self._lo is not None:
            if not np.issubdtype(arr.dtype, np.integer):
                raise IndexedDatasetError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._lo or hi > self._hi:
                raise IndexedDatasetError(
                    f"token id out of range for {self.dtype}: min {lo}, max {hi} (vocabulary too large for this dtype?)"
                )

    def add_item(self, tokens: npt.ArrayLike) -> None:
        """Append one item (a 1-D array of token ids); values must fit the dtype."""
        if self._done:
            raise IndexedDatasetError(f"builder for {self.prefix} is already finalized")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise IndexedDatasetError(f"add_item expects a 1-D token array, got shape {arr.shape}")
        self._check_ids(arr)
        if arr.size >= 2**31:
            raise IndexedDatasetError(f"item of {arr.size} tokens does not fit the int32 sizes array")
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        self._sizes.append(arr.size)
        self._num_tokens += arr.size

    def end_document(self) -> None:
        """Mark the end of a document: the next item starts a new one (an empty document is allowed)."""
        if self._done:
            raise IndexedDatasetError(f"builder for {self.prefix} is already finalized")
        self._doc_idx.append(len(self._sizes))

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Many one-item documents at once: ``tokens`` is their ids concatenated, ``sizes`` each one's
        length (the same files as ``add_item`` + ``end_document`` per document, in one write)."""
        if self._done:
            raise IndexedDatasetError(f"builder for {self.prefix} is already finalized")
        sizes = np.asarray(sizes, dtype=np.int64)
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or int(sizes.sum()) != tokens.size or (sizes < 0).any() or (sizes >= 2**31).any():
            raise IndexedDatasetError(f"add_documents: {tokens.size} tokens do not split into sizes summing to "
                                      f"{int(sizes.sum())} (each in [0, 2^31))")
        self._check_ids(tokens)
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes(order="C"))
        first = len(self._sizes)
        self._sizes.extend(sizes)
        self._doc_idx.extend(np.arange(first + 1, first + len(sizes) + 1, dtype=np.int64))
        self._num_tokens += tokens.size

    def add_item_documents(self, tokens: np.ndarray, sizes: np.ndarray, items_per_document: np.ndarray) -> None:
        """Many documents of many items at once: ``tokens`` is every item's ids concatenated, ``sizes`` each
        item's length, ``items_per_document`` each document's number of items (the same files as
        :meth:`add_document` per document, in one write)."""
        per_doc = np.asarray(items_per_document, dtype=np.int64)
        if (per_doc < 0).any() or int(per_doc.sum()) != len(sizes):
            raise IndexedDatasetError(f"add_item_documents: {len(sizes)} items do not split into documents of "
                                      f"{int(per_doc.sum())} items")
        if self._done:
            raise IndexedDatasetError(f"builder for {self.prefix} is already finalized")
        sizes = np.asarray(sizes, dtype=np.int64)
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or int(sizes.sum()) != tokens.size or (sizes < 0).any() or (sizes >= 2**31).any():
            raise IndexedDatasetError(f"add_item_documents: {tokens.size} tokens do not split into sizes summing "
                                      f"to {int(sizes.sum())} (each in [0, 2^31))")
        self._check_ids(tokens)
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes(order="C"))
        first = len(self._sizes)
        self._sizes.extend(sizes)
        self._doc_idx.extend(first + np.cumsum(per_doc))
        self._num_tokens += tokens.size

    def add_document(self, items: list[npt.ArrayLike]) -> None:
        """``add_item`` for each item, then ``end_document``."""
        for it in items:
            self.add_item(it)
        self.end_document()

    @property
    def num_items(self) -> int:
        return len(self._sizes)

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._done:
            return
        if self._doc_idx.view()[-1] != len(self._sizes):
            self.end_document()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = self._sizes.view()
        doc_idx = self._doc_idx.view()
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODE[self.dtype], len(sizes), len(doc_idx)))
            f.write(sizes.astype("<i4", copy=False).tobytes(order="C"))
            f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
            f.write(doc_idx.astype("<i8", copy=False).tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, self._bin_path)
        os.replace(self._tmp_idx, self._idx_path)
        self._done = True
        logger.info(
            "wrote %s.{bin,idx}: %d items, %d documents, %d tokens, %s",
            self.prefix, len(sizes), len(doc_idx) - 1, self._num_tokens, self.dtype,
        )

    def abort(self) -> None:
        """Drop everything written so far (temporary files removed, nothing renamed)."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> MMapIndexedDatasetBuilder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            if not self._done:
                self.abort()
            return
        self.finalize()

    def __del__(self) -> None:  # an abandoned builder leaves no temp files behind
        try:
            if not self._done:
                self.abort()
        except Exception:
            pass
