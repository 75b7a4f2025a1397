"""Tokenizers users already have: a BERT WordPiece ``vocab.txt`` and a Hugging Face ``tokenizer.json``.

* :class:`WordPieceTokenizer` (``kind: wordpiece``) -- BERT's WordPiece from ``vocab.txt``, run by the Rust
  ``tokenizers`` library with BERT's pipeline: clean text, CJK characters split, optional lower-casing
  (with accent stripping, as BERT's uncased models), split on whitespace and punctuation, greedy
  longest-match-first word pieces (``##`` continuation), ``[UNK]`` for words longer than 100 characters
  or without a match. Ids equal ``transformers.BertTokenizerFast(vocab_file, do_lower_case=...)``
  (Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``) on text. ``[CLS] [SEP] [MASK] [PAD]
  [UNK]`` are looked up by name; ``eod`` is ``[SEP]``. Their literal spelling in text is encoded as text
  (as every tokenizer of this project does; transformers would match it as the special id).
* :class:`HFTokenizer` (``kind: hf``) -- any ``tokenizer.json``, encoded without added special tokens
  (no BOS/EOS post-processing); ``eod`` is ``eod_token`` from the spec or the first of
  ``<|endoftext|>``, ``</s>``, ``<eos>``, ``[SEP]`` in the vocabulary.

Both follow :class:`megatron_ds_suite.core.tokenizer_base.Tokenizer` (``spec()`` / ``load_tokenizer``).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_ds_suite.core.tokenizer_base import BERT_SPECIAL_PIECES, Tokenizer, TokenizerError, need_file

EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class _TokenizersBacked(Tokenizer):
    """Shared encode/decode over a ``tokenizers.Tokenizer`` held in ``self._tok``."""

    _tok: Any

    def _specials(self) -> None:
        def find(name: str) -> int | None:
            i = self._tok.token_to_id(name)
            return None if i is None else int(i)

        self.pad, self.unk, self.cls, self.sep, self.mask = (find(n) for n in BERT_SPECIAL_PIECES)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self._tok.id_to_token(int(i))


class WordPieceTokenizer(_TokenizersBacked):
    """BERT WordPiece from ``vocab.txt`` (see the module docstring)."""

    kind = "wordpiece"

    def __init__(self, vocab_file: str | Path, lowercase: bool = True) -> None:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        self.vocab_file = need_file(vocab_file, "WordPiece vocab.txt").resolve()
        self.lowercase = bool(lowercase)
        vocab: dict[str, int] = {}
        with open(self.vocab_file, encoding="utf-8") as f:
            for line in f:
                token = line.rstrip("\n")
                if token and token not in vocab:  # BERT's load_vocab: one token per line, id = line number
                    vocab[token] = len(vocab)
        if "[UNK]" not in vocab:
            raise TokenizerError(f"{str(self.vocab_file)!r} has no [UNK] line: not a BERT WordPiece vocab.txt")
        tok = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                    lowercase=self.lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        self._tok = tok
        self._specials()
        if self.sep is None:
            raise TokenizerError(f"{str(self.vocab_file)!r} has no [SEP] token (used as end-of-document)")

    @property
    def eod(self) -> int:
        return int(self.sep)

    def is_word_start(self, i: int) -> bool:
        """A piece starts a word unless it is a ``##`` continuation (whole-word masking)."""
        return not self.id_to_piece(i).startswith("##")

    def word_start_mask(self) -> Any:
        import numpy as np

        return np.array([self.is_word_start(i) for i in range(self.vocab_size)], dtype=bool)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_file": str(self.vocab_file), "lowercase": self.lowercase,
                "vocab_size": self.vocab_size, "eod": self.eod, "sha256": self.file_sha256()}


class HFTokenizer(_TokenizersBacked):
    """A ``tokenizer.json`` (see the module docstring)."""

    kind = "hf"

    def __init__(self, tokenizer_file: str | Path, eod_token: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.tokenizer_file = need_file(tokenizer_file, "tokenizer.json").resolve()
        try:
            self._tok = RustTokenizer.from_file(str(self.tokenizer_file))
        except Exception as e:  # noqa: BLE001 - the Rust library raises plain Exception on bad JSON
            raise TokenizerError(f"{str(self.tokenizer_file)!r} is not a tokenizers JSON file: "
                                 f"{str(e).splitlines()[0][:120]}") from None
        self._specials()
        names = (eod_token,) if eod_token else EOD_CANDIDATES
        ids = [self._tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if not found:
            raise TokenizerError(f"{str(self.tokenizer_file)!r} has none of {', '.join(names)} to use as "
                                 f"end-of-document; name one with eod_token in the tokenizer spec")
        self.eod_token, self._eod = found[0][0], int(found[0][1])

    @property
    def eod(self) -> int:
        return self._eod

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "tokenizer_file": str(self.tokenizer_file), "eod_token": self.eod_token,
                "vocab_size": self.vocab_size, "eod": self.eod, "sha256": self.file_sha256()}
