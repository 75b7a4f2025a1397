"""A word -> ids cache for tokenizers whose ids of a text are the concatenation of its words' ids.

Byte-level BPE with a pre-tokenizer (GPT-2) and SentencePiece BPE trained with ``split_by_whitespace``
(:mod:`megatron_ds_suite.core.spm_words` proves when) never join characters across the point where
whitespace follows a non-whitespace character, so a text can be cut there into *words* (a whitespace run plus
the following non-whitespace run) and each word encoded on its own. Natural text repeats its words (Zipf),
so only unseen words go to the tokenizer; the original GPT-2 encoder caches per word the same way.

Every cached word has a row in a growing CSR table (``ids[start[w]:start[w] + length[w]]``). Two word
dictionaries point into it: ``raw`` (the ids of exactly that string) and ``spaced`` (``w`` -> the ids of
``" " + w``), so a text with single spaces between words, the common case, is split with ``str.split`` (no
regex, no string building); a batch is then one dictionary lookup per word and one numpy gather.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence

import numpy as np

CACHE_LIMIT = 200_000  # words cached per encoder (when full, cleared but for the words at hand; ~60 MB at most, measured)

Split = Callable[[str], "tuple[list[str], list[str]] | None"]
"""text -> (words for ``raw``, words for ``spaced``) in order, or ``None``: encode the text whole."""

_ASCII_WS = " \t\n\r\x0b\x0c"
_ASCII_WORDS = re.compile(f"[{_ASCII_WS}]*[^{_ASCII_WS}]+|[{_ASCII_WS}]+")
_WORDS = re.compile(r"\s*\S+|\s+")  # Python's \s: str.isspace (Unicode White_Space plus \x1c-\x1f)
_OTHER_WS = re.compile(r"[^\S ]")  # any whitespace but the plain space
_NOT_WS_EVERYWHERE = re.compile("[\x1c-\x1f]")  # whitespace to Python's str.isspace, not to Unicode/Rust


def single_space_split(text: str, word_re: re.Pattern[str], spaces: str) -> tuple[list[str], list[str]]:
    """Words of ``text`` (whitespace = the characters of ``spaces``, ``word_re`` = ``[ws]*[^ws]+|[ws]+``):
    ``str.split(" ")`` when the text is single-spaced with no other whitespace, else the regex."""
    if text and text[0] != " " and text[-1] != " " and "  " not in text and not any(c in text for c in spaces[1:]):
        words = text.split(" ")
        return words[:1], words[1:]
    return word_re.findall(text), []


def whitespace_split(text: str) -> tuple[list[str], list[str]] | None:
    r"""Words for GPT-2's regex pre-tokenizer, which never matches across a non-whitespace -> whitespace
    boundary (its whitespace runs end before a word, its words start with at most one space; no lookbehind),
    so words cut there are independent. A cut is made only where Python's whitespace follows Python's
    non-whitespace: Python's whitespace (``str.isspace``) is Unicode White_Space, which the Rust regex's
    ``\s`` is, plus the separators \x1c-\x1f, which are not, so a text holding one goes whole. Single-spaced
    text without other whitespace takes ``str.split(" ")``."""
    if _NOT_WS_EVERYWHERE.search(text):
        return None
    if text.isascii():
        return single_space_split(text, _ASCII_WORDS, _ASCII_WS)
    if text and text[0] != " " and text[-1] != " " and "  " not in text and not _OTHER_WS.search(text):
        words = text.split(" ")
        return words[:1], words[1:]
    return _WORDS.findall(text), []


class WordCache:
    """``encode_flat(texts)`` / ``encode_batch(texts)``: the ids ``encode_many`` gives for the whole texts,
    built from cached words (see module docstring); texts ``split`` declines go to ``encode_many`` whole."""

    def __init__(self, encode_many: Callable[[list[str]], list[list[int]]], split: Split,
                 cache_limit: int = CACHE_LIMIT, split_name: str | None = None) -> None:
        self.encode_many = encode_many
        self.split = split
        self.split_name = split_name  # names ``split`` for texts cut elsewhere (data_pipeline/words.py)
        self.cache_limit = cache_limit
        self._reset()

    def _reset(self) -> None:
        self.raw: dict[str, int] = {}
        self.spaced: dict[str, int] = {}
        self._ids = np.zeros(1 << 16, dtype=np.int64)
        self._start = np.zeros(1 << 12, dtype=np.int64)
        self._len = np.zeros(1 << 12, dtype=np.int64)
        self._n_words = self._n_ids = 0

    @property
    def cached_words(self) -> int:
        return self._n_words

    def _add(self, table: dict[str, int], words: set[str], prefix: str) -> None:
        words = words.difference(table)  # iterates ``words`` (checked in the table), not the whole table
        if not words:
            return
        todo = list(words)
        encoded = self.encode_many([prefix + w for w in todo] if prefix else todo)
        lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(todo))
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lens.sum()))
        w0, i0 = self._n_words, self._n_ids
        w1, i1 = w0 + len(todo), i0 + len(flat)
        if w1 > len(self._len):
            cap = max(w1, 2 * len(self._len))
            self._start, self._len = np.resize(self._start, cap), np.resize(self._len, cap)
        if i1 > len(self._ids):
            self._ids = np.resize(self._ids, max(i1, 2 * len(self._ids)))
        self._ids[i0:i1] = flat
        self._len[w0:w1] = lens
        self._start[w0:w1] = i0 + np.cumsum(lens) - lens
        table.update(zip(todo, range(w0, w1)))
        self._n_words, self._n_ids = w1, i1

    def rows_of(self, raw: Sequence[str], spaced: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Table rows (int64) of the distinct words ``raw`` (encoded as they are) and ``spaced`` (encoded with
        a leading space), unseen ones encoded now: with :meth:`gather`, the ids of texts already cut into
        words by this cache's ``split`` (the corpus builder cuts them once, in its ingest workers). Rows stay
        valid until the next call of this method or :meth:`encode_flat`."""
        new_raw, new_spaced = set(raw).difference(self.raw), set(spaced).difference(self.spaced)
        if self._n_words + len(new_raw) + len(new_spaced) > self.cache_limit:
            self._keep_only(raw, spaced)
        self._add(self.raw, new_raw, "")
        self._add(self.spaced, new_spaced, " ")
        return (np.fromiter(map(self.raw.__getitem__, raw), dtype=np.int64, count=len(raw)),
                np.fromiter(map(self.spaced.__getitem__, spaced), dtype=np.int64, count=len(spaced)))

    def _keep_only(self, raw: Sequence[str], spaced: Sequence[str]) -> None:
        """Empty the cache but for the words of ``raw`` and ``spaced`` it holds, their ids kept (compacted into a
        new table, not encoded again): a full cache is cleared this way when a batch's new words do not fit,
        so the words a corpus repeats from shard to shard (most of each shard's) are encoded once per encoder,
        not once per clearing."""
        keep_raw = [w for w in raw if w in self.raw]
        keep_spaced = [w for w in spaced if w in self.spaced]
        rows = np.fromiter(itertools.chain(map(self.raw.__getitem__, keep_raw), map(self.spaced.__getitem__, keep_spaced)),
                           dtype=np.int64, count=len(keep_raw) + len(keep_spaced))
        ids, lens = self.gather(rows)
        self._reset()
        n = len(rows)
        self._ids = np.concatenate([ids, np.zeros(max(1 << 16, len(ids)), dtype=np.int64)])
        self._len = np.concatenate([lens, np.zeros(max(1 << 12, n), dtype=np.int64)])
        self._start = np.concatenate([np.cumsum(lens) - lens, np.zeros(max(1 << 12, n), dtype=np.int64)])
        self.raw = dict(zip(keep_raw, range(len(keep_raw))))
        self.spaced = dict(zip(keep_spaced, range(len(keep_raw), n)))
        self._n_words, self._n_ids = n, len(ids)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the words at table ``rows``, concatenated in order; tokens per word), both int64."""
        lens = self._len[rows]
        # token t of word k is _ids[_start[rows[k]] + t]
        first = np.cumsum(lens) - lens
        return self._ids[np.repeat(self._start[rows] - first, lens) + np.arange(int(lens.sum()))], lens

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:  # noqa: C901
        """(ids of all texts concatenated, int64; tokens per text, int64)."""
        parts = [self.split(t) for t in texts]
        if self._n_words > self.cache_limit:
            self._reset()
        raw, spaced = self.raw.__getitem__, self.spaced.__getitem__
        words: list[int] = []  # word-table rows of all word-wise texts, in order
        words_per_text = np.zeros(len(texts), dtype=np.int64)
        for attempt in (0, 1):
            words.clear()
            missing = []
            for i, p in enumerate(parts):
                if p is None:
                    continue
                n = len(words)
                try:
                    words.extend(map(raw, p[0]))
                    words.extend(map(spaced, p[1]))
                except KeyError:  # an unseen word: encode the batch's new words, then look up again
                    del words[n:]
                    missing.append(p)
                words_per_text[i] = len(words) - n
            if not missing:
                break
            assert attempt == 0, "every word was added"
            new_raw: set[str] = set()
            new_spaced: set[str] = set()
            for p in missing:
                new_raw.update(p[0])
                new_spaced.update(p[1])
            self._add(self.raw, new_raw, "")
            self._add(self.spaced, new_spaced, " ")
        whole: dict[int, list[int]] = {}
        todo = [i for i, p in enumerate(parts) if p is None]  # not provably word-wise: the tokenizer itself
        if todo:
            whole = dict(zip(todo, map(list, self.encode_many([texts[i] for i in todo]))))
        ids, lens = self.gather(np.asarray(words, dtype=np.int64))
        ntok = np.zeros(len(texts), dtype=np.int64)
        word_bounds = np.concatenate([[0], np.cumsum(words_per_text)])  # a text's words: [bounds[i], bounds[i+1])
        tok_at_word = np.concatenate([[0], np.cumsum(lens)])
        ntok[:] = tok_at_word[word_bounds[1:]] - tok_at_word[word_bounds[:-1]]
        if not whole:
            return ids, ntok
        pieces, pos = [], 0
        for i in range(len(texts)):
            if i in whole:
                pieces.append(np.asarray(whole[i], dtype=np.int64))
                ntok[i] = len(whole[i])
            else:
                pieces.append(ids[pos:pos + ntok[i]])
                pos += int(ntok[i])
        return (np.concatenate(pieces) if pieces else ids), ntok

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        ids, ntok = self.encode_flat(texts)
        bounds = np.cumsum(ntok)[:-1]
        return [x.tolist() for x in np.split(ids, bounds)] if len(texts) else []
