"""Shingles and their 64-bit fingerprints: the plain-Python reference sets and the vectorised batch hashing.

Shingles (``dedup.shingle_unit``/``shingle_size``):
  * ``word`` (default): the document is lower-cased and split into Unicode ``\\w+`` words; a shingle is
    a tuple of ``n`` consecutive words (a document with 1..n-1 words is one shingle; with no word at
    all it has no shingles, gets no signature, is never a duplicate and is counted as
    ``unsignatured``). Word 5-grams give far fewer false candidates than character 5-grams
    (dedup.md §7: unrelated books reach char-5 Jaccard 0.36, word-5 < 0.001).
  * ``char``: ``n`` consecutive characters of the cleaned text, no normalisation (Megatron's choice).

Fingerprints (computed once per document, batched over a chunk of documents, no Python per word):
each unit gets a 64-bit hash — a word is ``xxh64`` of its UTF-8 bytes (computed by a vectorised numpy
xxh64 for words under 32 bytes, bit-identical to the ``xxhash`` library, tested; longer words call the
library), a character is ``fmix64(code point + 1)`` — and an n-gram is ``fmix64(n + Σ_k u[i+k]·P_k mod
2^64)`` with one odd multiplier ``P_k`` per position. ASCII documents are tokenised directly on their
bytes (``\\w`` = ``[0-9A-Za-z_]`` there, same as the Unicode regex); other documents go through the
``\\w+`` regex first. A document's shingle *set* is the sorted unique array of its uint64 fingerprints.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

#: bump when the fingerprint/signature definition changes: names the signature cache folder
FINGERPRINT_VERSION = 2

_WORD = re.compile(r"\w+")
_MASK64 = (1 << 64) - 1
_U64 = np.uint64
# odd multipliers, one per position in the n-gram (order matters: "a b" != "b a"); also mixes LSH band rows
POS_MULT = np.array([(0x9E3779B97F4A7C15 * (2 * k + 1) + 0x632BE59BD9B4E019 * k) & _MASK64 | 1
                     for k in range(64)], dtype=np.uint64)
# xxh64 primes
_P1, _P2, _P3, _P4, _P5 = (_U64(x) for x in (11400714785074694791, 14029467366897019727, 1609587929392839161,
                                              9650029242287828579, 2870177450012600261))
_M32 = _U64(0xFFFFFFFF)
# byte → 1 for bytes inside a word of the byte buffer: ASCII [0-9A-Za-z_], and every byte >= 0x80 (only
# the regex-tokenised non-ASCII documents contribute such bytes, and there every non-space is a word byte)
_WORD_BYTES = bytes(1 if (chr(c).isalnum() and c < 128) or c == 95 or c >= 128 else 0 for c in range(256))


@dataclass(frozen=True)
class ShingleSpec:
    """Shingles of ``n`` consecutive units; ``unit`` is ``word`` or ``char``."""

    n: int = 5
    unit: str = "word"


# ------------------------------------------------------------------------------- reference shingle sets
def units(text: str, spec: ShingleSpec) -> list[str] | str:
    return _WORD.findall(text.lower()) if spec.unit == "word" else text


def shingle_set(text: str, spec: ShingleSpec) -> set[Any]:
    """The exact shingle set (tuples of words, or substrings): the plain-Python reference."""
    u = units(text, spec)
    n = spec.n
    if len(u) == 0:
        return set()
    if len(u) < n:
        return {tuple(u) if spec.unit == "word" else u}
    if spec.unit == "word":
        return {tuple(u[i:i + n]) for i in range(len(u) - n + 1)}
    return {u[i:i + n] for i in range(len(u) - n + 1)}


def jaccard(a: set[Any], b: set[Any]) -> float:
    if not a and not b:
        return 0.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


# ------------------------------------------------------------------------------------ vectorised hashing
def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, element-wise on a uint64 array (mod 2^64)."""
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> _U64(33))


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser, element-wise on a uint32 array (mod 2^32)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U64(r)) | (x >> _U64(64 - r))


def xxh64_short(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``xxh64(buf[s:s+l], seed=0)`` for every (s, l) with ``l < 32``, vectorised: uint64[m].

    ``buf`` is a uint8 array with at least 8 readable bytes after every word. Words are grouped by
    length (a stable radix sort of the lengths), so each group runs xxh64's short-input path
    (8-byte lanes, one 4-byte lane, single bytes, avalanche) as a fixed sequence of whole-array
    operations; unaligned 8-byte loads come from a stride-1 uint64 view of the buffer."""
    u = np.ndarray(shape=(len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))
    order = np.argsort(lens.astype(np.uint8), kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(lens, minlength=32))])
    ss = starts[order]
    out = np.empty(len(starts), np.uint64)
    for length in range(32):
        a, b = int(bounds[length]), int(bounds[length + 1])
        if a == b:
            continue
        s = ss[a:b]
        h = np.full(b - a, _U64(length) + _P5, np.uint64)
        off = 0
        for _ in range(length >> 3):
            k = u[s + off]
            k *= _P2
            k = _rotl(k, 31)
            k *= _P1
            h ^= k
            h = _rotl(h, 27)
            h *= _P1
            h += _P4
            off += 8
        if length & 4:
            k = u[s + off] & _M32
            k *= _P1
            h ^= k
            h = _rotl(h, 23)
            h *= _P2
            h += _P3
            off += 4
        for _ in range(length & 3):
            k = buf[s + off].astype(np.uint64)
            k *= _P5
            h ^= k
            h = _rotl(h, 11)
            h *= _P1
            off += 1
        h ^= h >> _U64(33)
        h *= _P2
        h ^= h >> _U64(29)
        h *= _P3
        h ^= h >> _U64(32)
        out[a:b] = h
    res = np.empty_like(out)
    res[order] = out
    return res


def _unicode_word_bytes(text: str) -> bytes:
    """The lower-cased UTF-8 bytes of a non-ASCII ``text`` whose word-byte runs (``_WORD_BYTES``: ASCII
    ``[0-9a-z_]`` and every byte >= 0x80) are exactly its ``\\w+`` words: each non-ASCII character that is
    not a word character (``str.isalnum``, what ``re``'s ``\\w`` tests beyond ``_``: dashes, ``°``, combining
    marks ...) becomes a space; the others keep all their bytes >= 0x80. The same words, in order, as
    ``" ".join(re.findall(r"\\w+", text.lower()))`` (tested), without building a string per word."""
    low = text.lower()
    for c in {c for c in set(low) if c >= "\x80" and not c.isalnum()}:
        low = low.replace(c, " ")
    return low.encode("utf-8")


def word_unit_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(xxh64 of every ``\\w+`` word of the lower-cased documents, in order: uint64[W]; words per
    document: int64[len(texts)]). Equal to ``[xxh64(w.encode()) for w in re.findall(r"\\w+", t.lower())]``.

    All documents of the batch are joined (``\\n``-separated) into one byte buffer: ASCII documents as
    they are (``bytes.lower`` and a ``bytes.translate`` word-byte table do the regex's job), non-ASCII
    documents lower-cased with their non-word characters turned into spaces (:func:`_unicode_word_bytes`).
    Word boundaries are the edges of the word-byte mask; words are hashed by :func:`xxh64_short`."""
    parts = [t.encode("ascii") if t.isascii() else _unicode_word_bytes(t) for t in texts]
    plen = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    raw = b"\n".join(parts).lower()
    total = len(raw)
    raw += b"\0" * (16 + (-(total + 16)) % 8)
    buf = np.frombuffer(raw, np.uint8)
    edge = np.diff(np.frombuffer(raw.translate(_WORD_BYTES), np.int8), prepend=np.int8(0))
    starts = np.flatnonzero(edge == 1)
    lens = np.flatnonzero(edge == -1) - starts
    doc_start = np.concatenate([[0], np.cumsum(plen + 1)[:-1]]).astype(np.int64)
    nwords = np.diff(np.searchsorted(starts, np.append(doc_start, total + 1)))
    long_words = np.flatnonzero(lens >= 32)
    h = xxh64_short(buf, starts, np.where(lens >= 32, 0, lens) if len(long_words) else lens)
    for k in long_words.tolist():
        h[k] = xxhash.xxh64_intdigest(raw[starts[k]:starts[k] + lens[k]])
    return h, nwords.astype(np.int64)


def _char_unit_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(``fmix64(code point + 1)`` of every character, in order; characters per document)."""
    cps = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    return fmix64(cps + _U64(1)), np.array([len(t) for t in texts], dtype=np.int64)


def shingle_fingerprints_batch(texts: list[str], spec: ShingleSpec) -> tuple[np.ndarray, np.ndarray]:
    """64-bit fingerprint of every shingle of every document, with repeats, concatenated in document
    order: (uint64[S], shingles per document int64[len(texts)]).

    fingerprint = fmix64(n' + Σ_{k<n'} u[i+k]·P_k mod 2^64) with n' = n, or n' = the number of units
    for a document with 1..n-1 units (one shingle); no units → no shingle."""
    uh, lens = (word_unit_hashes if spec.unit == "word" else _char_unit_hashes)(texts)
    n = spec.n
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    m = np.where(lens >= n, lens - n + 1, np.minimum(lens, 1))  # shingles per document
    short = (lens > 0) & (lens < n)
    first = np.repeat(offs - np.concatenate([[0], np.cumsum(m)[:-1]]), m) + np.arange(int(m.sum()))
    width = np.repeat(np.where(short, lens, n), m)  # units in each shingle
    h = width.astype(np.uint64)
    for k in range(n):
        if k == 0 or not short.any():
            h += uh[first + k] * POS_MULT[k]
        else:  # short documents' single shingle stops at their last unit
            take = width > k
            h[take] += uh[first[take] + k] * POS_MULT[k]
    return fmix64(h), m.astype(np.int64)


def shingle_sets_batch(texts: list[str], spec: ShingleSpec) -> tuple[np.ndarray, np.ndarray]:
    """Each document's shingle set as a sorted unique uint64 array, concatenated: (values, offsets
    int64[len(texts)+1]); document d is ``values[offsets[d]:offsets[d+1]]``."""
    fp, m = shingle_fingerprints_batch(texts, spec)
    bounds = np.concatenate([[0], np.cumsum(m)]).astype(np.int64)
    for d in np.flatnonzero(m > 1).tolist():
        fp[bounds[d]:bounds[d + 1]].sort()
    keep = np.ones(len(fp), dtype=bool)
    if len(fp):
        keep[1:] = fp[1:] != fp[:-1]
        keep[bounds[:-1][m > 0]] = True  # a document's first value is always new
    kept_before = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
    return fp[keep], kept_before[bounds]


def shingle_hashes(text: str, spec: ShingleSpec) -> np.ndarray:
    """32-bit element hash (high half of the fingerprint) of every shingle, with repeats, uint32[k]."""
    fp, _ = shingle_fingerprints_batch([text], spec)
    return (fp >> _U64(32)).astype(np.uint32)


def shingle_hashes_batch(texts: list[str], spec: ShingleSpec) -> list[np.ndarray]:
    """:func:`shingle_hashes` of many documents, vectorised over their concatenation."""
    fp, m = shingle_fingerprints_batch(texts, spec)
    h = (fp >> _U64(32)).astype(np.uint32)
    return np.split(h, np.cumsum(m)[:-1]) if len(texts) else []
