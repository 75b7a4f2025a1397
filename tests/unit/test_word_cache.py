"""Word-cached encoding (megatron_ds_suite.core.word_cache, spm_words) gives the tokenizer's own ids.

SentencePiece: on real corpora for both flavours and both model types, on inputs built to break each
assumption (runs of spaces, a literal '▁', tabs and newlines, Unicode spaces, combining marks, emoji, digits,
very long words), with a cache that overflows; the cache is refused for models where words are not
independent. GPT-2 byte-level BPE: the Rust library's whole-text ids on the same texts and on ASCII
whitespace edge cases (runs, tabs, CRLF, vertical tab, form feed, the \x1c-\x1f separators, contractions)."""
from __future__ import annotations

import io
import json
from functools import lru_cache
from pathlib import Path

import pytest
import sentencepiece as spm

from data_pipeline.tokenizer_train import train_sentencepiece
from megatron_ds_suite.core.spm_words import WordCachedEncoder, proto_fields, spm_split, word_mode
from megatron_ds_suite.core.tokenizer import SentencePieceTokenizer
from megatron_ds_suite.core.word_cache import WordCache

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
BOTCHAN = DATA / "corpus" / "botchan.txt"
SHAKESPEARE = DATA / "corpus" / "tinyshakespeare.txt"
WIKITEXT = DATA / "eval" / "wikitext-103" / "wiki.valid.tokens"
LAMBADA = DATA / "eval" / "lambada" / "lambada_test.jsonl"
needs_data = pytest.mark.skipif(not (BOTCHAN.is_file() and SHAKESPEARE.is_file()), reason=f"corpora absent under {DATA}")

TRICKY = [
    "", " ", "  ", "\n", "a", " a", "a ", "  a  b   c  ", "word", "   ",
    "tabs\tand\nnewlines\n\n and\r\nCRLF \t mixed",
    "a literal \u2581 space symbol\u2581\u2581inside and\u2581 at the end\u2581",
    "\u2581leading symbol", " \u2581 \u2581",
    "unicode: héllo wörld — “quotes” … naïve café 東京 😀👍🏽 Ελληνικά русский",
    "\u00a0non-breaking\u2009thin\u3000ideographic  spaces\u00a0 ",
    "zero\u200bwidth\ufeffbom and combining e\u0301 A\u030a ﬁ ligature ＦＵＬＬ width",
    "numbers 1234567890 3.14159 1e-10 -42 ١٢٣ ②",
    "x" * 3000 + " " + "yz" * 500,
    "punctuation!!! ??? ... ;;; ((( ))) @#$%^&* '' \"\" `` ~~",
    "UPPER lower MiXeD CaSe The THE the",
    "control \x00 \x01 \x1f \x7f chars",
]


def corpus_texts() -> list[str]:
    texts = []
    for path in (BOTCHAN, SHAKESPEARE):
        paras = [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        texts += ["\n\n".join(paras[i:i + 6]) for i in range(0, len(paras), 6)]
    return texts


def eval_texts() -> list[str]:
    texts = []
    if WIKITEXT.is_file():
        lines = WIKITEXT.read_text(encoding="utf-8").splitlines()
        texts += ["\n".join(lines[i:i + 40]) for i in range(0, min(len(lines), 4000), 40)]
    if LAMBADA.is_file():
        with open(LAMBADA, encoding="utf-8") as f:
            texts += [json.loads(x)["text"] for _, x in zip(range(1500), f)]
    return texts


@lru_cache(maxsize=None)
def model(flavor: str, model_type: str, lowercase: bool = False) -> SentencePieceTokenizer:
    import tempfile

    out = Path(tempfile.mkdtemp()) / f"{flavor}_{model_type}"
    return train_sentencepiece(corpus_texts(), out, 2000, flavor=flavor, model_type=model_type,  # type: ignore[arg-type]
                               lowercase=lowercase)


def assert_same(tok: SentencePieceTokenizer, texts: list[str], batch: int = 64, cache_limit: int = 200_000) -> WordCachedEncoder:
    sp = tok.processor
    enc = WordCachedEncoder(sp, cache_limit=cache_limit)
    for s in range(0, len(texts), batch):
        part = texts[s:s + batch]
        expect = [list(x) for x in sp.Encode(part, out_type=int)]
        got = enc.encode_batch(part)
        for text, e, g in zip(part, expect, got):
            assert g == e, f"{text[:80]!r}: {[sp.IdToPiece(i) for i in g][:20]} != {[sp.IdToPiece(i) for i in e][:20]}"
    return enc


@needs_data
@pytest.mark.parametrize("flavor,model_type,lowercase,mode", [
    ("gpt", "bpe", False, "identity"), ("bert", "bpe", False, "prefix"), ("bert", "bpe", True, "prefix"),
    ("gpt", "unigram", False, None),  # Viterbi over the whole text: near-ties resolve in context, no cache
])
def test_same_ids_as_sentencepiece(flavor: str, model_type: str, lowercase: bool, mode: str | None) -> None:
    tok = model(flavor, model_type, lowercase)
    assert word_mode(tok.processor.serialized_model_proto()) == mode
    texts = corpus_texts() + eval_texts() + TRICKY
    # one line per text too: the BERT flavour's cache covers printable-ASCII texts (no newlines)
    texts += [line for t in corpus_texts()[:200] for line in t.splitlines() if line.strip()]
    enc = assert_same(tok, texts)
    assert enc.cached_words > 1000 if mode else not enc.cached_words  # the words really went through the cache
    assert_same(tok, texts[:300] + TRICKY, batch=7, cache_limit=500)  # the cache overflows and is cleared
    # the tokenizer's own encode / encode_batch are the cached ones
    assert tok.encode_batch(TRICKY) == [list(x) for x in tok.processor.Encode(TRICKY, out_type=int)]
    flat, lens = tok.encode_flat(TRICKY)  # the corpus builder's bulk form
    expect = [list(x) for x in tok.processor.Encode(TRICKY, out_type=int)]
    assert lens.tolist() == [len(x) for x in expect] and flat.tolist() == [i for x in expect for i in x]
    assert [tok.encode(t) for t in TRICKY[:12]] == [list(tok.processor.Encode(t, out_type=int)) for t in TRICKY[:12]]


def _train_raw(**kw: object) -> spm.SentencePieceProcessor:
    buf = io.BytesIO()
    args = dict(vocab_size=600, model_type="bpe", byte_fallback=True, minloglevel=2, num_threads=1)
    args.update(kw)
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(corpus_texts()[:150]), model_writer=buf, **args)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


@needs_data
@pytest.mark.parametrize("settings", [
    dict(user_defined_symbols=["of\u2581the", "ing a"]),  # matched across words
    dict(treat_whitespace_as_suffix=True),
    dict(split_by_whitespace=False),
    dict(model_type="char"),
    dict(normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False),
])
def test_models_whose_words_interact_are_encoded_whole(settings: dict) -> None:
    sp = _train_raw(**settings)
    enc = WordCachedEncoder(sp)
    assert enc.mode is None
    texts = corpus_texts()[:100] + TRICKY
    assert enc.encode_batch(texts) == [list(x) for x in sp.Encode(texts, out_type=int)]
    assert not enc.cached_words


@needs_data
def test_words_would_differ_without_the_checks() -> None:
    """The refusals above matter: with words split on spaces, a user-defined piece spanning two words and
    a model without split_by_whitespace give other ids than SentencePiece (so the mode check is load-bearing)."""
    flat = [t.replace("\n", " ") for t in corpus_texts()[:100]]  # printable text: the "prefix" word split applies
    for settings in (dict(user_defined_symbols=["of\u2581the"]), dict(split_by_whitespace=False, vocab_size=2000)):
        sp = _train_raw(**settings)
        enc = WordCachedEncoder(sp)
        assert enc.mode is None
        forced = WordCache(lambda texts, sp=sp: sp.Encode(texts, out_type=int), spm_split("prefix"))  # refused split
        assert forced.encode_batch(flat) != [list(x) for x in sp.Encode(flat, out_type=int)]


def test_proto_field_numbers_match_sentencepiece_descriptors() -> None:
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2", exc_type=ImportError)
    fields = {(d.name, f.name): f.number for d in (pb.ModelProto.DESCRIPTOR, pb.TrainerSpec.DESCRIPTOR,
                                                   pb.NormalizerSpec.DESCRIPTOR, pb.ModelProto.SentencePiece.DESCRIPTOR)
              for f in d.fields}
    assert fields[("ModelProto", "pieces")] == 1
    assert fields[("ModelProto", "trainer_spec")] == 2
    assert fields[("ModelProto", "normalizer_spec")] == 3
    assert fields[("SentencePiece", "type")] == 3
    assert fields[("TrainerSpec", "model_type")] == 3
    assert fields[("TrainerSpec", "split_by_whitespace")] == 22
    assert fields[("TrainerSpec", "treat_whitespace_as_suffix")] == 24
    assert fields[("NormalizerSpec", "name")] == 1
    assert fields[("NormalizerSpec", "add_dummy_prefix")] == 3
    assert fields[("NormalizerSpec", "remove_extra_whitespaces")] == 4
    assert fields[("NormalizerSpec", "escape_whitespaces")] == 5
    assert pb.ModelProto.SentencePiece.USER_DEFINED == 4
    assert (pb.TrainerSpec.UNIGRAM, pb.TrainerSpec.BPE) == (1, 2)


def test_proto_reader_on_a_hand_built_message() -> None:
    # field 1 varint 150, field 2 bytes b"hi", field 1 again (repeated), field 3 fixed64
    msg = bytes([0x08, 0x96, 0x01, 0x12, 0x02]) + b"hi" + bytes([0x08, 0x01, 0x19]) + b"\x00" * 8
    assert proto_fields(msg) == {1: [150, 1], 2: [b"hi"], 3: [b"\x00" * 8]}


# ------------------------------------------------------------------------------------------------ GPT-2
GPT2_DIR = DATA / "tokenizers" / "gpt2"
ASCII_TRICKY = [
    "Hello world", "  two leading", "trailing  ", "a\n\nb", "a \n b", " \n", "\n ", "x\t\ty", "line\r\nnext",
    "don't 'S 're 'll 'd 've 'm 't 's", " 's 're", "word's", "3.14 42nd 1,000,000", "!!! ?? ...", "a  b   c",
    "\x0bvertical\x0cfeed", "sep\x1crecord\x1dgroup\x1eunit\x1f", "   ", " ", "", "<|endoftext|> literal",
    "end with newline\n", "\n\n\nParagraph\n\n\n", "tab\tthen space \t mixed",
]


@pytest.mark.skipif(not (GPT2_DIR / "gpt2-vocab.json").is_file(), reason="GPT-2 files absent")
@needs_data
def test_gpt2_word_cache_gives_the_rust_tokenizers_ids() -> None:
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

    tok = GPT2BPETokenizer(GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt")
    texts = corpus_texts() + eval_texts() + TRICKY + ASCII_TRICKY
    texts += [line for t in corpus_texts()[:200] for line in t.splitlines()]
    for s in range(0, len(texts), 64):
        part = texts[s:s + 64]
        expect = [tok.encode(t) for t in part]  # encode: the library, whole text (once per batch, for both checks)
        assert tok.encode_batch(part) == expect
        flat, lens = tok.encode_flat(part)
        assert flat.tolist() == [i for ids in expect for i in ids] and lens.tolist() == [len(ids) for ids in expect]
    assert tok._words.cached_words > 1000  # the texts really went word by word
    assert tok._words.split("caf\u00e9 au lait \u201cquoted\u201d") == (["caf\u00e9"], ["au", "lait", "\u201cquoted\u201d"])
    assert tok._words.split("a\x1cb") is None  # Python whitespace, not Unicode's: whole


@pytest.mark.skipif(not (GPT2_DIR / "gpt2-vocab.json").is_file(), reason="GPT-2 files absent")
def test_gpt2_word_cache_at_every_whitespace_character() -> None:
    """Every character Python calls whitespace (where words are cut), and a few that look like it but are
    not (zero-width space, BOM, word joiner, Mongolian vowel separator), next to letters, digits, punctuation,
    a space and each other: the cached ids equal the library's whole-text ids."""
    import sys

    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

    tok = GPT2BPETokenizer(GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt")
    spaces = [chr(i) for i in range(sys.maxunicode + 1) if chr(i).isspace()]
    assert len(spaces) >= 25
    texts = []
    for c in spaces + ["\u200b", "\ufeff", "\u2060", "\u180e"]:
        texts += [f"x{c}y", f"x{c}{c}y", f"x {c}y", f"x{c} y", f"{c}x", f"x{c}", f"it{c}'s", f"4{c}2", f"!{c}?",
                  f"caf\u00e9{c}na\u00efve {c} \u201cq\u201d", f"a{c}\n b",
                  f"\u00e9!{c}?", f"\u00e9 ({c}{c}) -{c}-"]  # non-ASCII: the Unicode path
    texts += [f"a{c}{d}b" for c in spaces for d in (" ", "\n", "\t")]
    for s in range(0, len(texts), 128):
        part = texts[s:s + 128]
        assert tok.encode_batch(part) == [tok.encode(t) for t in part]
