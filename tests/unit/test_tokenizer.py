"""Tokenizers: GPT-2 BPE parity with transformers' GPT2Tokenizer and with an independent pure-Python port of
OpenAI's encoder.py; SentencePiece flavours, special ids and training determinism."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from data_pipeline.tokenizer_train import train_sentencepiece
from megatron_ds_suite.core.tokenizer import (
    GPT2BPETokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
VOCAB = DATA / "tokenizers" / "gpt2" / "gpt2-vocab.json"
MERGES = DATA / "tokenizers" / "gpt2" / "gpt2-merges.txt"
LAMBADA = DATA / "eval" / "lambada" / "lambada_test.jsonl"
BOTCHAN = DATA / "corpus" / "botchan.txt"

needs_gpt2 = pytest.mark.skipif(not (VOCAB.is_file() and MERGES.is_file()), reason=f"GPT-2 files absent under {DATA}")
needs_botchan = pytest.mark.skipif(not BOTCHAN.is_file(), reason=f"{BOTCHAN} absent")

TRICKY = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "unicode: héllo wörld — “quotes” ‘single’ … naïve café 東京 😀👍🏽 Ελληνικά русский",
    "contractions: don't can't I'm you're we've they'll he'd it's 'S 'T",
    "numbers 1234567890 3.14159 1e-10 -42 ١٢٣",
    "punctuation!!! ??? ... ;;; ((( ))) [[[ ]]] {{{ }}} @#$%^&*",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "",
    " ",
    "\n",
    "zero\u200bwidth\ufeffbom and combining e\u0301",
]


@lru_cache(maxsize=1)
def gpt2() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(VOCAB, MERGES)


class OpenAIReferenceBPE:
    """Pure-Python port of OpenAI gpt-2 ``src/encoder.py`` (independent of the Rust library)."""

    def __init__(self, vocab_file: Path, merges_file: Path) -> None:
        import regex

        self.encoder = json.loads(vocab_file.read_text(encoding="utf-8"))
        lines = merges_file.read_text(encoding="utf-8").split("\n")[1:-1]
        self.bpe_ranks = {tuple(m.split()): i for i, m in enumerate(lines)}
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        self.byte_encoder = dict(zip(bs, map(chr, cs)))
        self.pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
        self.cache: dict[str, str] = {}

    def bpe(self, token: str) -> str:
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            bigram = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new.extend(word[i:])
                    break
                new.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
        out = " ".join(word)
        self.cache[token] = out
        return out

    def encode(self, text: str) -> list[int]:
        ids = []
        for token in self.pat.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids


def lambada_texts(n: int) -> list[str]:
    if not LAMBADA.is_file():
        pytest.skip(f"{LAMBADA} absent")
    with open(LAMBADA, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


@needs_gpt2
def test_gpt2_matches_transformers_on_real_text() -> None:
    from transformers import GPT2Tokenizer

    ref = GPT2Tokenizer(str(VOCAB), str(MERGES))
    tok = gpt2()
    texts = lambada_texts(10_000) + TRICKY
    if BOTCHAN.is_file():
        texts += BOTCHAN.read_text(encoding="utf-8").split("\n\n")
    ours = tok.encode_batch(texts)
    theirs = [ref.encode(t) for t in texts]
    mismatches = [t for t, a, b in zip(texts, ours, theirs) if a != b]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[0]!r}"
    assert len(texts) > 5000
    assert [tok.encode(t) for t in texts[:50]] == ours[:50]
    assert sum(map(len, ours)) > 400_000  # really tokenized the corpus


@needs_gpt2
def test_gpt2_matches_openai_reference_port() -> None:
    ref = OpenAIReferenceBPE(VOCAB, MERGES)
    tok = gpt2()
    texts = lambada_texts(300) + TRICKY + ["a <|endoftext|> b", "<|endoftext|>"]
    for t in texts:
        assert tok.encode(t) == ref.encode(t), t
    # known values (OpenAI GPT-2)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" Hello world") == [18435, 995]


@needs_gpt2
def test_gpt2_eod_and_special_string() -> None:
    from transformers import GPT2Tokenizer

    tok = gpt2()
    assert tok.vocab_size == 50257 and tok.eod == 50256 and tok.kind == "gpt2_bpe"
    assert tok.cls is tok.sep is tok.mask is tok.pad is tok.unk is None
    # The literal string is plain text (OpenAI encoder / Megatron), never the EOD id...
    ids = tok.encode("a<|endoftext|>b")
    assert ids == [64, 27, 91, 437, 1659, 5239, 91, 29, 65] and 50256 not in ids
    # ...which is what transformers does with split_special_tokens=True (by default it maps it to 50256).
    hf = GPT2Tokenizer(str(VOCAB), str(MERGES))
    assert hf.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert hf("a<|endoftext|>b", split_special_tokens=True)["input_ids"] == ids
    # decoding the EOD id gives the literal string; decode inverts encode exactly
    assert tok.decode([64, 50256, 65]) == "a<|endoftext|>b"
    for t in TRICKY:
        assert tok.decode(tok.encode(t)) == t
        assert tok.detokenize(tok.encode(t)) == t
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([50257])  # padded-vocabulary id


@needs_gpt2
def test_gpt2_spec_round_trip(tmp_path: Path) -> None:
    tok = gpt2()
    spec = tok.spec()
    assert json.loads(json.dumps(spec)) == spec
    again = load_tokenizer(spec)
    assert again.encode(TRICKY[4]) == tok.encode(TRICKY[4])
    (tmp_path / "v.json").write_bytes(VOCAB.read_bytes())
    (tmp_path / "m.txt").write_bytes(MERGES.read_bytes())
    rel = load_tokenizer({"kind": "gpt2_bpe", "vocab_file": "v.json", "merges_file": "m.txt"}, base_dir=tmp_path)
    assert rel.encode("relative paths") == tok.encode("relative paths")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer({"kind": "gpt2_bpe", "vocab_file": "v.json", "merges_file": "m.txt"}, base_dir=tmp_path / "no")
    with pytest.raises(TokenizerError, match="does not match|do not match"):
        load_tokenizer({**spec, "vocab_size": 1000})
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        load_tokenizer({"kind": "unigram_magic"})
    with pytest.raises(TokenizerError, match="lacks 'vocab_file'"):  # a known kind (issue 13) without its file
        load_tokenizer({"kind": "wordpiece"})
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="token->id map"):
        GPT2BPETokenizer(tmp_path / "bad.json", MERGES)


def botchan_text() -> str:
    if not BOTCHAN.is_file():
        pytest.skip(f"{BOTCHAN} absent")
    return BOTCHAN.read_text(encoding="utf-8")


def test_sentencepiece_gpt_flavor(tmp_path: Path) -> None:
    text = botchan_text()
    tok = train_sentencepiece([text], tmp_path / "gpt", 1000, flavor="gpt", seed=5)
    assert isinstance(tok, SentencePieceTokenizer) and tok.kind == "sentencepiece"
    assert tok.vocab_size == 1000
    assert tok.unk == 0 and tok.eod == 1 and tok.id_to_piece(1) == "<|endoftext|>"
    assert tok.id_to_piece(2) == "<0x00>" and tok.id_to_piece(257) == "<0xFF>"
    assert tok.pad is tok.cls is tok.sep is tok.mask is None
    for t in TRICKY + text.split("\n")[:200]:
        ids = tok.encode(t)
        assert tok.unk not in ids and tok.eod not in ids  # byte fallback; EOD never from text
        assert tok.decode(ids) == t  # lossless (identity normalisation, whitespace kept)
    assert tok.decode(tok.encode("ab") + [tok.eod] + tok.encode("cd")) == "ab<|endoftext|>cd"
    batch = ["first sentence", "second one", ""]
    assert tok.encode_batch(batch) == [tok.encode(b) for b in batch]
    # compression sanity: learned merges are used (well under 1 id per byte)
    assert len(tok.encode(text[:20000])) < 0.45 * len(text[:20000].encode())
    assert (tmp_path / "gpt.model").is_file() and (tmp_path / "gpt.vocab").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    again = load_tokenizer({"kind": "sentencepiece", "model_file": "gpt.model"}, base_dir=tmp_path)
    assert again.encode(text[:500]) == tok.encode(text[:500]) and again.spec()["flavor"] == "gpt"


def test_sentencepiece_bert_flavor_special_ids_and_word_starts(tmp_path: Path) -> None:
    text = botchan_text()
    tok = train_sentencepiece([text], tmp_path / "bert", 1200, flavor="bert", seed=5, lowercase=True)
    assert (tok.pad, tok.unk, tok.cls, tok.sep, tok.mask) == (0, 1, 2, 3, 4)
    assert [tok.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tok.eod == tok.sep and tok.flavor == "bert"
    ids = tok.encode("The [MASK] token [CLS] is text here")
    assert not {0, 1, 2, 3, 4} & set(ids)  # control symbols never come from text
    # whole-word grouping by the '▁' prefix reproduces the words
    sentence = "I was a rather mischievous boy, unconventionally speaking"
    ids = tok.encode(sentence)
    words: list[list[int]] = []
    for i in ids:
        if tok.is_word_start(i) or not words:
            words.append([i])
        else:
            words[-1].append(i)
    assert [tok.decode(w).strip() for w in words] == sentence.lower().split()
    assert any(len(w) > 1 for w in words)  # some word was split into several pieces
    mask = tok.word_start_mask()
    assert mask.shape == (tok.vocab_size,) and mask[:5].all()
    assert [bool(mask[i]) for i in ids] == [tok.is_word_start(i) for i in ids]
    assert [bool(mask[i]) for i in ids] == [tok.id_to_piece(i).startswith("\u2581") for i in ids]


def test_sentencepiece_training_is_deterministic(tmp_path: Path) -> None:
    text = botchan_text()
    lines = text.split("\n")
    for flavor, model_type in (("gpt", "bpe"), ("bert", "unigram")):
        a = train_sentencepiece(iter(lines), tmp_path / f"a_{flavor}", 800, flavor=flavor, seed=3, model_type=model_type)
        b = train_sentencepiece((line for line in lines), tmp_path / f"b_{flavor}", 800, flavor=flavor, seed=3,
                                model_type=model_type)
        assert (tmp_path / f"a_{flavor}.model").read_bytes() == (tmp_path / f"b_{flavor}.model").read_bytes()
        assert a.encode(text[:3000]) == b.encode(text[:3000])
    # the sentence cap is honoured: fewer sentences -> a different model
    c = train_sentencepiece([text], tmp_path / "c", 800, flavor="gpt", seed=3, max_sentences=200)
    assert (tmp_path / "c.model").read_bytes() != (tmp_path / "a_gpt.model").read_bytes()
    assert c.vocab_size == 800


def test_sentencepiece_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="too small"):
        train_sentencepiece(["abc"], tmp_path / "x", 100)
    with pytest.raises(TokenizerError, match="flavor"):
        train_sentencepiece(["abc"], tmp_path / "x", 1000, flavor="t5")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="vocab_size"):
        train_sentencepiece(["a tiny corpus"], tmp_path / "x", 5000)
    with pytest.raises(TokenizerError, match="no non-empty text"):
        train_sentencepiece(["", "\n\n"], tmp_path / "x", 1000)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        SentencePieceTokenizer(tmp_path / "junk.model")


@needs_botchan
def test_sentencepiece_training_threads_change_the_file_not_the_pieces(tmp_path):
    """SentencePiece's BPE trainer learns the same pieces with any thread count but records the count in the
    .model file: the corpus builder makes it a setting (tokenizer.num_threads), not the machine's core count,
    so the tokenizer file and its sha256 in the manifest are the same on every machine."""
    import sentencepiece as spm

    text = BOTCHAN.read_text(encoding="utf-8")
    docs = [text[i:i + 3000] for i in range(0, 180_000, 3000)]

    def model(threads: int, name: str) -> tuple[bytes, list[tuple[str, float]]]:
        path = Path(train_sentencepiece(docs, tmp_path / name, 1200, num_threads=threads).model_file)
        sp = spm.SentencePieceProcessor(model_file=str(path))
        return path.read_bytes(), [(sp.IdToPiece(i), sp.GetScore(i)) for i in range(sp.GetPieceSize())]

    (two_a, pieces_two), (two_b, _), (one, pieces_one) = model(2, "a"), model(2, "b"), model(1, "c")
    assert two_a == two_b  # same setting, same bytes
    assert pieces_two == pieces_one  # the learned vocabulary does not depend on the threads
    assert two_a != one  # the file does (the trainer spec records num_threads): hence a fixed setting
