"""Training a SentencePiece tokenizer (BPE) for the corpus: the ``gpt`` and ``bert`` flavours.

The ids of the special pieces are fixed by construction (see :func:`train_sentencepiece`), so a model
trained here loads as :class:`megatron_ds_suite.core.tokenizer.SentencePieceTokenizer` with the suite's
EOD / BERT special ids.
"""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.tokenizer import (BERT_SPECIAL_PIECES, GPT_EOD_PIECE, SentencePieceTokenizer,
                                              TokenizerError)

logger = logging.getLogger(__name__)


def _training_sentences(texts: Iterable[str], max_sentences: int, max_sentence_length: int) -> Iterator[str]:
    """Non-empty lines of ``texts`` (each text may hold many lines), at most ``max_sentences`` of them.

    Lines longer than ``max_sentence_length`` bytes are cut at a character boundary (SentencePiece would
    silently skip them otherwise).
    """
    n = 0
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            b = line.encode("utf-8")
            if len(b) > max_sentence_length:
                line = b[:max_sentence_length].decode("utf-8", errors="ignore")
            yield line
            n += 1
            if n >= max_sentences:
                return


def train_sentencepiece(
    texts: Iterable[str],
    out_prefix: str | Path,
    vocab_size: int,
    flavor: Literal["gpt", "bert"] = "gpt",
    seed: int = 1234,
    *,
    model_type: Literal["bpe", "unigram"] = "bpe",
    max_sentences: int = 1_000_000,
    max_sentence_length: int = 4192,
    character_coverage: float = 0.9995,
    num_threads: int = 1,
    lowercase: bool = False,
) -> SentencePieceTokenizer:
    """Train a SentencePiece model on an in-memory iterator and write ``{out_prefix}.model`` (+ ``.vocab``).

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
