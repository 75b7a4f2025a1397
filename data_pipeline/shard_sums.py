"""Shard checksums: the size and CRC-32 of every file of a finished shard, so a changed byte is found.

A shard's completion marker (``docs-K.done.json``, :func:`data_pipeline.store.seal_shard`) lists each file of
the shard as ``"files": {suffix: [bytes, crc32]}`` (``".txt"``, ``".idx.npy"``, ...). The large files get their
sum while they are written (:class:`SummingFile`: ``zlib.crc32`` of each piece as it goes to the file), the
small side files by reading them back (:func:`file_sum`); a reader checks a file once, when it first reads
it (:func:`data_sum` over the mapped bytes, or :func:`file_sum`), and :func:`mismatch` says how it differs.

CRC-32 (zlib, ~1 GB/s on one core) finds any single flipped byte, any cut and any burst of up to 32 bits, which
is what disks, copies and hand edits do; it is not a defence against someone forging a shard. This module holds
the arithmetic only: which files a shard has and the errors are the store's (:mod:`data_pipeline.store`).
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import IO, Any

#: the checksum recorded in a completion marker (part of ``STORE_FORMAT``)
ALGORITHM = "crc32"
_CHUNK = 1 << 20


class SummingFile:
    """A binary file object that keeps the size and CRC-32 of what was written through it (``np.save`` and
    ``f.write`` both write through :meth:`write`)."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()

    def sum(self) -> list[int]:
        return [self.size, self.crc]


def data_sum(data: Any) -> list[int]:
    """``[bytes, crc32]`` of a bytes-like object (a ``bytes``, an ``mmap``)."""
    return [len(data), zlib.crc32(data)]


def file_sum(path: Path) -> list[int]:
    """``[bytes, crc32]`` of a file, read in 1 MiB pieces."""
    size = crc = 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            crc = zlib.crc32(piece, crc)
            size += len(piece)
    return [size, crc]


def mismatch(have: list[int], want: Any) -> str | None:
    """How a file's ``have`` sum differs from the recorded ``want`` (None when they agree)."""
    if not (isinstance(want, list) and len(want) == 2):
        return f"its recorded checksum is unreadable ({want!r})"
    if have[0] != want[0]:
        return f"{'cut short' if have[0] < want[0] else 'grown'} ({have[0]} bytes, {want[0]} written)"
    if have[1] != want[1]:
        return f"changed: its CRC-32 is {have[1]:08x}, {want[1]:08x} when written (a changed byte)"
    return None
