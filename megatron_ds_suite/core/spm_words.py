"""Word-cached SentencePiece encoding: the same ids as ``SentencePieceProcessor.Encode``, several times faster.

SentencePiece trained with ``split_by_whitespace`` (its default) never learns a piece that has a
whitespace symbol ``▁`` after its first character, except whitespace-only pieces. BPE encoding only ever
merges neighbours into vocabulary pieces, highest score first and ties to the left, so no piece spans a point
where ``▁`` follows a non-``▁`` character, the merges on either side of it never interact, and the ids of a
text are the concatenation of the ids of its *words* (a run of ``▁`` plus the following run of other
characters), each encoded on its own. (Unigram models are left out: their Viterbi path scores accumulate
over the whole text in floating point, so a near-tie inside a word can resolve differently in context; seen
on botchan, "auto" -> ``a|u|to`` in the text vs ``a|ut|o`` alone.) Natural text repeats
its words (Zipf), so the encoder keeps a cache word -> ids and sends only unseen words to SentencePiece.
This is what the original GPT-2 encoder does per word; here it is applied only where it provably gives the
processor's own output (``tests/test_spm_words.py`` compares both on real corpora and on inputs built to break
each assumption):

* ``identity`` normalization without dummy prefix or whitespace removal (this project's GPT flavour): any
  text; a word is ``[ ▁]*[^ ▁]+`` or a trailing run of ``[ ▁]+`` (a literal ``▁`` is the space symbol too).
* ``nmt_nfkc``/``nfkc`` (optionally ``_cf``) or ``identity`` normalization with dummy prefix and whitespace
  removal (the BERT flavour): printable ASCII texts (unchanged by those normalizations apart from
  whitespace), words split on spaces, each encoded as SentencePiece encodes it alone (with its ``▁``
  dummy prefix); other texts go to SentencePiece whole.

Anything else (unigram, word or char models; user-defined pieces, which are matched across words; whitespace as
suffix; custom normalization rules) disables the cache: every text goes to SentencePiece unchanged.
The model's settings are read from its serialized proto with a minimal protobuf wire reader (the fields
below), so no protobuf runtime is needed.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

# sentencepiece_model.proto field numbers (checked against sentencepiece's own descriptors in the tests)
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TYPE = 3
_TRAINER_MODEL_TYPE, _TRAINER_SPLIT_WS, _TRAINER_WS_SUFFIX = 3, 22, 24
_NORM_NAME, _NORM_DUMMY_PREFIX, _NORM_REMOVE_WS, _NORM_ESCAPE_WS = 1, 3, 4, 5
_USER_DEFINED, _UNIGRAM, _BPE = 4, 1, 2

_IDENTITY_WORDS = re.compile("[ \u2581]*[^ \u2581]+|[ \u2581]+")
_PREFIX_NORMALIZERS = {"identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"}
CACHE_LIMIT = 200_000  # words cached per encoder (cleared when full; ~60 MB at most, measured)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def proto_fields(buf: bytes) -> dict[int, list[Any]]:
    """Top-level fields of one protobuf message: number -> values (ints for varints, bytes otherwise)."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.setdefault(num, []).append(val)
    return out


def word_mode(model_proto: bytes) -> str | None:
    """``"identity"``, ``"prefix"`` or ``None`` (no word cache) for a serialized SentencePiece model."""
    model = proto_fields(model_proto)

    def sub(num: int) -> dict[int, list[Any]]:
        return proto_fields(model[num][-1]) if num in model else {}

    def get(msg: dict[int, list[Any]], num: int, default: Any) -> Any:
        return msg[num][-1] if num in msg else default

    trainer, norm = sub(_MODEL_TRAINER), sub(_MODEL_NORMALIZER)
    if get(trainer, _TRAINER_MODEL_TYPE, _UNIGRAM) != _BPE:
        return None
    if not get(trainer, _TRAINER_SPLIT_WS, 1) or get(trainer, _TRAINER_WS_SUFFIX, 0):
        return None
    if not get(norm, _NORM_ESCAPE_WS, 1):
        return None
    if any(get(proto_fields(p), _PIECE_TYPE, 1) == _USER_DEFINED for p in model.get(_MODEL_PIECES, [])):
        return None
    name = bytes(get(norm, _NORM_NAME, b"")).decode()
    dummy, remove_ws = bool(get(norm, _NORM_DUMMY_PREFIX, 1)), bool(get(norm, _NORM_REMOVE_WS, 1))
    if name == "identity" and not dummy and not remove_ws:
        return "identity"
    if name in _PREFIX_NORMALIZERS and dummy and remove_ws:
        return "prefix"
    return None


class WordCachedEncoder:
    """``encode_batch(texts)`` equal to ``[list(x) for x in sp.Encode(texts, out_type=int)]``;
    ``encode_flat(texts)`` the same ids concatenated (numpy) with one length per text.

    Every cached word has a row in a growing CSR table (``ids[start[w]:start[w] + length[w]]``). Two word
    dictionaries point into it: ``raw`` (the ids of exactly that string) and ``spaced`` (``w`` -> the ids of
    ``" " + w``), so a text with single spaces between words, the common case, is split with ``str.split``
    (no regex, no string building); a batch is then one dictionary lookup per word and one numpy gather."""

    def __init__(self, sp: Any, cache_limit: int = CACHE_LIMIT) -> None:
        self.sp = sp
        self.mode = word_mode(sp.serialized_model_proto())
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

    def _split(self, text: str) -> tuple[list[str], list[str]] | None:
        """(words for ``raw``, words for ``spaced``), in order; ``None``: not word-wise, encode it whole."""
        if self.mode == "identity":
            if text and text[0] != " " and text[-1] != " " and "  " not in text and "\u2581" not in text:
                words = text.split(" ")
                return words[:1], words[1:]
            return _IDENTITY_WORDS.findall(text), []
        if self.mode == "prefix" and text.isascii() and text.isprintable():
            return text.split(), []  # each word alone gets the dummy-prefix "▁", as in the text
        return None

    def _add(self, table: dict[str, int], words: set[str], prefix: str) -> None:
        words.difference_update(table.keys())
        if not words:
            return
        todo = list(words)
        encoded = self.sp.Encode([prefix + w for w in todo] if prefix else todo, out_type=int)
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

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of all texts concatenated, int64; tokens per text, int64)."""
        parts = [self._split(t) for t in texts]
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
        todo = [i for i, p in enumerate(parts) if p is None]  # not provably word-wise: SentencePiece itself
        if todo:
            whole = dict(zip(todo, map(list, self.sp.Encode([texts[i] for i in todo], out_type=int))))
        w = np.asarray(words, dtype=np.int64)
        lens = self._len[w]
        total = int(lens.sum())
        # gather: token t of word k is _ids[_start[w[k]] + t]
        first = np.cumsum(lens) - lens
        ids = self._ids[np.repeat(self._start[w] - first, lens) + np.arange(total)]
        ntok = np.zeros(len(texts), dtype=np.int64)
        word_bounds = np.concatenate([[0], np.cumsum(words_per_text)])
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
