"""Tokenizers for corpus building, training and evaluation.

Two families, one interface (:class:`~megatron_ds_suite.core.tokenizer_base.Tokenizer`; WordPiece and
``tokenizer.json`` in :mod:`megatron_ds_suite.core.hf_tokenizers`):

* :class:`GPT2BPETokenizer` -- OpenAI GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, run by the
  Rust ``tokenizers`` library (byte-level pre-tokenizer with GPT-2's regex, *no* prefix space, byte-level
  decoder).  Ids are identical to OpenAI's ``encoder.py`` / Megatron's ``GPT2BPETokenizer``.
  The literal text ``<|endoftext|>`` is encoded as plain text (7 ids), exactly like OpenAI's encoder and
  Megatron's preprocessing: only :attr:`Tokenizer.eod` (50256), appended by the corpus builder, separates
  documents, so a web page that happens to contain the string cannot forge a document boundary.
* :class:`SentencePieceTokenizer` -- a SentencePiece model trained by
  :func:`data_pipeline.tokenizer_train.train_sentencepiece` in one of two flavours (ids fixed by
  construction).

Every tokenizer describes itself with :meth:`Tokenizer.spec` (a JSON-able dict) and is rebuilt with
:func:`load_tokenizer`; the corpus manifest stores that spec.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from megatron_ds_suite.core.hf_tokenizers import HFTokenizer, WordPieceTokenizer
from megatron_ds_suite.core.spm_words import WordCachedEncoder
from megatron_ds_suite.core.tokenizer_base import Tokenizer, TokenizerError, need_file, sha256_file
from megatron_ds_suite.core.word_cache import WordCache, whitespace_split

logger = logging.getLogger(__name__)

GPT2_EOD_TOKEN = "<|endoftext|>"
GPT_EOD_PIECE = "<|endoftext|>"
WORD_START = "\u2581"  # '▁': SentencePiece's marker for "this piece starts a new word"


class GPT2BPETokenizer(Tokenizer):
    """OpenAI GPT-2 byte-level BPE (50,257 ids; ``eod`` = 50256 ``<|endoftext|>``).

    ``encode`` never produces ``eod`` from text (see module docstring); ``decode([50256])`` gives the
    literal ``'<|endoftext|>'``.
    """

    kind = "gpt2_bpe"

    def __init__(self, vocab_file: str | Path, merges_file: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self.vocab_file = need_file(vocab_file, "GPT-2 vocab file").resolve()
        self.merges_file = need_file(merges_file, "GPT-2 merges file").resolve()
        try:
            with open(self.vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"GPT-2 vocab file {str(self.vocab_file)!r} is not valid JSON: {e}") from None
        if not isinstance(vocab, dict) or GPT2_EOD_TOKEN not in vocab:
            raise TokenizerError(
                f"GPT-2 vocab file {str(self.vocab_file)!r} is not a token->id map containing {GPT2_EOD_TOKEN!r}"
            )
        try:
            bpe = models.BPE.from_file(str(self.vocab_file), str(self.merges_file))
        except Exception as e:  # the Rust error names the offending line
            raise TokenizerError(f"cannot read GPT-2 BPE files {self.vocab_file}, {self.merges_file}: {e}") from None
        tok = _HFTokenizer(bpe)
        # GPT-2's regex split, bytes mapped to printable unicode; no prefix space (OpenAI does not add one).
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self._vocab_size = len(vocab)
        self._eod = int(vocab[GPT2_EOD_TOKEN])
        # encode_batch_fast (tokenizers >= 0.21) skips offset tracking; same ids, multi-threaded.
        fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self._encode_many = lambda texts: [e.ids for e in fast(texts, add_special_tokens=False)]
        # GPT-2's pre-tokenizer never spans a non-space -> space boundary: texts go word by word through a
        # cache (same ids as the library, tests/unit/test_word_cache.py); texts with \x1c-\x1f go to it whole
        self._words = WordCache(self._encode_many, whitespace_split, split_name="gpt2-whitespace")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._words.encode_batch(texts)

    def encode_flat(self, texts: Sequence[str]) -> tuple[Any, Any]:
        return self._words.encode_flat(texts)

    @property
    def word_cache(self) -> WordCache:
        """The word cache behind ``encode*`` (``split_name``: its word split)."""
        return self._words

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=False)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "vocab_file": str(self.vocab_file),
            "merges_file": str(self.merges_file),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "sha256": self.file_sha256(),
        }


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (normally from :func:`train_sentencepiece`).

    Special ids are looked up by piece name: ``<|endoftext|>`` -> ``eod`` (GPT flavour); ``[PAD]``,
    ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` -> ``pad/unk/cls/sep/mask`` (BERT flavour).  Without an
    ``<|endoftext|>`` piece, ``eod`` falls back to the model's EOS id, then to ``[SEP]``.
    Special pieces are control symbols: text containing their literal spelling is encoded as ordinary
    text, never as the special id.  ``decode`` renders the EOD id as the literal ``<|endoftext|>`` (like
    GPT-2) and drops the other control ids.
    """

    kind = "sentencepiece"

    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece as spm

        self.model_file = need_file(model_file, "SentencePiece model file").resolve()
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(self.model_file))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{str(self.model_file)!r} is not a SentencePiece model: {e}") from None
        self._sp = sp
        self._words = WordCachedEncoder(sp)  # same ids as sp.Encode, unseen words only go to SentencePiece
        self._vocab_size = int(sp.GetPieceSize())

        def piece(name: str) -> int | None:
            i = int(sp.PieceToId(name))
            # PieceToId returns unk_id for unknown pieces: check the round trip.
            return i if sp.IdToPiece(i) == name else None

        self.pad = piece("[PAD]")
        self.unk = piece("[UNK]")
        if self.unk is None and sp.unk_id() >= 0:
            self.unk = int(sp.unk_id())
        self.cls = piece("[CLS]")
        self.sep = piece("[SEP]")
        self.mask = piece("[MASK]")
        eod = piece(GPT_EOD_PIECE)
        if eod is None and sp.eos_id() >= 0:
            eod = int(sp.eos_id())
        if eod is None:
            eod = self.sep
        if eod is None:
            raise TokenizerError(
                f"SentencePiece model {str(self.model_file)!r} has no {GPT_EOD_PIECE!r}, EOS or [SEP] piece to "
                "use as end-of-document; train it with data_pipeline.tokenizer_train.train_sentencepiece"
            )
        self._eod = eod
        self.flavor: Literal["gpt", "bert"] = "bert" if self.cls is not None and self.mask is not None else "gpt"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def processor(self) -> Any:
        """The underlying ``sentencepiece.SentencePieceProcessor``."""
        return self._sp

    @property
    def word_cache(self) -> WordCachedEncoder:
        """The word cache behind ``encode*`` (``.mode``: its word split; ``None`` = texts encoded whole)."""
        return self._words

    def encode(self, text: str) -> list[int]:
        return self._words.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._words.encode_batch(texts)

    def encode_flat(self, texts: Sequence[str]) -> tuple[Any, Any]:
        return self._words.encode_flat(texts)

    def decode(self, ids: Sequence[int]) -> str:
        ids = self._check_ids(ids)
        if self._eod not in ids:
            return self._sp.Decode(ids)
        parts, cur = [], []
        for i in ids:
            if i == self._eod:
                parts.append(self._sp.Decode(cur))
                cur = []
            else:
                cur.append(i)
        parts.append(self._sp.Decode(cur))
        return GPT_EOD_PIECE.join(parts)

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))

    def is_word_start(self, i: int) -> bool:
        """True when piece ``i`` begins a new word (its piece starts with '▁').

        Whole-word masking groups a word-start piece with the following non-word-start pieces (byte
        fallback pieces ``<0x..>`` continue the current word).  Special/control ids count as word starts.
        """
        i = int(i)
        if self._sp.IsControl(i) or self._sp.IsUnknown(i):
            return True
        return self._sp.IdToPiece(i).startswith(WORD_START)

    def word_start_mask(self) -> Any:
        """``np.ndarray[bool]`` of length ``vocab_size``: :meth:`is_word_start` for every id (vectorised lookups)."""
        return np.array([self.is_word_start(i) for i in range(self.vocab_size)], dtype=bool)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model_file": str(self.model_file),
            "flavor": self.flavor,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "sha256": self.file_sha256(),
        }


def load_tokenizer(spec: dict[str, Any], base_dir: str | Path | None = None) -> Tokenizer:  # noqa: C901
    """Rebuild a tokenizer from :meth:`Tokenizer.spec`.  Relative file paths resolve against ``base_dir``.

    If the spec records ``vocab_size``/``eod`` and the files' ``sha256`` (every spec written since issue
    14), the loaded files must agree: a swapped file is refused even when its vocabulary has the same size.
    """
    if not isinstance(spec, dict) or "kind" not in spec:
        raise TokenizerError(f"tokenizer spec must be a dict with a 'kind' key, got {spec!r}")
    base = Path(base_dir) if base_dir is not None else None

    def path(key: str) -> Path:
        if key not in spec:
            raise TokenizerError(f"tokenizer spec of kind {spec['kind']!r} lacks {key!r}: {spec!r}")
        p = Path(os.path.expanduser(str(spec[key])))
        if not p.is_absolute() and base is not None:
            p = base / p
        return p

    kind = spec["kind"]
    tok: Tokenizer
    if kind == GPT2BPETokenizer.kind:
        tok = GPT2BPETokenizer(path("vocab_file"), path("merges_file"))
    elif kind == SentencePieceTokenizer.kind:
        tok = SentencePieceTokenizer(path("model_file"))
    elif kind in ("wordpiece", "hf"):  # tokenizers users bring (megatron_ds_suite.core.hf_tokenizers)
        tok = (WordPieceTokenizer(path("vocab_file"), bool(spec.get("lowercase", True))) if kind == "wordpiece"
               else HFTokenizer(path("tokenizer_file"), spec.get("eod_token")))
    else:
        raise TokenizerError(
            f"unknown tokenizer kind {kind!r}; expected {GPT2BPETokenizer.kind!r}, {SentencePieceTokenizer.kind!r}, "
            "'wordpiece' or 'hf'"
        )
    for key in ("vocab_size", "eod"):
        if key in spec and int(spec[key]) != getattr(tok, key):
            raise TokenizerError(
                f"tokenizer files do not match the spec: {key} is {getattr(tok, key)} but the spec says {spec[key]}"
            )
    recorded = spec.get("sha256") or {}
    have = tok.file_sha256() if recorded else {}
    for key, digest in sorted(recorded.items()):
        if have.get(key) != digest:
            raise TokenizerError(
                f"tokenizer file {path(key)} has sha256 {str(have.get(key))[:12]}... but {digest[:12]}... was "
                f"recorded when the corpus/checkpoint was made: it is another tokenizer (same vocabulary size is "
                f"not enough); restore the original file"
            )
    return tok


def tokenizer_file_digests(spec: dict[str, Any], base_dir: str | Path | None = None) -> dict[str, str]:
    """sha256 of each file a spec names (for manifests / provenance)."""
    out = {}
    for k, v in spec.items():
        if k.endswith("_file"):
            p = Path(v)
            if not p.is_absolute() and base_dir is not None:
                p = Path(base_dir) / p
            out[k] = sha256_file(p)
    return out
