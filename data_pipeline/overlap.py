"""Test-set overlap (the paper's 8-gram check) and 13-gram decontamination.

N-grams are over lower-cased ``\\w+`` words (the dedup stage's word units), so tokenisation differences
between a corpus and an evaluation file do not matter: WikiText's ``@-@`` / ``@,@`` separators vanish
(``well @-@ known`` and ``well-known`` are the same two words) and an n-gram never spans a ``<unk>``
(each evaluation text is split at ``<unk>``). An n-gram is its 64-bit fingerprint from
:func:`data_pipeline.dedup.hashing.shingle_fingerprints_batch` (xxh64 per word, position-weighted mix, fmix64).

Memory is bounded by the evaluation sets, never by the corpus: an evaluation set's distinct n-gram
fingerprints are one sorted ``uint64`` array (8 bytes per n-gram: WikiText-103 test ~240k), corpus
documents stream through in batches, each batch's n-grams are looked up with ``searchsorted`` (in worker
processes), and only a "found" bit per evaluation n-gram is kept. A fingerprint collision between two
distinct n-grams (probability ~ corpus n-grams x eval n-grams / 2^64) can only add a false match.

    overlap %  = 100 * |distinct eval n-grams found in the corpus| / |distinct eval n-grams|
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.dedup.hashing import ShingleSpec, shingle_fingerprints_batch
from data_pipeline.workers import open_pool, stop_pool
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.textfile import BadJsonLine, json_line, read_utf8

_WORD = re.compile(r"\w+")


class OverlapError(SuiteError):
    """Bad input for the overlap check (one line: what is wrong and how to fix it)."""


@dataclass
class EvalSet:
    name: str
    path: Path
    grams: np.ndarray  # sorted unique uint64 fingerprints of the set's n-grams
    n: int


def read_eval_texts(path: Path) -> list[str]:
    """Texts of an evaluation file: ``.jsonl`` → the ``text`` field of each line; anything else (WikiText's
    ``.tokens``, plain text) → one text per non-blank line."""
    if not path.is_file():
        raise OverlapError(f"evaluation file {str(path)!r} not found: pass NAME=FILE with an existing file")
    raw = read_utf8(path, "evaluation file", OverlapError)
    if path.name.endswith((".jsonl", ".json")):
        out = []
        for k, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    out.append(str(json_line(line)["text"]))
                except (BadJsonLine, KeyError, TypeError):
                    raise OverlapError(f"{path}:{k}: not a JSON object with a 'text' field") from None
        return out
    return [line for line in raw.splitlines() if line.strip()]


def _segments(texts: Iterable[str], n: int) -> list[str]:
    """Pieces between ``<unk>`` markers that hold at least ``n`` words (shorter pieces have no n-gram)."""
    return [s for t in texts for s in t.split("<unk>") if len(_WORD.findall(s)) >= n]


def ngram_fingerprints(texts: list[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(fingerprints of every word n-gram, concatenated; n-grams per text). A text of 1..n-1 words gives
    one fingerprint of a shorter width, which never equals an n-gram's."""
    return shingle_fingerprints_batch(texts, ShingleSpec(n, "word"))


def load_eval_set(name: str, path: Path, n: int) -> EvalSet:
    fp, _ = ngram_fingerprints(_segments(read_eval_texts(path), n), n)
    if not len(fp):
        raise OverlapError(f"evaluation set {name} ({path}) has no {n}-gram of words")
    return EvalSet(name, path, np.unique(fp), n)


def parse_against(items: list[str], base: Path | None = None) -> list[tuple[str, Path]]:
    """``["wikitext103=FILE", ...]`` → [(name, path)], names unique."""
    out: list[tuple[str, Path]] = []
    for it in items:
        name, sep, p = it.partition("=")
        if not sep or not name or not p:
            raise OverlapError(f"evaluation set {it!r} must look like NAME=FILE, e.g. lambada=lambada_test.jsonl")
        path = Path(p).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        if name in (x for x, _ in out):
            raise OverlapError(f"evaluation set name {name!r} given twice")
        out.append((name, path))
    return out


def iter_corpus_texts(corpus: Path, text_field: str = "text") -> Iterator[str]:
    """Texts of a built corpus folder (its ``documents.jsonl``), a jsonl file, or a folder of jsonl files."""
    if corpus.is_dir() and (corpus / "documents.jsonl").exists():
        files = [corpus / "documents.jsonl"]
    elif corpus.is_dir():
        files = sorted(p for p in corpus.rglob("*") if p.name.endswith((".jsonl", ".json")))
    elif corpus.is_file():
        files = [corpus]
    else:
        raise OverlapError(f"corpus {str(corpus)!r} not found: pass a built corpus folder (with documents.jsonl) "
                           "or jsonl file(s)")
    if not files:
        raise OverlapError(f"no documents.jsonl or *.jsonl under {corpus}")
    for f in files:
        with open(f, "rb") as fh:
            for k, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    text = json_line(raw.decode("utf-8"))[text_field]
                except (UnicodeDecodeError, BadJsonLine, KeyError, TypeError):
                    raise OverlapError(f"{f}:{k}: not a UTF-8 JSON object with a {text_field!r} field: pass a built "
                                       "corpus folder (documents.jsonl) or jsonl files of documents") from None
                yield str(text)


_SETS: list[np.ndarray] = []  # the evaluation sets' grams, inherited by forked workers


def _match_batch(args: tuple[list[str], int]) -> tuple[list[np.ndarray], np.ndarray]:
    """For one batch of documents: per set, indices of its n-grams found; per document, a bitmask of
    the sets it shares an n-gram with."""
    texts, n = args
    fp, m = ngram_fingerprints(texts, n)
    doc = np.repeat(np.arange(len(texts)), m)
    found, mask = [], np.zeros(len(texts), dtype=np.int64)
    for k, grams in enumerate(_SETS):
        pos = np.minimum(np.searchsorted(grams, fp), len(grams) - 1)
        hit = grams[pos] == fp
        found.append(np.unique(pos[hit]))
        mask[np.unique(doc[hit])] |= 1 << k
    return found, mask


def scan(texts: Iterable[str], sets: list[EvalSet], workers: int = 1, batch: int = 512,
         progress: bool = False) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """Generator over batches: yields (per set: bool[found n-grams so far], per document of the batch:
    bitmask of sets it shares an n-gram with). All sets must use the same n."""
    from tqdm import tqdm

    ns = {s.n for s in sets}
    if len(ns) != 1:
        raise OverlapError("all evaluation sets of one scan must use the same n")
    n = ns.pop()
    _SETS[:] = [s.grams for s in sets]
    found = [np.zeros(len(s.grams), dtype=bool) for s in sets]

    def batches() -> Iterator[tuple[list[str], int]]:
        buf: list[str] = []
        for t in texts:
            buf.append(t)
            if len(buf) == batch:
                yield buf, n
                buf = []
        if buf:
            yield buf, n

    bar = tqdm(desc=f"overlap: {n}-grams", unit="doc", disable=not progress)
    with ExitStack() as stack:  # a pool of its own, forked now that _SETS holds this scan's sets
        stack.callback(bar.close)
        pool = open_pool(workers) if workers > 1 else None
        if pool is not None:  # stopped at the end, or when the caller stops reading or is interrupted
            stack.callback(stop_pool, pool)
        results = pool.imap(_match_batch, batches(), chunksize=1) if pool else map(_match_batch, batches())
        for idx, mask in results:
            for f, i in zip(found, idx):
                f[i] = True
            bar.update(len(mask))
            yield found, mask


def overlap_report(corpus: Path, against: list[tuple[str, Path]], n: int = 8, workers: int = 1,
                   progress: bool = False) -> dict[str, Any]:
    """Percentage of each evaluation set's distinct word n-grams that occur in the corpus."""
    sets = [load_eval_set(name, p, n) for name, p in against]  # fail on bad eval files before the scan
    docs = 0
    found: list[np.ndarray] = [np.zeros(len(s.grams), bool) for s in sets]
    for found, mask in scan(iter_corpus_texts(corpus), sets, workers, progress=progress):
        docs += len(mask)
    return {"corpus": str(corpus), "documents": docs, "n": n,
            "sets": {s.name: {"file": str(s.path), "ngrams": int(len(s.grams)), "found": int(f.sum()),
                              "percent": round(100.0 * float(f.sum()) / len(s.grams), 4)}
                     for s, f in zip(sets, found)}}


def contaminated_positions(texts: Iterable[str], sets: list[EvalSet], workers: int = 1,
                           progress: bool = False) -> Iterator[tuple[int, list[str]]]:
    """(position, names of the sets it shares an n-gram with) for every contaminated document."""
    pos = 0
    for _, mask in scan(texts, sets, workers, progress=progress):
        for j in np.flatnonzero(mask).tolist():
            yield pos + j, [s.name for k, s in enumerate(sets) if int(mask[j]) >> k & 1]
        pos += len(mask)
