"""Small file helpers of the pipeline: atomic writes (text, JSON, ``.npy``, JSON lines, word lists), JSON reads and
a folder emptied for a new run. Every write goes through :mod:`megatron_ds_suite.core.atomic` (a temporary name,
then ``os.replace``), so a reader never sees half a file."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.shard_sums import SummingFile
from megatron_ds_suite.core import atomic


def atomic_write_text(path: Path, text: str) -> None:
    atomic.write_text(path, text)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic.write_json(path, obj, indent=1, sort_keys=True, ensure_ascii=False)


def atomic_save_npy(path: Path, arr: np.ndarray) -> list[int]:
    """``np.save`` to ``path`` atomically; returns the file's ``[bytes, crc32]``, summed while it was written."""
    with atomic.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            out = SummingFile(f)
            np.save(out, arr)  # type: ignore[arg-type]
    return out.sum()


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_word_list(path: Path, words: Iterable[str], sep: str) -> bool:
    """``words`` joined by the one character ``sep``, UTF-8, to ``path`` (atomically): a join instead of a
    JSON string per word (~2x cheaper to write and read). False, nothing written, when a word holds ``sep``
    (the caller writes JSON instead). Read back by :func:`read_word_list`."""
    words = list(words)
    text = sep.join(words)
    if text.count(sep) != max(len(words) - 1, 0):  # one C scan, not a test per word
        return False
    atomic.write_bytes(path, text.encode("utf-8"))
    return True


def read_word_list(path: Path, n: int, sep: str) -> list[str]:
    """The ``n`` words :func:`write_word_list` wrote (bytes decoded: no newline translation, a ``\\r`` stays)."""
    words = path.read_bytes().decode("utf-8").split(sep) if n else []
    if len(words) != n:
        raise ValueError(f"{path}: {n} words announced, {len(words)} found")
    return words


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
