"""``clean.normalize_whitespace`` (str.translate/str.replace) == the original regex chain, exactly.

The reference below is a verbatim copy of the implementation it replaced; every check compares
the two outputs string-for-string on real text, hand-written edge cases and a seeded random fuzz.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from data_pipeline.clean import _OTHER_SPACES, clean_text, normalize_whitespace
from data_pipeline.default_corpus import iter_default_corpus

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / ".." / "shared" / "data"

# --- reference: the previous implementation, copied verbatim ---------------------------------
_REF_LINE_BREAKS = re.compile(r"\r\n?|[\u2028\u2029\x85\x0b\x0c]")
_REF_SPACES = re.compile(r"[^\S\n]+")
_REF_EDGE_SPACES = re.compile(r" *\n *")
_REF_MANY_NEWLINES = re.compile(r"\n{3,}")


def reference_normalize_whitespace(text: str) -> str:
    text = _REF_LINE_BREAKS.sub("\n", text.replace("\ufeff", ""))
    text = _REF_SPACES.sub(" ", text)
    text = _REF_EDGE_SPACES.sub("\n", text)
    text = _REF_MANY_NEWLINES.sub("\n\n", text)
    return text.strip()
# ------------------------------------------------------------------------------------------------

#: Every whitespace code point Python knows (str.isspace / re ``\s``), plus the BOM.
ALL_SPACES = [chr(c) for c in range(0x110000) if chr(c).isspace()]
LINE_BREAKS = ["\n", "\r", "\r\n", "\u2028", "\u2029", "\x85", "\x0b", "\x0c"]


def _assert_same(texts: list[str]) -> int:
    bad = [t for t in texts if normalize_whitespace(t) != reference_normalize_whitespace(t)]
    assert not bad, f"{len(bad)} mismatches, first: {bad[0][:200]!r}"
    return len(texts)


def test_space_table_is_exactly_isspace_minus_line_breaks():
    expected = {ord(c) for c in ALL_SPACES} - {ord(c) for c in LINE_BREAKS if len(c) == 1}
    assert set(_OTHER_SPACES) == expected
    assert set(_OTHER_SPACES.values()) == {" "}
    # the reference's regex class \s must be the same set as str.isspace for the copy to be exact
    assert [c for c in ALL_SPACES] == [chr(c) for c in range(0x110000) if re.match(r"\s", chr(c))]
    assert len(ALL_SPACES) == 29


EDGE_CASES = [
    "", " ", "\n", "\r\n", "\ufeff", "\ufeff\ufeff", " \t\n\r\x0b\x0c\x85\u2028\u2029\u3000\u00a0",
    "".join(ALL_SPACES), "".join(ALL_SPACES) * 3 + "x", "x" + "".join(reversed(ALL_SPACES)) + "y",
    "a \t b\u00a0\u2003c", "x  \n  y", "\n \n", " \n \n \n a", "a\r\nb\rc\u2028d\x85e\x0bf\x0cg",
    "a\r\r\nb", "a\n\r\nb", "a\r\n\r\n\r\nb", "a\n\r\r\n\n\rb", "a\r", "\ra", "a\r\n",
    "  lead", "trail   ", "trail \n\n\n\n x", "line one   \nline two\t\t\nline three\u00a0\n",
    "p1\n\n\n\n\n\np2", "p1\n \n \t\n\u3000\np2", "p1\n\n p2 \n\nend ",
    "\ufeffbom", "mid\ufeffdle", "a \ufeff b", "\ufeff \ufeff\n\ufeff", "a\n\ufeff\nb", "a\n\ufeff\n\nb",
    "\tindented\n\t\tcode\n", "tabs\t\tin\tthe\t middle", "\x1c\x1d\x1e\x1fsep", "a\x1c\nb",
    "\u2028\u2029", "a\u2029\u2029\u2029b", "\x0b\x0c\x0b", "ascii only, no breaks at all",
    "ünïcödé \u00a0 text\r\nwith\u2003emspace", "日本語\u3000テキスト\u3000\u3000です\n\n\n次",
    "\u200b zero width space is not whitespace \u200b", "\u180e mongolian vowel separator",
    "a \n b \n c", " \n", "\n ", " \n ", "\n\n\n", " \n\n\n ",
]


def test_edge_cases():
    assert _assert_same(EDGE_CASES) == len(EDGE_CASES)
    # a few outputs spelled out, so the pair cannot agree on something wrong
    assert normalize_whitespace("") == ""
    assert normalize_whitespace(" \t\u3000\n\u2028 ") == ""
    assert normalize_whitespace("\ufeffa \t b\u00a0\u2003c  \r\n\r\n\r\n\r\n d ") == "a b c\n\nd"
    assert normalize_whitespace("x\x85y\x0bz\x0cw\u2029v") == "x\ny\nz\nw\nv"
    assert normalize_whitespace("l1  \nl2\n\n\nl3") == "l1\nl2\n\nl3"


def test_random_fuzz_whitespace_heavy():
    rng = random.Random(1234)
    alphabet = ALL_SPACES + LINE_BREAKS + ["\ufeff", "\ufeff", "a", "b", "é", "字", ".", "  ", "\n\n"]
    texts = []
    for _ in range(4000):
        n = rng.randrange(0, 40)
        texts.append("".join(rng.choice(alphabet) for _ in range(n)))
    # pure-ASCII cases exercise the path that skips the line-break regex
    ascii_alpha = [" ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "a", "b"]
    for _ in range(2000):
        n = rng.randrange(0, 30)
        texts.append("".join(rng.choice(ascii_alpha) for _ in range(n)))
    assert _assert_same(texts) == 6000


def _mutate(rng: random.Random, text: str) -> str:
    """Real text with whitespace damage inserted at random places."""
    junk = ALL_SPACES + LINE_BREAKS + ["\ufeff", "   ", "\n\n\n\n", " \n ", "\t\t"]
    out = []
    for piece in re.split(r"(\s+)", text):
        out.append(rng.choice(junk) if piece.isspace() and rng.random() < 0.2 else piece)
    return "".join(out)


def test_default_corpus():
    docs = [t for _, t in iter_default_corpus()]
    assert len(docs) > 300
    rng = random.Random(7)
    _assert_same(docs)
    _assert_same([_mutate(rng, t) for t in docs[:200]])


def test_shared_corpus_paragraphs():
    files = sorted((DATA / "corpus").glob("*.txt"))
    if not files:
        pytest.skip(f"shared data not found at {DATA / 'corpus'}")
    rng = random.Random(11)
    n = 0
    for f in files:
        raw = f.read_bytes().decode("utf-8")  # keeps a BOM and CRs as they are in the file
        paragraphs = raw.split("\n\n")
        n += _assert_same([raw])
        n += _assert_same(paragraphs)
        n += _assert_same([p.replace("\n", "\r\n") for p in paragraphs[::5]])
        n += _assert_same([_mutate(rng, p) for p in paragraphs[::3]])
    assert n > 5000


def test_clean_text_uses_it():
    text = "\ufeffThe  \u00a0quick\r\nbrown \t fox\n\n\n\njumps. "
    assert clean_text(text, use_ftfy=False) == reference_normalize_whitespace(text) == "The quick\nbrown fox\n\njumps."
    assert clean_text(text) == reference_normalize_whitespace(__import__("ftfy").fix_text(text))
