"""Atomic files: a reader sees the old file or the complete new one, never a half-written one.

Every writer here writes a temporary file in the target's own directory (same file system, so the
rename is atomic), flushes it to disk (``fsync``), renames it over the target with ``os.replace``
and then syncs the directory entry. If anything fails before the rename (an exception, a full disk,
Ctrl-C) the temporary file is removed and the target is left as it was.

Temporary names are hidden and unique per call (``.NAME.tmp-XXXXXXXX.SUFFIX``), so concurrent
writers in one process or several never share a temporary file; the target's suffix is kept at the
end so writers that add one when it is missing (``numpy.save``) use the name as given.

* :func:`write_text`, :func:`write_bytes`, :func:`write_json` -- a whole file from memory.
* :func:`atomic_open` -- a file object to stream into (``with atomic_open(p) as f: ...``).
* :func:`atomic_path` -- a temporary path for writers that take a file name (``numpy.save``,
  ``torch.save``, ``shutil.copyfile``); it is published when the ``with`` block ends without error.
* :func:`copy_file` -- copy a file into place atomically.
* :func:`fsync_file`, :func:`fsync_dir` -- make a file written elsewhere (or a folder's entries) durable.
* :func:`atomic_dir` -- a temporary folder that replaces the target folder when complete; the folders a
  killed (SIGKILL) earlier writer of the same target left are removed first, with one warning.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once at import: mkstemp creates files 0600, published files get open()'s mode


def _temp_path(path: Path) -> Path:
    """A new empty hidden file next to ``path`` (same directory, so ``os.replace`` is a rename)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-", suffix=path.suffix)
    os.close(fd)
    return Path(name)


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s data to disk (for files written by others, e.g. ``torch.save`` inside DeepSpeed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | Path) -> None:
    """Make the rename itself durable (best effort: not every platform or file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def atomic_path(path: str | Path, mkdir: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends without error the file written
    there is synced and renamed to ``path``. On an error it is removed and ``path`` is untouched."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        yield tmp
        fsync_file(tmp)
        _publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # no-op after a successful rename


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8",
                mkdir: bool = True) -> Iterator[IO[Any]]:
    """``open(path, mode)`` that publishes the file only when the block ends without error.

    ``mode`` is ``"w"`` (text, ``encoding``) or ``"wb"`` (bytes)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a new file: mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path, mkdir=mkdir) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; returns ``path``."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | Path, obj: Any, indent: int | None = 2, sort_keys: bool = False,
               ensure_ascii: bool = True, default: Any = None) -> Path:
    """Write ``obj`` as JSON (plus a final newline) to ``path`` atomically; returns ``path``.

    The JSON text is built before the file is touched, so an object that cannot be serialised leaves
    no trace."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, default=default)
    return write_text(path, text + "\n")


def copy_file(src: str | Path, dst: str | Path) -> Path:
    """Copy ``src`` to ``dst`` atomically (contents only, like ``shutil.copyfile``); returns ``dst``."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dst)


def _dir_prefix(path: Path) -> str:
    return f".{path.name}.tmp-{socket.gethostname()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's live process
    return True


def remove_stale_dirs(path: str | Path) -> list[Path]:
    """Remove the temporary folders a killed :func:`atomic_dir` writer of ``path`` left (named
    ``.NAME.tmp-HOST-PID-XXXX``: only this host's, only those whose process is gone); returns them."""
    path = Path(path)
    prefix = _dir_prefix(path)
    removed = []
    for d in path.parent.glob(f"{glob.escape(prefix)}*"):
        pid = d.name[len(prefix):].split("-", 1)[0]
        if d.is_dir() and not d.is_symlink() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a new empty hidden directory next to ``path`` to fill; when the block ends without error it
    replaces ``path`` (an existing ``path`` is removed first). On an error it is removed and ``path`` is
    left as it was. For outputs that are a folder of files (a Hugging Face export, an imported run). The
    folders a killed earlier writer of ``path`` left are removed first (:func:`remove_stale_dirs`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_dirs(path)
    if stale:
        logging.getLogger(__name__).warning("removed %d temporary folder(s) an interrupted write of %s left: %s",
                                            len(stale), path, ", ".join(d.name for d in stale))
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{_dir_prefix(path)}{os.getpid()}-"))
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp creates 0700; give the folder the mode mkdir() would
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
