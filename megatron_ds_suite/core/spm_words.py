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
processor's own output (``tests/unit/test_word_cache.py`` compares both on real corpora and on inputs built to break
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

import re
from typing import Any

from megatron_ds_suite.core.word_cache import CACHE_LIMIT, Split, WordCache, single_space_split

# sentencepiece_model.proto field numbers (checked against sentencepiece's own descriptors in the tests)
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TYPE = 3
_TRAINER_MODEL_TYPE, _TRAINER_SPLIT_WS, _TRAINER_WS_SUFFIX = 3, 22, 24
_NORM_NAME, _NORM_DUMMY_PREFIX, _NORM_REMOVE_WS, _NORM_ESCAPE_WS = 1, 3, 4, 5
_USER_DEFINED, _UNIGRAM, _BPE = 4, 1, 2

_IDENTITY_WORDS = re.compile("[ \u2581]*[^ \u2581]+|[ \u2581]+")
_PREFIX_NORMALIZERS = {"identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"}


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


def spm_split(mode: str | None) -> Split:
    """The word split of :func:`word_mode`'s ``mode`` (``None``: every text whole)."""
    def identity(text: str) -> tuple[list[str], list[str]]:
        return single_space_split(text, _IDENTITY_WORDS, " \u2581")

    def prefix(text: str) -> tuple[list[str], list[str]] | None:
        if text.isascii() and text.isprintable():
            return text.split(), []  # each word alone gets the dummy-prefix "▁", as in the text
        return None

    return {"identity": identity, "prefix": prefix}.get(mode or "", lambda text: None)


class WordCachedEncoder(WordCache):
    """``encode_batch(texts)`` equal to ``[list(x) for x in sp.Encode(texts, out_type=int)]`` (and
    ``encode_flat``, the same ids concatenated), through the word cache where :func:`word_mode` allows."""

    def __init__(self, sp: Any, cache_limit: int = CACHE_LIMIT) -> None:
        self.sp = sp
        self.mode = word_mode(sp.serialized_model_proto())
        super().__init__(lambda texts: sp.Encode(texts, out_type=int), spm_split(self.mode), cache_limit,
                         f"sentencepiece-{self.mode}" if self.mode else None)
