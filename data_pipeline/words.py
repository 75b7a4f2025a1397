"""Each clean text cut into words once, in the ingest workers: the filter's token ids and (for the tokenizer
the builder trains) the tokenizer's training counts both come from that one cut.

The word cache (:mod:`megatron_ds_suite.core.word_cache`) encodes a text as the concatenation of its words'
ids, with the words of the tokenizer's split: SentencePiece's ``identity`` split for the ``gpt`` flavour this
builder trains (``sentencepiece-identity``), the whitespace split for GPT-2 BPE files (``gpt2-whitespace``).
When the config names one of these tokenizers, the ingest worker cuts each clean text with its split and
keeps, per shard, a :class:`WordIndex`: the shard's distinct words and, per text, the ids of its words in
them. From it

* the filter encodes only the shard's distinct words (mostly cache hits) and gathers every text's ids with
  numpy (:func:`encode_indexed`), instead of looking up each word of each text in Python again;
* the tokenizer's training counts are a ``bincount`` per distinct word (:func:`training_counts`, the
  ``identity`` split only): a word spanning a line break is counted as its pieces, as the sentence iterator
  cuts lines; a text whose lines this cannot reproduce (whitespace other than spaces and line breaks, a
  space next to a line break, a line over ``max_sentence_length`` bytes) is counted from its text.

Both give what the direct route gives (``encode_flat`` of the texts; ``count_training_words`` of the texts),
tested. Files per shard: ``docs-K.wvocab.json`` (the split's name and the distinct words, or their numbers
with the words NUL-joined in ``docs-K.wvocab.txt``) and
``docs-K.wix.npz`` (the ids; read with ``allow_pickle=False``).
"""
from __future__ import annotations

import itertools
import json
import re
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.files import read_word_list, write_word_list
from data_pipeline.store import shard_name
from data_pipeline.tokenizer_train import MAX_SENTENCE_LENGTH, WordCounts, count_training_words
from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.spm_words import spm_split
from megatron_ds_suite.core.word_cache import whitespace_split

SPM_IDENTITY, GPT2_WHITESPACE = "sentencepiece-identity", "gpt2-whitespace"  # word splits an index can use


def _split(name: str) -> Callable[[str], tuple[list[str], list[str]] | None]:
    """The word cache's split called ``name`` (``WordCache.split_name``)."""
    if name == SPM_IDENTITY:
        return spm_split("identity")
    if name == GPT2_WHITESPACE:
        return whitespace_split
    raise ValueError(f"no word split named {name!r}")


_OTHER_WS = re.compile(r"[^\S \n]")  # whitespace but the space and the line break (str.isspace's)
_OTHER_ASCII_WS = "\t\r\x0b\x0c\x1c\x1d\x1e\x1f"  # the same, in ASCII (faster tested one by one)


@dataclass
class WordIndex:
    """One shard's texts as word ids under the word split ``split``: text ``d``'s words are
    ``raw[raw_ids[...]]`` (``raw_n[d]`` of them, as they are) then ``spaced[spaced_ids[...]]`` (``spaced_n[d]``,
    each after one space); a text the split declines (``whole[d]``) has no words and is encoded whole."""

    split: str
    raw: list[str]
    spaced: list[str]
    raw_ids: np.ndarray
    raw_n: np.ndarray
    spaced_ids: np.ndarray
    spaced_n: np.ndarray
    whole: np.ndarray

    @classmethod
    def build(cls, texts: Sequence[str], split_name: str) -> WordIndex:
        split = _split(split_name)
        raw: defaultdict[str, int] = defaultdict(itertools.count().__next__)  # word -> id, new ids on first sight
        spaced: defaultdict[str, int] = defaultdict(itertools.count().__next__)
        raw_id, spaced_id = raw.__getitem__, spaced.__getitem__
        raw_ids, spaced_ids = array("q"), array("q")  # 64-bit C arrays (any platform): no Python int list to convert afterwards
        raw_n = np.zeros(len(texts), dtype=np.int64)
        spaced_n = np.zeros(len(texts), dtype=np.int64)
        whole = np.zeros(len(texts), dtype=bool)
        for d, text in enumerate(texts):
            words = split(text)
            if words is None:
                whole[d] = True
                continue
            a, b = words
            raw_ids.extend(map(raw_id, a))
            spaced_ids.extend(map(spaced_id, b))
            raw_n[d], spaced_n[d] = len(a), len(b)
        return cls(split_name, list(raw), list(spaced), _ids(raw_ids, len(raw)), raw_n,
                   _ids(spaced_ids, len(spaced)), spaced_n, whole)

    def save(self, folder: Path, k: int) -> None:
        """``docs-K.wix.npz`` (the ids), then ``docs-K.wvocab.json``: the split's name and the distinct words,
        inline, or (no word holding a NUL, the common case) counts only, the words NUL-joined in
        ``docs-K.wvocab.txt`` (a join instead of a JSON string per word: ~2x cheaper to write and read)."""
        with atomic.atomic_path(folder / f"{shard_name(k)}.wix.npz") as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, raw_ids=self.raw_ids, raw_n=self.raw_n, spaced_ids=self.spaced_ids,
                         spaced_n=self.spaced_n, whole=self.whole)
        vocab = folder / f"{shard_name(k)}.wvocab.json"
        if write_word_list(folder / f"{shard_name(k)}.wvocab.txt", (*self.raw, *self.spaced), "\0"):
            atomic.write_text(vocab, json.dumps({"split": self.split, "raw_n": len(self.raw), "spaced_n": len(self.spaced)}))
        else:
            atomic.write_text(vocab, json.dumps({"split": self.split, "raw": self.raw, "spaced": self.spaced},
                                                ensure_ascii=False))

    @classmethod
    def load(cls, folder: Path, k: int) -> WordIndex | None:
        """Shard ``k``'s index, or ``None`` when it has none (another tokenizer, or an older ingest)."""
        vocab, arrays = folder / f"{shard_name(k)}.wvocab.json", folder / f"{shard_name(k)}.wix.npz"
        if not (vocab.is_file() and arrays.is_file()):
            return None
        v = json.loads(vocab.read_text(encoding="utf-8"))
        if "raw" not in v:  # the words in the NUL-joined text file
            n_raw, n_spaced = int(v["raw_n"]), int(v["spaced_n"])
            words = read_word_list(folder / f"{shard_name(k)}.wvocab.txt", n_raw + n_spaced, "\0")
            v = {"split": v["split"], "raw": words[:n_raw], "spaced": words[n_raw:]}
        with np.load(arrays, allow_pickle=False) as z:
            return cls(v["split"], v["raw"], v["spaced"], z["raw_ids"], z["raw_n"], z["spaced_ids"], z["spaced_n"],
                       z["whole"])


def _ids(ids: array[int], distinct: int) -> np.ndarray:
    return np.frombuffer(ids, dtype=np.int64).astype(np.uint16 if distinct <= 1 << 16 else np.int32)


def training_counts(index: WordIndex, texts: Sequence[str], max_sentence_length: int = MAX_SENTENCE_LENGTH,
                    normalized: bool = False) -> WordCounts | None:
    """``count_training_words(texts, max_sentence_length)``, from an index of the ``identity`` split (see
    module docstring). ``normalized``: every text is an output of
    :func:`data_pipeline.clean.normalize_whitespace` (the ingest worker's), so the whitespace checks of
    :func:`_line_safe` hold already (:func:`_line_safe_normalized`)."""
    if index.split != SPM_IDENTITY:
        raise ValueError(f"training counts come from a {SPM_IDENTITY} index, not {index.split}")
    check = _line_safe_normalized if normalized else _line_safe
    safe = np.fromiter((check(t, max_sentence_length) for t in texts), dtype=bool, count=len(texts))
    out = WordCounts(docs=len(texts))
    tables = [(index.raw, index.raw_ids, index.raw_n, ""), (index.spaced, index.spaced_ids, index.spaced_n, " ")]
    # the larger table first: Counter.update copies a mapping into an empty Counter in C, but adds to a
    # non-empty one key by key in Python (same counts either way: addition commutes)
    tables.sort(key=lambda t: -len(t[0]))
    for words, ids, n, prefix in tables:
        counts = np.bincount(ids[np.repeat(safe, n)], minlength=len(words)).tolist()
        out.words.update({prefix + w: c for w, c in zip(words, counts) if c and "\n" not in w})
        for w, c in zip(words, counts):
            if c and "\n" in w:  # the first piece ends a line, the others start lines
                for piece in (prefix + w).split("\n"):
                    if piece:
                        out.words[piece] += c
    if normalized:  # no "\n" at either end and no "\n\n\n": the empty lines are the "\n\n"s
        out.lines = sum(t.count("\n") + 1 - t.count("\n\n") for t, ok in zip(texts, safe.tolist()) if ok)
    else:
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


def _line_safe_normalized(text: str, max_sentence_length: int) -> bool:
    """:func:`_line_safe` for a non-empty output of ``normalize_whitespace``, which has no whitespace but spaces
    and line breaks, no space next to a line break and no leading or trailing whitespace (so it is not
    whitespace only): only the U+2581 and line-length checks are left (tested equal)."""
    if not text or "\u2581" in text:
        return False
    if len(text) * 4 <= max_sentence_length:
        return True
    return all(len(line) * 4 <= max_sentence_length or len(line.encode("utf-8")) <= max_sentence_length
               for line in text.split("\n"))


def encode_indexed(words: Any, index: WordIndex, text_of: Callable[[int], str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids of every text concatenated, tokens per text): ``words.encode_flat(texts)`` for the texts the index
    was built from, where ``words`` is a word cache with the index's split (tested equal). ``text_of(d)``
    gives text ``d``, read only for the texts the split declined."""
    raw_rows, spaced_rows = words.rows_of(index.raw, index.spaced)
    per_text = index.raw_n + index.spaced_n
    ends = np.cumsum(per_text)
    rows = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    # in each text: its raw words, then its spaced words (the order encode_flat looks them up in)
    is_raw = np.zeros(len(rows), dtype=bool)
    raw_pos = np.repeat(ends - per_text, index.raw_n) + (np.arange(int(index.raw_n.sum())) -
                                                         np.repeat(np.cumsum(index.raw_n) - index.raw_n, index.raw_n))
    is_raw[raw_pos] = True
    rows[is_raw] = raw_rows[index.raw_ids]
    rows[~is_raw] = spaced_rows[index.spaced_ids]
    ids, lens = words.gather(rows)
    tok_at_word = np.concatenate([[0], np.cumsum(lens)])
    bounds = np.concatenate([[0], ends])
    ntok = tok_at_word[bounds[1:]] - tok_at_word[bounds[:-1]]
    whole = np.flatnonzero(index.whole).tolist()
    if not whole:
        return ids, ntok
    wids, wn = words.encode_flat([text_of(d) for d in whole])  # spliced in at their places
    starts = np.concatenate([[0], np.cumsum(ntok)])
    wstarts = np.concatenate([[0], np.cumsum(wn)])
    pieces, prev = [], 0
    for j, d in enumerate(whole):
        pieces += [ids[starts[prev]:starts[d]], wids[wstarts[j]:wstarts[j + 1]]]
        ntok[d] = wn[j]
        prev = d + 1
    pieces.append(ids[starts[prev]:])
    return np.concatenate(pieces), ntok
