"""SentencePiece trained from word counts (``input_format=tsv``) vs trained on the sentences: the same pieces
and scores, on real corpora and on inputs built to differ; the counts cut exactly where the sentence
iterator stops; and the corpus builder's tokenizer stage, which merges its ingest workers' counts."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from data_pipeline.tokenizer_train import _SPM_WORD, _training_sentences, count_training_words, train_sentencepiece
from megatron_ds_suite.core.tokenizer import TokenizerError

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "corpus"


def pieces(tok) -> list[tuple[str, float]]:
    sp = tok._sp
    return [(sp.IdToPiece(i), sp.GetScore(i)) for i in range(sp.GetPieceSize())]


def same_model(texts: list[str], tmp_path: Path, vocab: int, **kw) -> tuple[list, list]:
    a = train_sentencepiece(texts, tmp_path / "sentences", vocab, seed=3, **kw)
    counts = count_training_words(texts, kw.get("max_sentence_length", 4192))
    assert counts is not None
    b = train_sentencepiece(None, tmp_path / "counts", vocab, seed=3, word_counts=counts, **kw)  # type: ignore[arg-type]
    return pieces(a), pieces(b)


@pytest.mark.parametrize("name", ["botchan.txt", "tinyshakespeare.txt"])
def test_counts_train_the_same_model_on_real_text(tmp_path: Path, name: str) -> None:
    if not (DATA / name).is_file():
        pytest.skip(f"{DATA / name} absent")
    raw = (DATA / name).read_text(encoding="utf-8")  # raw: runs of spaces, leading spaces, blank lines
    texts = [raw[i:i + 20000] for i in range(0, min(len(raw), 400000), 20000)]
    a, b = same_model(texts, tmp_path, 2000, num_threads=2)
    assert len(a) == 2000 and a == b


def test_counts_train_the_same_model_on_built_inputs(tmp_path: Path) -> None:
    # leading, trailing and doubled spaces, whitespace-only lines, NBSP and ideographic spaces (ordinary
    # characters to SentencePiece), lines cut at max_sentence_length inside a multi-byte character, and
    # characters rare enough that character_coverage drops some of them
    base = ["the cat sat on the mat", "  two leading", "trailing  ", "double  space  here", "   ", "",
            "non\u00a0breaking and\u3000wide", "é" * 30 + " café naïve", "東京 大阪 " * 20, "x" * 500,
            "rare ☃ once", "digits 12345 67 8"]
    texts = ["\n".join(base[(i + j) % len(base)] for j in range(7)) + f" doc{i % 17}" for i in range(300)]
    texts.append("only once: ☄ ⚘ ⛵")
    a, b = same_model(texts, tmp_path, 400, max_sentence_length=64, character_coverage=0.999)
    assert a == b
    pieces_a = {p for p, _ in a}
    assert "☄" not in pieces_a and "▁the" in pieces_a  # coverage really dropped rare characters


def test_counts_cut_where_the_sentence_iterator_stops() -> None:
    texts = [f"a b{i}\n\nc  d{i % 3}\n e f" for i in range(50)]
    for max_docs, max_lines in [(None, None), (10, None), (None, 7), (10, 7), (3, 100), (50, 150), (50, 149)]:
        got = count_training_words(texts, 4192, max_docs, max_lines)
        assert got is not None
        used = texts[:max_docs] if max_docs is not None else texts
        lines = list(_training_sentences(used, max_lines or 10**9, 4192))
        want = Counter(w for line in lines for w in _SPM_WORD.findall(line))
        assert got.words == want and got.lines == len(lines)
        # documents read: up to the one holding the last sentence (the texts here have 3 sentences each)
        assert got.docs == min(len(used), -(-len(lines) // 3))


def test_tab_or_bert_flavour_train_on_sentences(tmp_path: Path) -> None:
    assert count_training_words(["a\tb c"]) is None  # a tab cannot go in a word<TAB>count row
    counts = count_training_words(["a b c"])
    with pytest.raises(TokenizerError, match="word_counts trains only the gpt"):
        train_sentencepiece(None, tmp_path / "b", 400, flavor="bert", word_counts=counts)  # type: ignore[arg-type]


def test_build_tokenizer_from_ingest_counts(tmp_path: Path) -> None:
    """The tokenizer stage's model equals SentencePiece trained on the first ``train_max_docs`` clean texts,
    whether the cut falls inside a shard, a shard's counts file is missing (counted again from its text)
    or the documents hold tabs (no whitespace normalisation: trained on the sentences)."""
    from data_pipeline.config import config_from_dict
    from data_pipeline.doc_store import DocStore
    from data_pipeline.stages import run_stage, work_dir
    from data_pipeline.stages.ingest import word_counts_path

    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
             "upsilon phi chi psi omega").split()
    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for i in range(230):
            text = " ".join(words[(i * 7 + j * j) % len(words)] + ("" if j % 5 else str(i % 9)) for j in range(60))
            f.write(json.dumps({"text": text + ("\n\nmore  text\there" if i % 4 == 0 else "")}) + "\n")
    for ws, drop in [(True, None), (True, 1), (False, None)]:
        out = tmp_path / f"out-{ws}-{drop}"
        cfg = config_from_dict({"output_dir": str(out), "sources": [{"type": "jsonl", "path": str(inp)}],
                                "workers": 2, "shard_size": 40, "progress": False,
                                "clean": {"normalize_whitespace": ws},
                                "tokenizer": {"vocab_size": 400, "train_max_docs": 150, "num_threads": 2}})
        run_stage(cfg, "ingest")
        folder = work_dir(cfg, "ingest")
        saved = [word_counts_path(folder, k) for k in range(6)]
        assert [p.is_file() for p in saved] == [True] * 4 + [False] * 2  # shards starting past 150: none
        if not ws:
            assert json.loads(saved[0].read_text())["words"] is None  # tabs kept: not countable
        if drop is not None:
            saved[drop].unlink()
        stats = run_stage(cfg, "tokenizer")
        assert stats["trained_on_docs"] == 150
        texts = [r["text"] for r in DocStore(folder)][:150]
        ref = train_sentencepiece(texts, tmp_path / f"ref-{ws}-{drop}", 400, seed=cfg.seed, num_threads=2)
        got = cfg.out / json.loads((work_dir(cfg, "tokenizer") / "_stage.json").read_text())["stats"]["spec"]["model_file"]
        from megatron_ds_suite.core.tokenizer import SentencePieceTokenizer

        assert pieces(SentencePieceTokenizer(got)) == pieces(ref)


def test_word_counts_files_round_trip(tmp_path: Path) -> None:
    """The ingest worker's counts files give back the same counter (words, counts, order, docs, lines); a
    word holding a line break (never a training word) goes inline as JSON; uncountable shards say so."""
    from collections import Counter

    from data_pipeline.stages.ingest import read_word_counts, word_counts_path, write_word_counts
    from data_pipeline.tokenizer_train import WordCounts

    cases = [WordCounts(Counter({"the": 5, " cat\r": 2, "\u00e9t\u00e9": 1, " \u6771\u4eac": 7, "\u2581x": 3, " ": 1}),
                        docs=4, lines=9),
             WordCounts(Counter(), docs=2, lines=0),
             WordCounts(Counter({"a\nb": 1, "c": 2}), docs=1, lines=2)]
    for k, wc in enumerate(cases):
        write_word_counts(tmp_path, k, wc)
        found, got = read_word_counts(tmp_path, k)
        assert found and got is not None
        assert list(got.words.items()) == list(wc.words.items()) and (got.docs, got.lines) == (wc.docs, wc.lines)
    assert "word_list" in json.loads(word_counts_path(tmp_path, 0).read_text())
    assert json.loads(word_counts_path(tmp_path, 2).read_text())["words"] == {"a\nb": 1, "c": 2}
    write_word_counts(tmp_path, 3, None)
    assert read_word_counts(tmp_path, 3) == (True, None)
    assert read_word_counts(tmp_path, 4) == (False, None)
