"""WikiText-103 perplexity the way Megatron scores it (evaluation.md §2).

Pipeline: read the ``.tokens`` file (or the ``datasets`` WikiText config) -> count original tokens
(``len(text.strip().split(" "))``, newline pieces included) -> detokenize -> BPE the whole stream at
once (no EOD, documents not split) -> overlapping windows -> sum of token NLLs.

Windows (Megatron's ``_LMDataset``), length ``L`` and stride ``s`` over ``N`` tokens: window ``i``
holds tokens ``[i*s, i*s + L + 1)`` (inputs = all but the last, labels = all but the first). Window 0
scores its ``L`` targets, window ``i > 0`` only its last ``s`` targets, i.e. targets
``i*s + L - s + 1 ... i*s + L``: every target ``1 .. N-1`` is scored exactly once and, after the first
window, with at least ``L - s`` tokens of left context. Megatron iterates
``max(ceil(max(N-1-s, 0)/s) + 1, 1)`` windows, of which the trailing ``~L/s - 1`` score only padding;
we skip those (identical result) and report both counts.

    loss = total_nll / (N - 1)              ppl = exp(min(20, loss))          (per BPE token)
    adjusted_ppl = exp(min(20, total_nll / (num_original_tokens - 1)))       (per original token)
"""
from __future__ import annotations

import io
import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from evaluation.errors import EvalError
from evaluation.scoring import LMScorer
from megatron_ds_suite.core.hf_datasets import check_no_script, load_hf_dataset

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
def first_lines(text: str, n: int) -> str:
    """The first ``n`` lines of ``text`` as iterating over the file in text mode yields them (universal
    newlines: ``\r\n`` and ``\r`` read as ``\n``; only those end a line), i.e. exactly the file
    the main job (``python -m megatron_ds_suite.app.main_job``) cuts for ``eval.wikitext103.limit_lines`` (``--limit``)."""
    if n < 1:
        raise EvalError(f"--limit must be >= 1, got {n}")
    return "".join(itertools.islice(io.StringIO(text, newline=None), n))


def read_tokens_file(path: str | Path, limit: int | None = None) -> str:
    """The ``.tokens`` file as text (UTF-8); clear errors for missing, binary or empty files.

    ``limit``: only its first ``limit`` lines (:func:`first_lines`); the whole file is still checked.
    """
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"WikiText file {p} does not exist or is not a file")
    if p.suffix in (".json", ".jsonl", ".parquet", ".arrow", ".bin", ".idx", ".gz"):
        raise EvalError(f"WikiText file {p} has suffix {p.suffix!r}: expected the word-level wiki.*.tokens text file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"WikiText file {p} is not UTF-8 text (byte {e.start}): expected a wiki.*.tokens file") from None
    if not text.strip():
        raise EvalError(f"WikiText file {p} is empty")
    if "\x00" in text:
        raise EvalError(f"WikiText file {p} contains NUL bytes: expected a plain-text wiki.*.tokens file")
    if limit is not None:
        text = first_lines(text, limit)
        if not text.strip():
            raise EvalError(f"the first {limit} line(s) of WikiText file {p} are blank: nothing to score")
    return text


def lines_to_tokens_text(lines: list[str]) -> str:
    """Rebuild the ``.tokens`` file from the ``datasets`` WikiText rows.

    The ``wikitext``/``wikitext-103-v1`` rows are the file's lines with their ``"\\n"`` kept, except
    blank lines (``" \\n"`` in the file), which are stored as ``""``.
    """
    return "".join(r if r else " \n" for r in lines)


def read_hf_wikitext(name: str, split: str = "test", column: str = "text") -> str:
    """``NAME[:CONFIG]`` through ``datasets.load_dataset`` (a hub name or a local data folder; loading scripts are refused)."""
    ds_name, _, config = name.partition(":")
    check_no_script(ds_name)  # a loading script is refused (one line), never run
    try:
        ds = load_hf_dataset(ds_name, config or None, split=split)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        raise EvalError(f"cannot load dataset {name!r} split {split!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if column not in ds.column_names:
        raise EvalError(f"dataset {name!r} has no {column!r} column (columns: {', '.join(ds.column_names)})")
    text = lines_to_tokens_text(list(ds[column]))
    if not text.strip():
        raise EvalError(f"dataset {name!r} split {split!r} is empty")
    return text


def count_original_tokens(text: str) -> int:
    """Megatron's ``num_original_tokens``: pieces of ``text.strip()`` split on a single space."""
    return len(text.strip().split(" "))


# ----------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------
@dataclass
class WindowPlan:
    """Overlapping windows over one token stream (see module docstring)."""

    tokens: np.ndarray
    seq_len: int
    stride: int
    pad_id: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise EvalError(f"sequence length must be >= 1, got {self.seq_len}")
        if not 1 <= self.stride <= self.seq_len:
            raise EvalError(f"stride must be in [1, seq_length={self.seq_len}], got {self.stride}")
        if len(self.tokens) < 2:
            raise EvalError(f"need at least 2 tokens to score, got {len(self.tokens)}")
        self.tokens = np.asarray(self.tokens, dtype=np.int64)

    @property
    def total_targets(self) -> int:
        return len(self.tokens) - 1

    @property
    def num_windows_megatron(self) -> int:
        """Megatron's ``total_sequences`` (includes trailing windows that score only padding)."""
        targets = max(self.total_targets - self.stride, 0)
        return max(math.ceil(targets / self.stride) + 1, 1)

    @property
    def num_windows(self) -> int:
        """Windows that score at least one real target: 1 + ceil(max(N-1-L, 0) / s)."""
        return 1 + math.ceil(max(self.total_targets - self.seq_len, 0) / self.stride)

    def window(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(inputs [L], labels [L], mask [L])`` of window ``i``; padding has mask 0."""
        L, s = self.seq_len, self.stride
        chunk = self.tokens[i * s : i * s + L + 1]
        n = len(chunk)
        mask = np.zeros(L, dtype=np.int64)
        mask[: n - 1] = 1
        if n < L + 1:
            chunk = np.concatenate([chunk, np.full(L + 1 - n, self.pad_id, dtype=np.int64)])
        if i > 0 and s != L:
            mask[: L - s] = 0
        return chunk[:-1], chunk[1:], mask

    def batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Batches of this data-parallel rank's windows (``i % world == rank``): ids, inputs, labels, mask."""
        mine = list(range(rank, self.num_windows, world))
        for b in range(0, len(mine), batch_size):
            ids = mine[b : b + batch_size]
            ws = [self.window(i) for i in ids]
            yield (ids,) + tuple(torch.from_numpy(np.stack(x)) for x in zip(*ws))  # type: ignore[misc]

    def trimmed_batches(self, batch_size: int, rank: int = 0, world: int = 1):
        """Like :meth:`batches` but trims the batch to its longest real window (short final windows)."""
        for ids, inp, lab, mask in self.batches(batch_size, rank, world):
            real = int(min(self.seq_len, max(len(self.tokens) - 1 - i * self.stride for i in ids)))
            yield ids, inp[:, :real], lab[:, :real], mask[:, :real]


@dataclass
class StreamScore:
    total_nll: float
    scored_tokens: int
    windows: int


def score_stream(
    scorer: LMScorer,
    plan: WindowPlan,
    batch_size: int = 8,
    dp_rank: int = 0,
    dp_world: int = 1,
    dp_group: dist.ProcessGroup | None = None,
    progress: bool = True,
) -> StreamScore:
    """Σ NLL over the masked targets of every window, batched; sums all-reduced over data parallel.

    The sum is accumulated in float64 per window (the order of windows does not change it beyond
    rounding of the per-window fp32 sums).
    """
    total = torch.zeros(2, dtype=torch.float64)  # host accumulator: the scores come back on the host
    n_windows = len(range(dp_rank, plan.num_windows, dp_world))
    bar = tqdm(total=n_windows, desc="wikitext windows", unit="win", disable=not progress)
    for ids, inp, lab, mask in plan.trimmed_batches(batch_size, dp_rank, dp_world):
        nll, _ = scorer.score(inp, lab, mask)
        m = mask.to(torch.float64)
        total[0] += (nll.double() * m).sum()
        total[1] += m.sum()
        bar.update(len(ids))
    bar.close()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        total = total.to(scorer.device)  # a collective operand lives on the model's device (NCCL)
        dist.all_reduce(total, group=dp_group)
        total = total.cpu()
    return StreamScore(float(total[0]), int(total[1]), plan.num_windows)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------
def perplexity_numbers(total_nll: float, num_tokenized_tokens: int, num_original_tokens: int) -> dict[str, float]:
    """Megatron's ``evaluate.py`` formulas (see module docstring); exp capped at e^20."""
    loss = total_nll / (num_tokenized_tokens - 1)
    ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
    return {
        "loss": loss,
        "ppl": math.exp(min(20.0, loss)),
        "token_ratio": ratio,
        "adjusted_ppl": math.exp(min(20.0, loss * ratio)),
    }
