"""Training a SentencePiece tokenizer (BPE) for the corpus: the ``gpt`` and ``bert`` flavours.

The ids of the special pieces are fixed by construction (see :func:`train_sentencepiece`), so a model
trained here loads as :class:`megatron_ds_suite.core.tokenizer.SentencePieceTokenizer` with the suite's
EOD / BERT special ids.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.tokenizer import GPT_EOD_PIECE, SentencePieceTokenizer, TokenizerError
from megatron_ds_suite.core.tokenizer_base import BERT_SPECIAL_PIECES

logger = logging.getLogger(__name__)


MAX_SENTENCES = 1_000_000  # default cap on training sentences (the first ones, in order)
MAX_SENTENCE_LENGTH = 4192  # bytes: longer lines are cut (SentencePiece would skip them)


def training_lines(text: str, max_sentence_length: int) -> list[str]:
    """The sentences training takes from one text: its non-empty lines, each cut at a character boundary to
    at most ``max_sentence_length`` UTF-8 bytes (SentencePiece would silently skip a longer one)."""
    out = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        if len(line) * 4 > max_sentence_length:  # a line this short in characters cannot be too long in bytes
            b = line.encode("utf-8")
            if len(b) > max_sentence_length:
                line = b[:max_sentence_length].decode("utf-8", errors="ignore")
        out.append(line)
    return out


def _training_sentences(texts: Iterable[str], max_sentences: int, max_sentence_length: int) -> Iterator[str]:
    """Non-empty lines of ``texts`` (:func:`training_lines` of each), at most ``max_sentences`` of them."""
    n = 0
    for text in texts:
        for line in training_lines(text, max_sentence_length):
            yield line
            n += 1
            if n >= max_sentences:
                return


#: A SentencePiece "word" of the ``gpt`` flavour (identity normalisation, no dummy prefix, whitespace kept,
#: ``split_by_whitespace`` and ``allow_whitespace_only_pieces``): a word starts at a space that follows a
#: non-space (only U+0020 becomes the meta symbol; a tab or NBSP is an ordinary character), so it is a run of
#: spaces and the non-space run after it, or a trailing run of spaces. BPE merges never cross these cuts.
_SPM_WORD = re.compile(r" *[^ ]+| +")


@dataclass
class WordCounts:
    """How often each training word occurs in a run of documents, and how many documents and sentences those
    were: what :func:`train_sentencepiece` needs instead of the sentences themselves (``gpt`` flavour)."""

    words: Counter[str] = field(default_factory=Counter)
    docs: int = 0
    lines: int = 0

    def merge(self, other: WordCounts) -> None:
        self.words.update(other.words)
        self.docs += other.docs
        self.lines += other.lines

    def to_json(self) -> dict[str, Any]:
        return {"docs": self.docs, "lines": self.lines, "words": dict(self.words)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WordCounts:
        return cls(Counter(d["words"]), int(d["docs"]), int(d["lines"]))


def count_training_words(texts: Iterable[str], max_sentence_length: int = MAX_SENTENCE_LENGTH, max_docs: int | None = None,
                         max_lines: int | None = None) -> WordCounts | None:
    """The words of the sentences :func:`train_sentencepiece` would train on for ``texts`` (at most
    ``max_docs`` texts and ``max_lines`` sentences, cut exactly where the sentence iterator stops), counted.

    ``None`` when a sentence holds a tab (SentencePiece reads ``word<TAB>count`` rows: such a word cannot be
    given as a count) or U+2581, SentencePiece's own space symbol (its runs with spaces are cut differently):
    train on the sentences instead. Single-spaced lines (all of them after the
    builder's whitespace normalisation) are split with ``str.split``, the rest with :data:`_SPM_WORD`."""
    first: Counter[str] = Counter()  # first words of single-spaced lines (no leading space)
    rest: Counter[str] = Counter()  # the other words of single-spaced lines, without their one space
    out = WordCounts()
    for text in texts:
        if max_docs is not None and out.docs >= max_docs:
            break
        out.docs += 1
        lines = training_lines(text, max_sentence_length)
        if max_lines is not None and out.lines + len(lines) >= max_lines:
            lines = lines[:max_lines - out.lines]
            max_docs = out.docs  # the sentence iterator stops inside this text
        out.lines += len(lines)
        for line in lines:
            if "\t" in line or "\u2581" in line:
                return None
            if line[0] != " " and line[-1] != " " and "  " not in line:
                words = line.split(" ")
                first[words[0]] += 1
                rest.update(words[1:])
            else:
                out.words.update(_SPM_WORD.findall(line))
    out.words.update(first)
    out.words.update({" " + w: c for w, c in rest.items()})
    return out


def train_sentencepiece(  # noqa: C901
    texts: Iterable[str],
    out_prefix: str | Path,
    vocab_size: int,
    flavor: Literal["gpt", "bert"] = "gpt",
    seed: int = 1234,
    *,
    model_type: Literal["bpe", "unigram"] = "bpe",
    max_sentences: int = MAX_SENTENCES,
    max_sentence_length: int = MAX_SENTENCE_LENGTH,
    character_coverage: float = 0.9995,
    num_threads: int = 1,
    lowercase: bool = False,
    word_counts: WordCounts | None = None,
) -> SentencePieceTokenizer:
    """Train a SentencePiece model on an in-memory iterator and write ``{out_prefix}.model`` (+ ``.vocab``).

    ``word_counts`` (``gpt`` flavour, BPE): train on :func:`count_training_words` of the texts instead of
    the texts (``texts`` is then not read). SentencePiece's BPE trainer only ever sees words and their
    counts: given as ``word<TAB>count`` rows (``input_format=tsv``) they yield the same pieces and scores as
    the sentences (tested), about 10x faster, and the counting runs wherever the texts already are (the
    corpus builder counts in its ingest workers). The ``.model`` then records ``input_format: "tsv"``.

    Flavours (ids fixed by construction):

    * ``"gpt"``: 0 ``<unk>``, 1 ``<|endoftext|>`` (EOS control symbol = ``eod``), then the 256 byte
      pieces ``<0x00>..<0xFF>`` (``byte_fallback``: any text encodes without ``<unk>``), then learned
      pieces.  Identity normalisation, whitespace kept, no dummy prefix, whitespace-only pieces allowed:
      ``decode(encode(s)) == s`` for every string.
    * ``"bert"``: 0 ``[PAD]``, 1 ``[UNK]``, 2 ``[CLS]``, 3 ``[SEP]``, 4 ``[MASK]``, then byte pieces,
      then learned pieces.  NFKC normalisation (``lowercase=True`` adds case folding), runs of whitespace
      collapsed, a dummy '▁' prefix so *every* word's first piece starts with '▁' (whole-word masking:
      a piece without '▁' continues the previous word).  ``eod`` is ``[SEP]``.

    Determinism: the input is the first ``max_sentences`` non-empty lines in iteration order (no
    sampling), training runs with ``num_threads`` (default 1) and SentencePiece's generator is seeded
    with ``seed``, so the same input and seed give a byte-identical model.

    The model is written to a temporary name then renamed; nothing is left behind on failure.
    """
    import sentencepiece as spm

    if flavor not in ("gpt", "bert"):
        raise TokenizerError(f"flavor must be 'gpt' or 'bert', got {flavor!r}")
    if model_type not in ("bpe", "unigram"):
        raise TokenizerError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    n_reserved = 2 if flavor == "gpt" else len(BERT_SPECIAL_PIECES)
    if vocab_size < n_reserved + 256 + 1:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small: {n_reserved} special + 256 byte pieces are reserved; use >= {n_reserved + 257}"
        )
    if word_counts is not None and (flavor != "gpt" or model_type != "bpe"):
        raise TokenizerError("word_counts trains only the gpt flavour's BPE (NFKC, a dummy prefix or unigram "
                             "scoring see the sentences, not words): pass the texts instead")
    if max_sentences < 1:
        raise TokenizerError(f"max_sentences must be >= 1, got {max_sentences}")
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=character_coverage,
        num_threads=num_threads,
        input_sentence_size=0,  # we cap ourselves, in order: no random sampling
        shuffle_input_sentence=False,
        max_sentence_length=max_sentence_length,
        minloglevel=2,
        bos_id=-1,
    )
    if flavor == "gpt":
        common.update(
            unk_id=0,
            eos_id=1,
            eos_piece=GPT_EOD_PIECE,
            pad_id=-1,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
        )
    else:
        common.update(
            pad_id=0,
            pad_piece="[PAD]",
            unk_id=1,
            unk_piece="[UNK]",
            eos_id=-1,
            control_symbols=["[CLS]", "[SEP]", "[MASK]"],
            normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
            remove_extra_whitespaces=True,
            add_dummy_prefix=True,
            split_digits=True,
        )

    counter = {"n": 0}

    def it() -> Iterator[str]:
        for s in _training_sentences(texts, max_sentences, max_sentence_length):
            counter["n"] += 1
            yield s

    if word_counts is not None:  # sorted rows: the same counts give the same input whatever their origin
        common["input_format"] = "tsv"
        counter["n"] = word_counts.lines
        sentences: Iterator[str] = iter([f"{w}\t{c}" for w, c in sorted(word_counts.words.items()) if c > 0])
    else:
        sentences = it()
    try:
        first = next(sentences)
    except StopIteration:
        raise TokenizerError("train_sentencepiece got no non-empty text to train on") from None
    buf = io.BytesIO()
    spm.set_random_generator_seed(int(seed))
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=itertools.chain([first], sentences), model_writer=buf, **common
        )
    except RuntimeError as e:
        raise TokenizerError(
            f"SentencePiece training failed on {counter['n']} sentences with vocab_size={vocab_size}: {e} "
            "(a too-large vocab_size for a small corpus is the usual cause)"
        ) from None
    model_bytes = buf.getvalue()

    model_path = out_prefix.with_name(out_prefix.name + ".model")
    vocab_path = out_prefix.with_name(out_prefix.name + ".vocab")
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    atomic.write_text(vocab_path, "".join(f"{sp.IdToPiece(i)}\t{sp.GetScore(i):g}\n" for i in range(sp.GetPieceSize())))
    atomic.write_bytes(model_path, model_bytes)  # the .model after its .vocab, as before
    logger.info(
        "trained SentencePiece %s/%s: %d sentences, vocab %d -> %s", flavor, model_type, counter["n"], vocab_size, model_path
    )
    return SentencePieceTokenizer(model_path)
