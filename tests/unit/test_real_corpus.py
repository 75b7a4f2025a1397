"""The real-text benchmark corpus (``benchmarks.real_corpus``): deterministic, made of the shared data's
own sentences, web-like lengths, non-ASCII and mojibake where the docstring says."""
from __future__ import annotations

from pathlib import Path

import ftfy
import numpy as np
import pytest

from benchmarks.real_corpus import real_sentences, real_text_corpus
from tests.helpers.distributed import SHARED_DATA

N = 2000


@pytest.fixture(scope="module")
def corpus():
    docs = real_text_corpus(N)
    if docs is None:
        pytest.skip("../shared/data not available")
    return docs


def test_absent_data_gives_none(tmp_path):
    assert real_text_corpus(10, data=tmp_path) is None
    assert real_sentences(Path(tmp_path)) is None


def test_deterministic_and_seeded(corpus):
    assert real_text_corpus(N) == corpus
    assert real_text_corpus(N, seed=32) != corpus


def test_sentences_are_real(corpus):
    src = real_sentences(Path(SHARED_DATA))
    assert set(src) == {"wikitext-103", "lambada", "botchan", "tinyshakespeare", "docs"}
    pool = {s for v in src.values() for s in v}
    assert len(pool) > 50000
    wiki = (Path(SHARED_DATA) / "eval" / "wikitext-103" / "wiki.test.tokens").read_text(encoding="utf-8")
    assert not any("@-@" in s or "<unk>" in s for s in src["wikitext-103"])
    assert "@-@" in wiki
    # every paragraph starts with a sentence of the pool, but where words were swapped in (non-ASCII,
    # mojibake, near-copies)
    by_prefix: dict[str, list[str]] = {}
    for sent in pool:
        by_prefix.setdefault(sent[:20], []).append(sent)
    paras = [p for d in corpus for p in d.split("\n\n")]
    real = sum(any(p.startswith(x) for x in by_prefix.get(p[:20], ())) for p in paras)
    assert len(paras) > 3 * N and real > 0.85 * len(paras)  # measured 0.91


def test_lengths_and_non_ascii(corpus):
    words = np.array([len(d.split()) for d in corpus])
    assert 150 < np.median(words) < 400 and words.max() > 1500 and words.min() >= 20
    assert (words < 100).mean() > 0.1  # short pages exist (the length filter's work)
    non_ascii = np.mean([not d.isascii() for d in corpus])
    assert 0.4 < non_ascii < 0.9
    changed = np.mean([ftfy.fix_text(d) != d for d in corpus[:400]])
    assert 0.2 < changed < 0.9
    # mojibake: UTF-8 of real non-ASCII words read as a single-byte code page, in ~3 % of the
    # documents; ftfy's encoding fixer acts on them
    mojibake = sum(ftfy.fix_encoding(d) != d for d in corpus)
    assert 0.01 * N < mojibake < 0.06 * N
