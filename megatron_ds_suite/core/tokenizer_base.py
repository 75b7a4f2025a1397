"""The interface every tokenizer of the project follows (:class:`Tokenizer`), its error and file checks.

The tokenizers themselves live in :mod:`megatron_ds_suite.core.tokenizer` (GPT-2 BPE, SentencePiece,
:func:`~megatron_ds_suite.core.tokenizer.load_tokenizer`) and :mod:`megatron_ds_suite.core.hf_tokenizers`
(WordPiece, ``tokenizer.json``); both build on this module, which imports neither.
"""
from __future__ import annotations

import abc
import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_ds_suite.core.errors import SuiteError

BERT_SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class TokenizerError(SuiteError):
    """Bad tokenizer files or spec (one line saying what is wrong)."""


def sha256_file(path: Path) -> str:
    """sha256 of the file at ``path`` (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def need_file(path: str | Path, what: str) -> Path:
    """``path`` as a Path; a TokenizerError naming ``what`` when it is not a file."""
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"{what} {str(p)!r} does not exist or is not a file")
    return p


class Tokenizer(abc.ABC):
    """Common interface.

    ``vocab_size`` is the number of real ids (no Megatron padding: the model pads to a multiple of
    ``make_vocab_size_divisible_by * TP`` itself).  ``eod`` separates documents in the GPT stream.
    ``cls/sep/mask/pad/unk`` are BERT-style special ids, ``None`` when the vocabulary has none.
    """

    kind: str
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    pad: int | None = None
    unk: int | None = None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def eod(self) -> int: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (implementations use the library's native batch path)."""
        return [self.encode(t) for t in texts]

    def encode_flat(self, texts: Sequence[str]) -> tuple[Any, Any]:
        """``(ids, lengths)``: the ids of all ``texts`` concatenated and the count per text (int64 numpy
        arrays), for callers that store tokens in bulk (the corpus builder)."""
        import numpy as np

        out = self.encode_batch(texts)
        lens = np.fromiter(map(len, out), dtype=np.int64, count=len(out))
        return np.fromiter(itertools.chain.from_iterable(out), dtype=np.int64, count=int(lens.sum())), lens

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """Alias of :meth:`decode` (Megatron's name)."""
        return self.decode(ids)

    @abc.abstractmethod
    def spec(self) -> dict[str, Any]:
        """JSON-able description; ``load_tokenizer(spec, base_dir)`` rebuilds an identical tokenizer."""

    def file_sha256(self) -> dict[str, str]:
        """sha256 of each of the tokenizer's files, by spec key (computed once): what identifies the
        tokenizer by content, so a replaced file with the same vocabulary size is still noticed."""
        if self.__dict__.get("_sha256") is None:
            self._sha256 = {k: sha256_file(Path(getattr(self, k))) for k in ("vocab_file", "merges_file", "model_file", "tokenizer_file")
                            if getattr(self, k, None) is not None}
        return dict(self._sha256)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        n = self.vocab_size
        for i in out:
            if i < 0 or i >= n:
                raise TokenizerError(
                    f"token id {i} is outside the {self.kind} vocabulary [0, {n}) "
                    "(padded-vocabulary ids from a model must be removed before decoding)"
                )
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"
