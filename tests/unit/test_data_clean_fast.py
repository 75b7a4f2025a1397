"""ftfy is skipped only where it provably changes nothing: ``clean_text`` (which skips it when
``needs_ftfy`` is false) must equal the reference that calls ``ftfy.fix_text`` on every document."""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import ftfy
import pytest

from data_pipeline.clean import clean_text, needs_ftfy, normalize_whitespace
from data_pipeline.default_corpus import iter_default_corpus
from tests.helpers.distributed import SHARED_DATA as _SHARED

SHARED_DATA = Path(_SHARED)


def reference_clean(text: str) -> str:
    return normalize_whitespace(ftfy.fix_text(text))


# One input per ftfy fixer (default TextFixerConfig), each one that ftfy really changes.
FIXER_TRIPS = {
    "unescape_html named": "fish &amp; chips",
    "unescape_html numeric": "it&#x2019;s here &#8220;ok&#8221;",
    "unescape_html upper": "A &AMP; B",
    "fix_encoding mojibake": "sÃ³ bem, voilÃ le travail",
    "fix_encoding emoji": "âœ” No problems",
    "fix_c1_controls": "price \x80 100",
    "fix_latin_ligatures": "ﬂubberiﬁc",
    "fix_character_width": "ＬＯＵＤ　ＮＯＩＳＥＳ",
    "uncurl_quotes": "‘single’ and “double”",
    "fix_line_breaks crlf": "one\r\ntwo",
    "fix_line_breaks cr": "one\rtwo",
    "fix_line_breaks ls": "one\u2028two\u2029three",
    "fix_line_breaks nel": "one\x85two",
    "fix_surrogates": "smile \ud83d\ude00",
    "remove_terminal_escapes": "\x1b[31mred\x1b[0m text",
    "remove_control_chars nul": "a\x00b",
    "remove_control_chars bell": "a\x07b\x0bc\x1fd\x7fe",
    "remove_control_chars bidi": "a\u206ab",
    "remove_bom": "\ufeffstart",
    "normalization nfc": "cafe\u0301",
}


@pytest.mark.parametrize("name", sorted(FIXER_TRIPS))
def test_each_fixer_trip_is_detected(name):
    text = FIXER_TRIPS[name]
    assert ftfy.fix_text(text) != text, "the input must really trip the fixer"
    assert needs_ftfy(text)
    assert clean_text(text) == reference_clean(text)
    assert needs_ftfy("plain words " + text + " more plain words")


def test_every_ascii_pair_skipped_only_when_unchanged():
    # exhaustive over all 1- and 2-character ASCII strings inside ordinary text, plus HTML-entity shapes
    skipped = 0
    for a, b in itertools.product(range(128), repeat=2):
        for text in (f"x{chr(a)}{chr(b)}y",):
            if not needs_ftfy(text):
                skipped += 1
                assert ftfy.fix_text(text) == text, repr(text)
    assert skipped > 8000 // 2  # printable ASCII is skipped
    for ent in ("&lt;", "&#65;", "&gt", "&nbsp;", "&#x41;", "&Eacute;"):
        assert needs_ftfy(f"a {ent} b")


def test_random_strings_match_reference():
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 127)] + list("\t\n\r\x0c\x0b\x00\x1b&;#") + \
        ["é", "Ã", "©", "\u2019", "ﬁ", "Ａ", "\u00a0", "\u2028", "\x85", "\ufeff", "\u0301", "â€"]
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert clean_text(text) == reference_clean(text), repr(text)
        if not needs_ftfy(text):
            assert ftfy.fix_text(text) == text


def _real_documents() -> list[str]:
    docs = [t for _, t in iter_default_corpus()]
    corpus = SHARED_DATA / "corpus"
    for name in ("botchan.txt", "tinyshakespeare.txt"):
        p = corpus / name
        if p.exists():
            docs += p.read_text(encoding="utf-8").split("\n\n")
    for rel in ("eval/wikitext-2/wiki.test.tokens",):
        p = SHARED_DATA / rel
        if p.exists():
            docs += p.read_text(encoding="utf-8").split("\n \n")
    p = SHARED_DATA / "eval" / "lambada" / "lambada_test.jsonl"
    if p.exists():
        docs += [json.loads(x)["text"] for x in p.read_text(encoding="utf-8").splitlines()[:1500]]
    return docs


def test_real_corpora_match_reference():
    docs = _real_documents()
    if len(docs) < 1000:
        pytest.skip("shared data not available")
    skipped = sum(not needs_ftfy(d) for d in docs)
    assert 0 < skipped < len(docs)  # both paths are exercised
    for d in docs:
        assert clean_text(d) == reference_clean(d)
