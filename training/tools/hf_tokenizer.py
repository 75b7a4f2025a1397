"""Our tokenizers as Hugging Face fast tokenizers (``tokenizer.json``) that ``AutoTokenizer`` loads.

* GPT-2 BPE: ``GPT2TokenizerFast`` from the same ``vocab.json`` / ``merges.txt``.
* WordPiece: ``BertTokenizerFast`` from the same ``vocab.txt`` and lower-casing; ``hf``: the same
  ``tokenizer.json``.
* SentencePiece BPE (the ``gpt`` flavour :func:`data_pipeline.tokenizer_train.train_sentencepiece` writes, the
  main job's tokenizer): a ``tokenizers`` BPE model built from the ``.model`` file alone --

  - vocabulary = every piece at its SentencePiece id (control, unknown and ``<0xXX>`` byte pieces included);
  - merges = for every normal piece, each split into two normal pieces, ordered by the piece's score
    (SentencePiece BPE merges the adjacent pair whose union has the highest score; HF BPE merges the
    pair of lowest rank: ranking the merges by that score gives the same segmentation);
  - normaliser ``' ' -> '▁'`` (identity normalisation, no dummy prefix), ``byte_fallback`` for
    characters without a piece, decoder ``'▁' -> ' '`` + byte fusion.

  Control pieces are not registered as added tokens, so their literal spelling in text is encoded as
  text, as SentencePiece does; only the end-of-document piece is declared ``eos_token`` (transformers
  then matches its literal spelling, exactly as it does for GPT-2's ``<|endoftext|>``).

Every conversion is checked on probe texts (whitespace runs, digits, accents, CJK, emoji, NFKC-sensitive
characters) and refused with one line when any id differs, so an exported tokenizer is never silently
different (e.g. a BERT-flavour model: NFKC, dummy prefix). Unigram models are refused.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from megatron_ds_suite.core.errors import SuiteError

WORD = "\u2581"
PROBES = ("Hello  world\t tabs\n\nnew   lines 12345 3.14 -7,5%",
          "   leading spaces, trailing ones   ",
          "ünïcödé Ａｂｃ ﬁne café naïve — “quotes” ‘single’ 日本語のテキスト 😀👍🏽",
          "UPPER lower MiXeD \r\n crlf \u3000 ideographic space; literal <unk> and <0x41> spellings")


class TokenizerExportError(SuiteError):
    """A tokenizer that cannot be written as an identical HF tokenizer (one line)."""


def _bpe_merges(sp) -> list[tuple[str, str]]:
    """Merges ranked by the score of the piece they make (highest first), ties by id and split."""
    n = sp.GetPieceSize()
    special = {i for i in range(n) if sp.IsControl(i) or sp.IsUnknown(i) or sp.IsByte(i) or sp.IsUnused(i)}
    ids = {sp.IdToPiece(i): i for i in range(n) if i not in special}
    ranked = []
    for piece, i in ids.items():
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in ids and b in ids:
                ranked.append((-sp.GetScore(i), i, ids[a], ids[b], a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def _is_bpe(sp) -> bool:
    """SentencePiece BPE scores normal pieces -0, -1, -2, ... by merge order; unigram scores are log-probs."""
    scores = [sp.GetScore(i) for i in range(sp.GetPieceSize())
              if not (sp.IsControl(i) or sp.IsUnknown(i) or sp.IsByte(i) or sp.IsUnused(i))]
    return all(float(s).is_integer() for s in scores) and all(a >= b for a, b in zip(scores, scores[1:]))


def sentencepiece_bpe_to_tokenizers(tok):
    """A ``tokenizers.Tokenizer`` giving the same ids as ``tok`` (a SentencePieceTokenizer, BPE, gpt flavour)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    sp = tok.processor
    if not _is_bpe(sp):
        raise TokenizerExportError(f"{tok.model_file} is not a SentencePiece BPE model (unigram?): only BPE models "
                                   f"export to tokenizer.json with identical ids")
    vocab = {sp.IdToPiece(i): i for i in range(sp.GetPieceSize())}
    unk = sp.IdToPiece(sp.unk_id()) if sp.unk_id() >= 0 else None
    model = models.BPE(vocab=vocab, merges=_bpe_merges(sp), unk_token=unk, byte_fallback=True, fuse_unk=True)
    hf = Tokenizer(model)
    hf.normalizer = normalizers.Replace(" ", WORD)
    hf.decoder = decoders.Sequence([decoders.Replace(WORD, " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf


def first_difference(ours, encode, texts) -> str | None:
    """None if ``encode(text) == ours.encode(text)`` for every text, else a short description."""
    for text in texts:
        a, b = ours.encode(text), encode(text)
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"text {text[:40]!r}: ids differ from position {i} ({a[i:i + 3]} vs {b[i:i + 3]})"
    return None


def save_hf_tokenizer(tokenizer, out: Path, max_len: int) -> None:
    """Write ``tokenizer`` (GPT-2 BPE, SentencePiece BPE, WordPiece, hf) into ``out`` for ``AutoTokenizer``; raises
    TokenizerExportError when the HF tokenizer would give other ids."""
    from transformers import PreTrainedTokenizerFast

    kind = getattr(tokenizer, "kind", None)
    if kind == "gpt2_bpe":
        from transformers import GPT2TokenizerFast

        try:  # transformers 5: vocab / merges accept file paths
            hf_tok = GPT2TokenizerFast(vocab=str(tokenizer.vocab_file), merges=str(tokenizer.merges_file),
                                       model_max_length=max_len)
        except TypeError:  # transformers 4
            hf_tok = GPT2TokenizerFast(vocab_file=str(tokenizer.vocab_file), merges_file=str(tokenizer.merges_file),
                                       model_max_length=max_len)
    elif kind == "sentencepiece":
        backend = sentencepiece_bpe_to_tokenizers(tokenizer)
        eod = tokenizer.id_to_piece(tokenizer.eod)
        # unk stays the BPE model's own (not an added token: its literal spelling is text, as in SentencePiece)
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eod, bos_token=eod,
                                         model_max_length=max_len, clean_up_tokenization_spaces=False)
    elif kind == "wordpiece":
        from transformers import BertTokenizerFast

        with tempfile.TemporaryDirectory() as d:  # from_pretrained builds the fast tokenizer from vocab.txt
            shutil.copyfile(tokenizer.vocab_file, Path(d) / "vocab.txt")
            hf_tok = BertTokenizerFast.from_pretrained(d, do_lower_case=tokenizer.lowercase, model_max_length=max_len)
    elif kind == "hf":
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.tokenizer_file), model_max_length=max_len,
                                         eos_token=tokenizer.eod_token)
    else:
        raise TokenizerExportError(f"tokenizer kind {kind!r} cannot be exported")
    if len(hf_tok) != tokenizer.vocab_size:
        raise TokenizerExportError(f"the HF tokenizer has {len(hf_tok)} ids, ours {tokenizer.vocab_size}")
    hf_tok.model_max_length = 1 << 60  # probes may be longer than the model: no length warning while checking
    diff = first_difference(tokenizer, lambda t: hf_tok(t, add_special_tokens=False)["input_ids"], PROBES)
    hf_tok.model_max_length = max_len
    if diff:
        raise TokenizerExportError(f"the HF version of this {kind} tokenizer would not reproduce our ids ({diff}); "
                                   f"only GPT-2 BPE and gpt-flavour SentencePiece BPE export exactly")
    hf_tok.save_pretrained(str(out))
