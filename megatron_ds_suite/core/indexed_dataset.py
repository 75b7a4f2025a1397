"""Megatron's memory-mapped indexed dataset (``MMapIndexedDataset``), byte-compatible: the format and the reader
(the writer: :mod:`megatron_ds_suite.core.indexed_dataset_builder`).

A dataset ``prefix`` is two files:

``prefix.bin``
    the token arrays of all items (sequences), concatenated, in the dataset dtype, no header.
``prefix.idx`` (little-endian)
    ======  ===========  ==========================================================
    offset  type         field
    ======  ===========  ==========================================================
    0       9 bytes      magic ``b"MMIDIDX\\x00\\x00"``
    9       ``<Q``       version = 1
    17      ``<B``       dtype code (8 = uint16, 4 = int32, ... see ``DTYPE_CODES``)
    18      ``<Q``       N = number of items
    26      ``<Q``       D = len(doc_idx) = documents + 1
    34      int32 x N    sizes: tokens per item
    ..      int64 x N    pointers: byte offset of each item in ``.bin``
    ..      int64 x D    doc_idx: index of the first item of each document; 0 first, N last
    ======  ===========  ==========================================================

The fixed header is 34 bytes and the arrays follow without padding.  GPT corpora have one item per
document (EOD appended); BERT corpora have one item per sentence and ``doc_idx`` marks where documents
start (Megatron's convention).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ds_suite.core.errors import SuiteError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # 9 + 8 + 1 + 8 + 8
HEADER = struct.Struct("<9sQBQQ")
assert HEADER.size == HEADER_SIZE

# Megatron's codes (2020: 7 = double; HEAD: 7 = float32 -- token data only ever uses 4 and 8).
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float64,
    8: np.uint16,
}
#: the code written for each dtype a builder accepts (megatron_ds_suite.core.indexed_dataset_builder)
DTYPE_CODE = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
              np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.uint16): 8}


class IndexedDatasetError(SuiteError):
    """A missing, garbled or inconsistent ``.bin``/``.idx`` pair (one line saying what is wrong)."""


def index_file_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_file_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def dataset_exists(prefix: str | Path) -> bool:
    return index_file_path(prefix).is_file() and data_file_path(prefix).is_file()


def read_index_header(path: str | Path) -> tuple[np.dtype, int, int]:
    """Parse and check the 34-byte header of an ``.idx`` file: ``(dtype, N, D)``."""
    path = Path(path)
    if not path.is_file():
        raise IndexedDatasetError(f"index file {str(path)!r} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < 9 or head[:9] != MAGIC:
        if head[:6] == b"TNTIDX":
            raise IndexedDatasetError(
                f"{path} is a legacy Megatron 'lazy'/'cached' index (TNTIDX); only the mmap format (MMIDIDX) is supported"
            )
        raise IndexedDatasetError(f"{path} is not a Megatron mmap index: bad magic {head[:9]!r} (expected {MAGIC!r})")
    if len(head) < HEADER_SIZE:
        raise IndexedDatasetError(f"{path} is truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    _, version, code, n, d = HEADER.unpack(head)
    if version != VERSION:
        raise IndexedDatasetError(f"{path} has index version {version}; only version {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path} has unknown dtype code {code}")
    expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
    if size < expected:
        raise IndexedDatasetError(
            f"{path} is truncated: {size} bytes but the header (N={n}, D={d}) needs {expected}"
        )
    if size not in (expected, expected + n):  # + N: HEAD's optional int8 'modes' array (ignored)
        raise IndexedDatasetError(f"{path} has {size - expected} unexpected trailing bytes after N={n}, D={d} arrays")
    return np.dtype(DTYPE_CODES[code]), n, d


def _first_bad_pointer(sizes: np.ndarray, pointers: np.ndarray, itemsize: int, block: int = 1 << 20) -> int | None:
    """Index of the first pointer that is not the byte running sum of the sizes before it, or None;
    vectorised in blocks of ``block`` items (bounded memory for any dataset size)."""
    start = 0  # byte offset of the block's first item
    for lo in range(0, len(sizes), block):
        hi = min(len(sizes), lo + block)
        expect = np.empty(hi - lo, dtype=np.int64)
        expect[0] = start
        np.cumsum(sizes[lo:hi - 1].astype(np.int64) * itemsize, out=expect[1:])
        expect[1:] += start
        wrong = np.flatnonzero(expect != pointers[lo:hi])
        if len(wrong):
            return lo + int(wrong[0])
        start = int(expect[-1]) + int(sizes[hi - 1]) * itemsize
    return None


class MMapIndexedDataset:
    """Read-only, memory-mapped view of ``prefix.{bin,idx}``.

    ``ds[i]`` -> 1-D ``np.ndarray`` (dtype of the file, a view into the mmap: copy before mutating);
    ``ds[a:b]`` -> list of arrays; ``get(i, offset, length)`` slices one item in token units.
    ``sizes`` (int32, N), ``pointers`` (int64, N), ``doc_idx`` (int64, D) are views into the ``.idx``.
    Opening validates the header, the array lengths against the file size, ``doc_idx`` (0 first, N last,
    non-decreasing), ``sizes >= 0``, the ``.bin`` size and every pointer (vectorised; ``verify`` is kept
    for compatibility and no longer needed).

    Pickling re-opens from the path (no token data is copied into DataLoader workers).
    """

    def __init__(self, prefix: str | Path, verify: bool = False) -> None:
        self._open(Path(prefix), verify)

    def _open(self, prefix: Path, verify: bool) -> None:  # noqa: C901
        self.prefix = prefix
        self._verify = verify
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        if not idx_path.is_file():
            raise IndexedDatasetError(
                f"no indexed dataset at {str(prefix)!r}: {idx_path} does not exist (build the corpus first)"
            )
        if not bin_path.is_file():
            raise IndexedDatasetError(f"indexed dataset {str(prefix)!r} has an .idx but no data file {bin_path}")
        self.dtype, n, d = read_index_header(idx_path)
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sizes = np.frombuffer(idx, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self.pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self.doc_idx = np.frombuffer(idx, dtype="<i8", count=d, offset=off)
        self._idx_mmap = idx
        if d < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n:
            first = int(self.doc_idx[0]) if d else None
            last = int(self.doc_idx[-1]) if d else None
            raise IndexedDatasetError(
                f"{idx_path} is inconsistent: doc_idx must start at 0 and end at N={n}, got first={first}, last={last}"
            )
        if d > 1 and np.any(np.diff(self.doc_idx) < 0):
            raise IndexedDatasetError(f"{idx_path} is inconsistent: doc_idx is not non-decreasing")
        if n and int(self.sizes.min()) < 0:
            raise IndexedDatasetError(f"{idx_path} is inconsistent: negative item size")
        itemsize = self.dtype.itemsize
        self._num_tokens = int(self.sizes.sum(dtype=np.int64))
        bin_size = bin_path.stat().st_size
        if bin_size != self._num_tokens * itemsize:
            raise IndexedDatasetError(
                f"{bin_path} has {bin_size} bytes but {idx_path} describes {self._num_tokens} tokens x {itemsize} bytes "
                f"= {self._num_tokens * itemsize} (truncated or mismatched .bin/.idx pair)"
            )
        if n and (self.pointers[0] != 0 or int(self.pointers[-1]) + int(self.sizes[-1]) * itemsize != bin_size):
            raise IndexedDatasetError(f"{idx_path} is inconsistent: pointers do not match sizes")
        if n:  # always: a shifted pointer would silently train on other tokens (~10 ms per million items)
            bad = _first_bad_pointer(self.sizes, self.pointers, itemsize)
            if bad is not None:
                raise IndexedDatasetError(
                    f"{idx_path} is corrupt: pointer of item {bad} is {int(self.pointers[bad])}, not the running sum "
                    f"of the sizes before it; rebuild the dataset (python -m data_pipeline build --force)")
        if bin_size:
            self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype)
        else:  # mmap of an empty file is an error
            self._bin = np.empty(0, dtype=self.dtype)

    # -- pickling: re-open by path -----------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": str(self.prefix), "verify": self._verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._open(Path(state["prefix"]), state["verify"])

    # -- access ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def _start(self, i: int) -> int:
        return int(self.pointers[i]) // self.dtype.itemsize

    def _index(self, i: int) -> int:
        n = len(self.sizes)
        j = int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"item {i} out of range for dataset of {n} items")
        return j

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = self._index(i)
        s = self._start(j)
        return self._bin[s : s + int(self.sizes[j])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of item ``i`` (to the end when ``length`` is None)."""
        j = self._index(i)
        size = int(self.sizes[j])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"get({i}, offset={offset}, length={length}) outside item of {size} tokens")
        s = self._start(j) + offset
        return self._bin[s : s + length]

    def document(self, k: int) -> list[np.ndarray]:
        """The items (sentences) of document ``k``."""
        return [self[j] for j in range(int(self.doc_idx[k]), int(self.doc_idx[k + 1]))]

    def __repr__(self) -> str:
        return (
            f"MMapIndexedDataset({str(self.prefix)!r}, items={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )
