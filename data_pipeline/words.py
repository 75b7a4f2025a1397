"""Each clean text cut into words once, in the ingest workers: the tokenizer's training counts and the filter's
token ids both come from that one cut.

When the builder trains its SentencePiece ``gpt`` tokenizer (BPE, identity normalisation, split by whitespace),
the word cache encodes a text as the concatenation of its words' ids, with the words of the ``identity``
split (:func:`megatron_ds_suite.core.spm_words.spm_split`). So the ingest worker cuts each clean text with
that split and keeps, per shard, a :class:`WordIndex`: the shard's distinct words and, per text, the ids of
its words in them. From it

* the tokenizer's training counts are a ``bincount`` per distinct word (:func:`training_counts`): a word
  spanning a line break is counted as its pieces, as the sentence iterator cuts lines; a text whose lines
  this cannot reproduce (whitespace other than spaces and line breaks, a space next to a line break, a
  line over ``max_sentence_length`` bytes) is counted from its text;
* the filter encodes only the shard's distinct words (mostly cache hits) and gathers every text's ids with
  numpy (:func:`encode_indexed`), instead of looking up each word of each text in Python again.

Both give what the direct route gives (``count_training_words`` of the texts; ``encode_flat`` of the texts),
tested. Files per shard: ``docs-K.wvocab.json`` (the split's name and the distinct words) and
``docs-K.wix.npz`` (the ids; read with ``allow_pickle=False``).
"""
from __future__ import annotations

import itertools
import json
import re
from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.store import shard_name
from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.tokenizer_train import MAX_SENTENCE_LENGTH, WordCounts, count_training_words

SPLIT = "sentencepiece-identity"  # the only split indexed: the one of the tokenizer this builder trains
_OTHER_WS = re.compile(r"[^\S \n]")  # whitespace but the space and the line break (str.isspace's)
_OTHER_ASCII_WS = "\t\r\x0b\x0c\x1c\x1d\x1e\x1f"  # the same, in ASCII (faster tested one by one)


@dataclass
class WordIndex:
    """One shard's texts as word ids: text ``d``'s words are ``raw[raw_ids[...]]`` (``raw_n[d]`` of them, as
    they are) then ``spaced[spaced_ids[...]]`` (``spaced_n[d]``, each after one space)."""

    raw: list[str]
    spaced: list[str]
    raw_ids: np.ndarray
    raw_n: np.ndarray
    spaced_ids: np.ndarray
    spaced_n: np.ndarray

    @classmethod
    def build(cls, texts: Sequence[str]) -> WordIndex:
        from megatron_ds_suite.core.spm_words import spm_split

        split = spm_split("identity")
        raw: defaultdict[str, int] = defaultdict(itertools.count().__next__)  # word -> id, new ids on first sight
        spaced: defaultdict[str, int] = defaultdict(itertools.count().__next__)
        raw_id, spaced_id = raw.__getitem__, spaced.__getitem__
        raw_ids, spaced_ids = array("l"), array("l")  # C arrays: no Python int list to convert afterwards
        raw_n = np.empty(len(texts), dtype=np.int64)
        spaced_n = np.empty(len(texts), dtype=np.int64)
        for d, text in enumerate(texts):
            a, b = split(text)
            raw_ids.extend(map(raw_id, a))
            spaced_ids.extend(map(spaced_id, b))
            raw_n[d], spaced_n[d] = len(a), len(b)
        return cls(list(raw), list(spaced), _ids(raw_ids, len(raw)), raw_n, _ids(spaced_ids, len(spaced)), spaced_n)

    def save(self, folder: Path, k: int) -> None:
        with atomic.atomic_path(folder / f"{shard_name(k)}.wix.npz") as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, raw_ids=self.raw_ids, raw_n=self.raw_n, spaced_ids=self.spaced_ids, spaced_n=self.spaced_n)
        atomic.write_text(folder / f"{shard_name(k)}.wvocab.json",
                          json.dumps({"split": SPLIT, "raw": self.raw, "spaced": self.spaced}, ensure_ascii=False))

    @classmethod
    def load(cls, folder: Path, k: int) -> WordIndex | None:
        """Shard ``k``'s index, or ``None`` when it has none (another tokenizer, or an older ingest)."""
        vocab, arrays = folder / f"{shard_name(k)}.wvocab.json", folder / f"{shard_name(k)}.wix.npz"
        if not (vocab.is_file() and arrays.is_file()):
            return None
        v = json.loads(vocab.read_text(encoding="utf-8"))
        if v.get("split") != SPLIT:
            return None
        with np.load(arrays, allow_pickle=False) as z:
            return cls(v["raw"], v["spaced"], z["raw_ids"], z["raw_n"], z["spaced_ids"], z["spaced_n"])


def _ids(ids: array[int], distinct: int) -> np.ndarray:
    return np.frombuffer(ids, dtype=np.int64).astype(np.uint16 if distinct <= 1 << 16 else np.int32)


def training_counts(index: WordIndex, texts: Sequence[str],
                    max_sentence_length: int = MAX_SENTENCE_LENGTH) -> WordCounts | None:
    """``count_training_words(texts, max_sentence_length)``, from the index (see module docstring)."""
    safe = np.fromiter((_line_safe(t, max_sentence_length) for t in texts), dtype=bool, count=len(texts))
    out = WordCounts(docs=len(texts))
    for words, ids, n, prefix in ((index.raw, index.raw_ids, index.raw_n, ""),
                                  (index.spaced, index.spaced_ids, index.spaced_n, " ")):
        counts = np.bincount(ids[np.repeat(safe, n)], minlength=len(words)).tolist()
        out.words.update({prefix + w: c for w, c in zip(words, counts) if c and "\n" not in w})
        for w, c in zip(words, counts):
            if c and "\n" in w:  # the first piece ends a line, the others start lines
                for piece in (prefix + w).split("\n"):
                    if piece:
                        out.words[piece] += c
    out.lines = sum(1 if "\n" not in t else sum(1 for line in t.split("\n") if line)
                    for t, ok in zip(texts, safe.tolist()) if ok)
    rest = count_training_words([t for t, ok in zip(texts, safe.tolist()) if not ok], max_sentence_length)
    if rest is None:
        return None
    out.words.update(rest.words)
    out.lines += rest.lines
    return out


def _line_safe(text: str, max_sentence_length: int) -> bool:
    """Whether the index's words, cut at line breaks, are exactly the training words of ``text``: only spaces
    and line breaks as whitespace, no space next to a line break and no text of spaces only (so no line holds
    only whitespace), no U+2581, and no line that training would cut."""
    if not text or text.isspace() or " \n" in text or "\n " in text:
        return False
    if text.isascii():
        if any(c in text for c in _OTHER_ASCII_WS):
            return False
    elif "\u2581" in text or _OTHER_WS.search(text):
        return False
    if len(text) * 4 <= max_sentence_length:
        return True
    return all(len(line) * 4 <= max_sentence_length or len(line.encode("utf-8")) <= max_sentence_length
               for line in text.split("\n"))


def encode_indexed(words: Any, index: WordIndex) -> tuple[np.ndarray, np.ndarray]:
    """(ids of every text concatenated, tokens per text): ``words.encode_flat(texts)`` for the texts the index
    was built from, where ``words`` is a word cache with the ``identity`` split (tested equal)."""
    raw_rows, spaced_rows = words.rows_of(index.raw, index.spaced)
    n = len(index.raw_n)
    per_text = index.raw_n + index.spaced_n
    ends = np.cumsum(per_text)
    rows = np.empty(int(ends[-1]) if n else 0, dtype=np.int64)
    # in each text: its raw words, then its spaced words (the order encode_flat looks them up in)
    is_raw = np.zeros(len(rows), dtype=bool)
    starts = ends - per_text
    raw_pos = np.repeat(starts, index.raw_n) + (np.arange(int(index.raw_n.sum())) -
                                                np.repeat(np.cumsum(index.raw_n) - index.raw_n, index.raw_n))
    is_raw[raw_pos] = True
    rows[is_raw] = raw_rows[index.raw_ids]
    rows[~is_raw] = spaced_rows[index.spaced_ids]
    ids, lens = words.gather(rows)
    tok_at_word = np.concatenate([[0], np.cumsum(lens)])
    bounds = np.concatenate([[0], ends])
    return ids, tok_at_word[bounds[1:]] - tok_at_word[bounds[:-1]]
