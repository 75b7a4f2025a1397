"""The ingest workers' word index: the filter's ids from it equal the tokenizer's ``encode_flat`` of the texts,
the training counts from it equal ``count_training_words`` of the texts, and a build without it (an older
ingest) gives the same files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_pipeline.tokenizer_train import count_training_words, train_sentencepiece
from data_pipeline.words import GPT2_WHITESPACE, SPM_IDENTITY, WordIndex, encode_indexed, training_counts
from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "corpus"
GPT2 = DATA.parent / "tokenizers" / "gpt2"

BUILT = ["the cat sat on the mat", "  two leading spaces", "trailing spaces  ", "double  space", "a\n\nb c\nd",
         "line one \nline two", "line\n three", "tab\tinside words", "nbsp\u00a0and\u3000wide", "meta\u2581symbol a",
         "x" * 300 + " y", "é" * 200 + "\nshort", "東京 大阪 京都", "\nstarts with a break", "ends with a break\n",
         "emoji 😀 and ligature ﬁ", "a", " ", "cr\rinside", "separators \x1c\x1f here", "one\n \ntwo",
         "x\nx\nx y\ny", "same\nsame same\nsame"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    out = list(BUILT)
    for name in ("botchan.txt", "tinyshakespeare.txt"):
        if (DATA / name).is_file():
            raw = (DATA / name).read_text(encoding="utf-8")
            out += [raw[i:i + 3000] for i in range(0, 300000, 3000)]  # raw: runs of spaces, blank lines
    return out


@pytest.fixture(scope="module")
def tok(texts: list[str], tmp_path_factory: pytest.TempPathFactory) -> SentencePieceTokenizer:
    tok = train_sentencepiece(texts, tmp_path_factory.mktemp("spm") / "gpt", 1200, seed=1)
    assert tok.word_cache.mode == "identity"
    return tok


def _check_indexed(index: WordIndex, texts: list[str], want: tuple[np.ndarray, np.ndarray], fresh) -> None:
    for cache_limit in (fresh.word_cache.cache_limit, 50):  # 50: the cache is emptied but for the shard's words
        fresh.word_cache.cache_limit = cache_limit
        for _ in range(2):  # cold, then warm
            ids, n = encode_indexed(fresh.word_cache, index, texts.__getitem__)
            np.testing.assert_array_equal(n, want[1])
            np.testing.assert_array_equal(ids, want[0])


def test_indexed_ids_equal_encode_flat(texts: list[str], tok: SentencePieceTokenizer) -> None:
    index = WordIndex.build(texts, SPM_IDENTITY)
    assert tok.word_cache.split_name == SPM_IDENTITY and not index.whole.any()
    _check_indexed(index, texts, tok.encode_flat(texts), SentencePieceTokenizer(tok.model_file))  # a cold cache
    assert index.raw_ids.dtype == np.uint16 and len(index.raw_n) == len(texts)


def test_a_full_cache_keeps_the_words_at_hand(texts: list[str], tok: SentencePieceTokenizer) -> None:
    """Two shards through a cache too small for both: the second's new words do not fit, so the cache is
    emptied but for the second shard's words, whose ids are kept, not encoded again; the ids stay right."""
    half = len(texts) // 2
    shards = [texts[:half], texts[half:]]
    indexes = [WordIndex.build(s, SPM_IDENTITY) for s in shards]
    fresh = SentencePieceTokenizer(tok.model_file).word_cache
    sent: list[str] = []
    encode = fresh.encode_many
    fresh.encode_many = lambda words: sent.extend(words) or encode(words)
    first = {*indexes[0].raw}, {*indexes[0].spaced}
    fresh.cache_limit = len(first[0]) + len(first[1]) + 10  # room for the first shard only
    for index, shard in zip(indexes, shards):
        sent.clear()
        ids, n = encode_indexed(fresh, index, shard.__getitem__)
        want = tok.encode_flat(shard)
        np.testing.assert_array_equal(n, want[1])
        np.testing.assert_array_equal(ids, want[0])
    new_raw, new_spaced = set(indexes[1].raw) - first[0], set(indexes[1].spaced) - first[1]
    assert len(new_raw) + len(new_spaced) > 10  # the second shard overflows the cache
    assert sorted(sent) == sorted([*new_raw, *(" " + w for w in new_spaced)])  # only its new words encoded
    assert set(fresh.raw) == set(indexes[1].raw) and set(fresh.spaced) == set(indexes[1].spaced)
    assert fresh.cached_words == len(indexes[1].raw) + len(indexes[1].spaced)


def test_indexed_ids_equal_encode_flat_gpt2(texts: list[str]) -> None:
    if not (GPT2 / "gpt2-vocab.json").is_file():
        pytest.skip(f"GPT-2 files absent under {GPT2}")
    tok = GPT2BPETokenizer(GPT2 / "gpt2-vocab.json", GPT2 / "gpt2-merges.txt")
    index = WordIndex.build(texts, GPT2_WHITESPACE)
    assert tok.word_cache.split_name == GPT2_WHITESPACE
    assert index.whole.sum() == 1  # the \x1c-\x1f text goes to the library whole, spliced in at its place
    _check_indexed(index, texts, tok.encode_flat(texts), GPT2BPETokenizer(GPT2 / "gpt2-vocab.json",
                                                                       GPT2 / "gpt2-merges.txt"))


def test_index_training_counts_equal_counting_the_texts(texts: list[str]) -> None:
    clean = [t for t in texts if "\t" not in t and "\u2581" not in t]
    for max_len in (4192, 200):  # 200: lines cut by training are counted from the text
        got = training_counts(WordIndex.build(clean, SPM_IDENTITY), clean, max_len)
        want = count_training_words(clean, max_len)
        assert got is not None and want is not None
        assert got.words == want.words and (got.docs, got.lines) == (want.docs, want.lines)
    assert training_counts(WordIndex.build(texts, SPM_IDENTITY), texts) is None  # a tab: as the direct route
    with pytest.raises(ValueError, match="training counts come from"):
        training_counts(WordIndex.build(clean, GPT2_WHITESPACE), clean)


def test_index_save_load(tmp_path: Path, texts: list[str]) -> None:
    index = WordIndex.build(texts, GPT2_WHITESPACE)
    assert WordIndex.load(tmp_path, 3) is None
    index.save(tmp_path, 3)
    back = WordIndex.load(tmp_path, 3)
    assert back is not None and (back.split, back.raw, back.spaced) == (GPT2_WHITESPACE, index.raw, index.spaced)
    for f in ("raw_ids", "raw_n", "spaced_ids", "spaced_n", "whole"):
        np.testing.assert_array_equal(getattr(back, f), getattr(index, f))


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "gpt2"])
def test_filter_without_index_gives_the_same_files(tmp_path: Path, texts: list[str], tokenizer: str) -> None:
    import json

    from data_pipeline.config import config_from_dict
    from data_pipeline.stages import run_stage, work_dir

    if tokenizer == "gpt2" and not (GPT2 / "gpt2-vocab.json").is_file():
        pytest.skip(f"GPT-2 files absent under {GPT2}")
    tok_cfg = {"vocab_size": 600, "num_threads": 2} if tokenizer == "sentencepiece" else \
        {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t + " filler" * 150}) + "\n" for t in texts[:120]))
    cfg = config_from_dict({"output_dir": str(tmp_path / "out"), "sources": [{"type": "jsonl", "path": str(inp)}],
                            "workers": 2, "shard_size": 30, "progress": False, "tokenizer": tok_cfg})
    for stage in ("ingest", "tokenizer", "filter"):
        run_stage(cfg, stage)
    flt = work_dir(cfg, "filter")
    first = {p.name: p.read_bytes() for p in sorted(flt.glob("docs-*")) if not p.name.endswith(".done.json")}
    assert any(n.endswith(".tok.npy") for n in first) and len(list(work_dir(cfg, "ingest").glob("*.wix.npz"))) == 4
    for p in work_dir(cfg, "ingest").glob("*.wix.npz"):
        p.unlink()  # an ingest from before the index: the filter encodes the texts
    run_stage(cfg, "filter")
    again = {p.name: p.read_bytes() for p in sorted(flt.glob("docs-*")) if not p.name.endswith(".done.json")}
    assert again == first


def test_line_check_of_normalized_texts_equals_the_full_check(texts: list[str]) -> None:
    from data_pipeline.clean import normalize_whitespace
    from data_pipeline.words import _line_safe, _line_safe_normalized

    normed = [t for t in (normalize_whitespace(x) for x in texts + [x + "\u2581" for x in BUILT]) if t]
    assert any("\u2581" in t for t in normed) and not all(_line_safe(t, 200) for t in normed)
    for max_len in (4192, 200, 40):
        assert [_line_safe_normalized(t, max_len) for t in normed] == [_line_safe(t, max_len) for t in normed]
    clean = [t for t in normed if "\u2581" not in t]
    assert sum(t.count("\n\n") for t in clean) > 100  # paragraphs: the line count's "\n\n" rule is exercised
    for max_len in (4192, 200):
        got = training_counts(WordIndex.build(clean, SPM_IDENTITY), clean, max_len, normalized=True)
        want = count_training_words(clean, max_len)
        assert got is not None and want is not None and got.words == want.words and got.lines == want.lines


def test_index_files_round_trip(tmp_path: Path) -> None:
    """An index saved and loaded is the same index: words with line breaks, non-ASCII and spaces as they are
    (NUL-joined file), none at all, and a word holding a NUL (inline JSON instead)."""
    cases = [["the cat\n\nsat", "\u6771\u4eac caf\u00e9 \u2581x", "a\nb c", "cr\rinside \r\n"], [], ["nul\x00inside word"]]
    for k, texts in enumerate(cases):
        index = WordIndex.build(texts, SPM_IDENTITY)
        index.save(tmp_path, k)
        got = WordIndex.load(tmp_path, k)
        assert got is not None and (got.split, got.raw, got.spaced) == (index.split, index.raw, index.spaced)
        for a, b in ((got.raw_ids, index.raw_ids), (got.spaced_ids, index.spaced_ids), (got.raw_n, index.raw_n),
                     (got.spaced_n, index.spaced_n), (got.whole, index.whole)):
            np.testing.assert_array_equal(a, b)
        assert (tmp_path / f"docs-{k:05d}.wvocab.txt").is_file() == (k != 2)
    assert WordIndex.load(tmp_path, 3) is None
