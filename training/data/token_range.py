"""Token ids of a dataset checked against the tokenizer, once, when training opens the dataset.

A ``.bin`` holding an id at or above the tokenizer's vocabulary size (another tokenizer's corpus, a
damaged file, an id in the model's padding range ``[vocab_size, padded_vocab)``) would otherwise train
without an error: the tensor-parallel embedding masks ids outside its shard, and padding-range rows
exist at any TP. So every dataset a run reads (``data.corpus``, ``data.text_files``, each of
``data.prefixes``, a BERT corpus) is refused in one line naming the file, its largest id and the
vocabulary size.

Cost: one vectorised pass over the memory map (min and max per chunk of ``CHUNK`` tokens, never the
whole file in memory), then cached beside the index maps as ``{prefix}_token_range_{key}.json``. The
key covers the ``.bin``/``.idx`` sizes and modification times, so a rebuilt or edited corpus is scanned
again and an unchanged one never is.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path

CHUNK = 1 << 24  # tokens per vectorised min/max (32 MiB of uint16)


def scan_token_range(prefix: str | Path) -> tuple[int, int]:
    """(smallest id, largest id) over every token of ``prefix.bin``; (0, -1) when it holds none."""
    indexed = MMapIndexedDataset(prefix)
    n = indexed.num_tokens
    if n == 0:
        return 0, -1
    tokens = np.memmap(data_file_path(prefix), dtype=indexed.dtype, mode="r", shape=(n,))
    lo, hi = None, None
    for start in range(0, n, CHUNK):
        part = tokens[start:start + CHUNK]
        a, b = int(part.min()), int(part.max())
        lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    del tokens
    return lo, hi


def _cache_key(prefix: Path) -> str:
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in (data_file_path(prefix), index_file_path(prefix))]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest()[:12]


def token_range(prefix: str | Path, cache_dir: str | Path | None = None) -> tuple[int, int]:
    """:func:`scan_token_range`, cached in ``cache_dir`` (default: beside the dataset)."""
    prefix = Path(prefix)
    directory = Path(cache_dir) if cache_dir is not None else prefix.parent
    path = directory / f"{prefix.name}_token_range_{_cache_key(prefix)}.json"
    try:
        cached = json.loads(path.read_text())
        return int(cached["min"]), int(cached["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: scan again
    lo, hi = scan_token_range(prefix)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with atomic.atomic_open(path, "w") as f:
            json.dump({"min": lo, "max": hi, "bin": str(data_file_path(prefix))}, f)
    except OSError:
        pass  # a read-only cache folder: the check still holds, it is only not remembered
    return lo, hi


def check_token_ids(prefix: str | Path, vocab_size: int, cache_dir: str | Path | None = None,
                    source: str = "the dataset") -> None:
    """Refuse ``prefix`` in one line when one of its ids lies outside ``[0, vocab_size)``."""
    lo, hi = token_range(prefix, cache_dir)
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise ConfigError(f"{source}: {data_file_path(prefix)} holds token id {bad} (ids {lo}..{hi}) but the "
                          f"tokenizer has {vocab_size} ids (0..{vocab_size - 1}): the dataset was tokenized with "
                          f"another tokenizer or is damaged; rebuild it with this tokenizer")
