"""A benchmark corpus that looks like real text, made from ``../shared/data`` (issue 31 item 1).

What is real and what is synthetic:

* **Real**: every sentence. The sources are WikiText-103 test + valid (the ``.tokens`` format undone:
  `` @-@ `` → ``-``, `` @,@ `` → ``,``, `` @.@ `` → ``.``, spaces before ``, . ; : ! ? ) '`` and after
  ``(`` removed; ``= heading =`` lines and sentences holding ``<unk>`` dropped), the LAMBADA test passages,
  botchan and tinyshakespeare (paragraphs, lines joined), and the built-in documentation corpus
  (``data_pipeline.default_corpus``). Each is cut into sentences at ``. ! ?`` followed by a space.
  Non-ASCII characters in them are kept as they are (curly quotes, dashes, accented names, CJK ...).
* **Synthetic**, all drawn with one seeded ``numpy`` generator, so the corpus is a pure function of
  ``(n, seed)`` and the data files:

  - which sentences form a document: one source per document (chosen with probability proportional
    to its sentence count), then sentences drawn uniformly *with replacement* from that source, in
    paragraphs of 1-6 sentences separated by a blank line;
  - document lengths in words: log-normal, median 250 words, sigma 0.9, clipped to [20, 6000]
    (web-like: many short pages, a long tail; those under 128 tokens are the filter's work);
  - ``nonascii_frac`` (default 0.2) of the documents get 1-8 of their words replaced by words with
    non-ASCII characters drawn from the sources' own non-ASCII words (so the characters are real,
    their position is not); with the documents whose sentences already hold non-ASCII, about half
    the corpus has non-ASCII characters, as web text does;
  - ``mojibake_frac`` (default 0.03) of the documents get 1-3 of those words turned into mojibake,
    as web text has: the word's UTF-8 bytes decoded as latin-1, cp1252 or macroman;
  - duplicates as in ``bench_corpus.markov_corpus``: ``near_frac`` (0.10) of the documents replaced by
    an edited copy of an earlier one (up to 8 % of words replaced by random words of the sources) and
    ``exact_frac`` (0.02) by an exact copy.

:func:`real_text_corpus` returns ``None`` when ``../shared/data`` is absent (callers skip).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from data_pipeline.default_corpus import iter_default_corpus

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"

_WIKI_FIXES = [(re.compile(r" @(.)@ "), r"\1"), (re.compile(r" ([,.;:!?)'])"), r"\1"),
               (re.compile(r"\( "), "(")]
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_MOJIBAKE_CODECS = ("latin-1", "cp1252", "mac_roman")


def _sentences(paragraphs: list[str]) -> list[str]:
    out = []
    for p in paragraphs:
        p = " ".join(p.split())
        out += [s for s in _SENTENCE_END.split(p) if len(s.split()) >= 3 and "<unk>" not in s]
    return out


def _wikitext(path: Path) -> list[str]:
    paras = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for pat, rep in _WIKI_FIXES:
            line = pat.sub(rep, line)
        paras.append(line)
    return paras


def real_sentences(data: Path = SHARED) -> dict[str, list[str]] | None:
    """Sentences per source (module docstring), or ``None`` when the shared data is absent."""
    wiki = [data / "eval" / "wikitext-103" / f"wiki.{s}.tokens" for s in ("test", "valid")]
    lambada = data / "eval" / "lambada" / "lambada_test.jsonl"
    books = [data / "corpus" / "botchan.txt", data / "corpus" / "tinyshakespeare.txt"]
    if not all(p.exists() for p in [*wiki, lambada, *books]):
        return None
    src = {
        "wikitext-103": _sentences([p for w in wiki for p in _wikitext(w)]),
        "lambada": _sentences([json.loads(x)["text"] for x in lambada.read_text(encoding="utf-8").splitlines()
                               if x.strip()]),
        "botchan": _sentences(books[0].read_text(encoding="utf-8-sig").split("\n\n")),
        "tinyshakespeare": _sentences(books[1].read_text(encoding="utf-8").split("\n\n")),
        "docs": _sentences([p for _, t in iter_default_corpus() for p in t.split("\n\n")]),
    }
    return src


def _mojibake(word: str, codec: str) -> str:
    return word.encode("utf-8").decode(codec, errors="replace")


def real_text_corpus(n: int, seed: int = 31, near_frac: float = 0.10, exact_frac: float = 0.02,  # noqa: C901
                     nonascii_frac: float = 0.2, mojibake_frac: float = 0.03,
                     data: Path = SHARED, sources: dict[str, list[str]] | None = None) -> list[str] | None:
    """``n`` documents of resampled real sentences (module docstring); ``None`` without the data.
    ``sources``: :func:`real_sentences`'s result, to reuse across calls (batches of a large corpus)."""
    src = sources if sources is not None else real_sentences(data)
    if src is None:
        return None
    rng = np.random.default_rng(seed)
    names = sorted(src)
    sizes = np.array([len(src[k]) for k in names], dtype=np.float64)
    pools = [src[k] for k in names]
    words_pool = [w for k in names for s in src[k] for w in s.split()]
    nonascii_words = sorted({w for w in words_pool if not w.isascii()})
    # a web-like length distribution, in words
    lengths = np.clip(rng.lognormal(np.log(250), 0.9, n), 20, 6000).astype(np.int64)
    which = rng.choice(len(names), n, p=sizes / sizes.sum())
    docs: list[str] = []
    for i in range(n):
        pool = pools[which[i]]
        paras, para, words = [], [], 0
        para_len = int(rng.integers(1, 7))
        while words < lengths[i]:
            s = pool[int(rng.integers(0, len(pool)))]
            para.append(s)
            words += s.count(" ") + 1
            if len(para) >= para_len:
                paras.append(" ".join(para))
                para, para_len = [], int(rng.integers(1, 7))
        if para:
            paras.append(" ".join(para))
        docs.append("\n\n".join(paras))
    draws = rng.random((n, 3))
    for i in range(n):
        if draws[i, 0] < nonascii_frac and nonascii_words:
            v = docs[i].split(" ")
            k = int(rng.integers(1, 9))
            picks = [nonascii_words[int(j)] for j in rng.integers(0, len(nonascii_words), k)]
            if draws[i, 1] < mojibake_frac / nonascii_frac:
                codec = _MOJIBAKE_CODECS[int(rng.integers(0, len(_MOJIBAKE_CODECS)))]
                picks[:3] = [_mojibake(w, codec) for w in picks[:3]]
            for pos, w in zip(rng.integers(0, len(v), k), picks):
                v[int(pos)] = w
            docs[i] = " ".join(v)
    kinds = draws[:, 2]
    for i in range(1, n):
        if kinds[i] < exact_frac:
            docs[i] = docs[int(rng.integers(0, i))]
        elif kinds[i] < exact_frac + near_frac:
            v = docs[int(rng.integers(0, i))].split(" ")
            for p in rng.choice(len(v), int(rng.integers(0, int(0.08 * len(v)) + 1)), replace=False):
                v[p] = words_pool[int(rng.integers(0, len(words_pool)))]
            docs[i] = " ".join(v)
    return docs
