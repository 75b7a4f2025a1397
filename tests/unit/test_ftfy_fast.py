"""The non-ASCII ftfy fast path (``data_pipeline.ftfy_fast``): wherever ``needs_ftfy`` is false,
``ftfy.fix_text`` (the config the pipeline uses: ftfy's default) must return its input unchanged.

The reference is ftfy itself, called on every input: real text from ``../shared/data`` (all of it,
document by document), mojibake made from that text's own non-ASCII words, inputs built for every
fixer, every code point in context, and 50,000 seeded random strings."""
from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import ftfy
import pytest

from data_pipeline.clean import clean_text, normalize_whitespace
from data_pipeline.default_corpus import iter_default_corpus
from data_pipeline.ftfy_fast import CONFIG, FTFY_TRIGGERS, TRIGGERS_BY_STEP, fix_text, needs_ftfy, regex_must_contain
from tests.helpers.distributed import SHARED_DATA as _SHARED

SHARED_DATA = Path(_SHARED)


def fix(text: str) -> str:
    return ftfy.fix_text(text, CONFIG)


def check_exact(texts) -> tuple[int, int]:
    """Assert the fast path's promise on every text; return (skipped, changed by ftfy)."""
    return _check(texts)[:2]


def _check(texts) -> tuple[int, int, int]:
    skipped = changed = 0
    for t in texts:
        fixed = fix(t)
        assert fix_text(t) == fixed, repr(t)  # the per-line fast path
        if fixed != t:
            changed += 1
            assert needs_ftfy(t), f"ftfy changes {t!r} -> {fixed!r} but the fast path would skip it"
        if not needs_ftfy(t):
            skipped += 1
    return skipped, changed, len(texts)


def shared_documents() -> list[str]:
    """Every document of the shared real text: WikiText-103/-2 lines, LAMBADA passages, botchan and
    tinyshakespeare paragraphs, and the built-in documentation corpus."""
    docs: list[str] = []
    for rel in ("eval/wikitext-103/wiki.test.tokens", "eval/wikitext-103/wiki.valid.tokens",
                "eval/wikitext-2/wiki.test.tokens", "eval/wikitext-2/wiki.valid.tokens"):
        p = SHARED_DATA / rel
        if p.exists():
            docs += [ln for ln in p.read_text(encoding="utf-8").split("\n") if ln.strip()]
    p = SHARED_DATA / "eval" / "lambada" / "lambada_test.jsonl"
    if p.exists():
        docs += [json.loads(x)["text"] for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
    for name in ("botchan.txt", "tinyshakespeare.txt"):
        p = SHARED_DATA / "corpus" / name
        if p.exists():
            docs += [d for d in p.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    return docs


@pytest.fixture(scope="module")
def real_docs() -> list[str]:
    docs = shared_documents()
    if len(docs) < 10000:
        pytest.skip("../shared/data not available")
    return docs


def test_triggers_are_derived_and_cover_every_step():
    assert FTFY_TRIGGERS is not None, "the installed ftfy is one this derivation covers"
    assert ftfy.__version__.startswith("6.3."), "the argument in ftfy_fast's docstring was read off ftfy 6.3"
    assert set(TRIGGERS_BY_STEP) >= {"unescape_html", "fix_encoding", "fix_c1_controls", "fix_latin_ligatures",
                                     "fix_character_width", "uncurl_quotes", "fix_line_breaks", "fix_surrogates",
                                     "remove_terminal_escapes", "remove_control_chars"}
    assert TRIGGERS_BY_STEP["unescape_html"] == {"&"}
    assert TRIGGERS_BY_STEP["remove_terminal_escapes"] == {"\x1b"}
    assert TRIGGERS_BY_STEP["fix_line_breaks"] == {"\r", "\u2028", "\u2029", "\x85"}
    # printable ASCII except '&', TAB, LF and FF never trigger; ordinary accented letters and CJK neither
    for c in "\t\n\x0c abcXYZ019.,;:!?'\"<>#$%()*+-/=@[]^_`{|}~éèüöçñãõâêôëïœ" "東京日本語한국어ДобрыйвечерΓειά":
        if c not in "œ":
            assert c not in FTFY_TRIGGERS, repr(c)
    for c in "&\r\x00\x1b\x80\x9f\ufeff\ufb01\uff21\u3000\u2018\u201c\u2028Ã€™\ufffd":
        assert c in FTFY_TRIGGERS, repr(c)


def test_regex_must_contain_on_every_match():
    # each alternative of the mojibake detector: a match of it must contain a trigger
    import re
    for pattern in (r"[a-z]\s?[ÃÂ][ ]", r"x(?:ab|c)+y", r"^[ÃÂ][ ]", r"[Œœ][^A-Za-z]"):
        must = regex_must_contain(re.compile(pattern))
        assert must
        rng = random.Random(1)
        alphabet = "abcxyz ÃÂŒœ.\n"
        for _ in range(3000):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
            for m in re.finditer(pattern, s):
                assert set(m.group(0)) & must, (pattern, s)
    # the mojibake detector, with curly quotes avoided: a match always holds one of the other characters
    from ftfy.badness import BADNESS_RE

    from data_pipeline.ftfy_fast import BAD_BESIDES_QUOTES, QUOTES
    assert BAD_BESIDES_QUOTES and not BAD_BESIDES_QUOTES & QUOTES
    rng = random.Random(2)
    alphabet = sorted(QUOTES) + list("aZ .,!\n") + sorted(TRIGGERS_BY_STEP["fix_encoding"]) + list("éüàÉ×°µ²ВГРСβ€")
    hits = 0
    for _ in range(30000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        for m in BADNESS_RE.finditer(s):
            hits += 1
            assert set(m.group(0)) & BAD_BESIDES_QUOTES, repr(s)
    assert hits > 1000
    assert regex_must_contain(re.compile(r"\w+")) is None
    assert regex_must_contain(re.compile("abc", re.IGNORECASE)) is None


def test_real_text_document_by_document(real_docs):
    skipped, changed = check_exact(real_docs)
    assert changed > 0  # the shared text has characters ftfy changes (LAMBADA's curly quotes ...)
    assert skipped > 0.97 * (len(real_docs) - changed)


def test_fast_path_skips_typical_non_ascii_text(real_docs):
    non_ascii = [d for d in real_docs if not d.isascii()]
    assert len(non_ascii) > 1000
    skipped, changed = check_exact(non_ascii)
    # of the non-ASCII documents ftfy leaves alone (the others, mostly curly quotes, it must see),
    # the fast path skips nearly all: measured 1,716 of 1,903 (90 %); the rest hold characters such
    # as '°', '£', '&' that a mojibake or HTML rule needs.
    unchanged = len(non_ascii) - changed
    assert unchanged > 1000
    assert skipped / unchanged > 0.85, f"only {skipped} of {unchanged} unchanged non-ASCII documents skip ftfy"
    typical = ["Crème brûlée in São Paulo, naïve café, Dvořák in Kraków, smørrebrød.",
               "東京は日本の首都です。北京是中国的首都。", "서울은 한국의 수도입니다.",
               "Добрый вечер, как дела?", "Καλημέρα κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
               "Straße, übermäßig, Ölfass", "emoji 😀 🎉 and math ∀x ∈ ℝ"]
    for t in typical:
        assert not needs_ftfy(t), t
        assert fix(t) == t


def non_ascii_words(docs: list[str]) -> list[str]:
    words = sorted({w for d in docs for w in d.split() if not w.isascii()})
    return words


def test_mojibake_of_real_words(real_docs):
    words = non_ascii_words(real_docs) + ["café", "naïve", "Ærøskøbing", "東京", "😀", "Dvořák", "—", "…"]
    texts = []
    for w in words:
        raw = f"the word {w} here".encode("utf-8")
        for enc in ("latin-1", "cp1252", "macroman", "sloppy-windows-1252", "sloppy-windows-1251"):
            texts.append(raw.decode(enc, errors="replace"))
    skipped, changed = check_exact(texts)
    assert changed > len(texts) // 3  # mojibake that ftfy repairs, none of it skipped
    # real mojibake of accented Latin text is never skipped
    for w in ("café", "naïve", "Dvořák"):
        for enc in ("latin-1", "cp1252", "macroman"):
            assert needs_ftfy(w.encode("utf-8").decode(enc))


FIXER_INPUTS = [
    "fish &amp; chips", "it&#x2019;s &#8220;ok&#8221;", "A &AMP; B", "&lt;b&gt; <i>&amp;</i>",
    "sÃ³ bem, voilÃ le travail", "âœ” No problems", "Ã\xa0 la", "price \x80 100", "ﬂubberiﬁc",
    "ＬＯＵＤ　ＮＯＩＳＥＳ", "ｶﾀｶﾅ", "‘single’ and “double”", "one\r\ntwo\rthree\u2028four\u2029five\x85six",
    "smile \ud83d\ude00 lone \ud800 x", "\x1b[31mred\x1b[0m", "a\x00b\x07c\x0bd\x1fe\x7ff\u206ag\ufeffh\ufffci",
    "cafe\u0301", "\u1100\u1161\u11a8", "a\u0323\u0301", "\u0f73", "Å", "Ω",
]


def test_every_fixer_input_matches_ftfy():
    texts = []
    for t in FIXER_INPUTS:
        texts += [t, f"plain words {t} more words", f"東京 {t} café"]
    skipped, changed = check_exact(texts)
    assert changed >= len(FIXER_INPUTS)


def test_segments_keep_ftfy_state():
    """Per-line skipping keeps ftfy's one piece of state: from the first line holding '<' on, HTML
    entities are left alone; and a text longer than max_decode_length is cut where ftfy cuts it."""
    texts = ["a &amp; b\n<p> c &amp; d\n e &amp; f", "plain\nline &lt; two\n<b>\n&amp;",
             "x\n\n\u201cq\u201d\n&eacute;\n<\n&eacute;\n", "caf\u00e9\n\u0301x\n"]
    skipped, changed = check_exact(texts)
    assert changed == 3  # the last one is NFC already: "\n" composes with nothing
    long = ("word " * 200_001)[:CONFIG.max_decode_length - 1] + "e\u0301" + " tail"
    assert len(long) > CONFIG.max_decode_length and "\n" not in long
    assert fix_text(long) == fix(long)


def test_quotes_shortcut():
    from data_pipeline.ftfy_fast import QUOTES_PATH, fix_segment
    assert QUOTES_PATH
    texts = ["\u201cHello,\u201d she said, \u2018it\u2019s fine.\u2019\n", "\u201c\u0301x\u201d", "e\u2019\u0301",
             "caf\u00e9 \u201cok\u201d", "\u00c3\u201c mojibake \u00e2\u20ac\u0153x\u00e2\u20ac\u009d",
             "\u201cA\u201d \u00c9\u201d\u00a3", "\u02bcok\u201b \u201f\u201e", "\u201c&amp;\u201d", "\u201ccafe\u0301\u201d"]
    rng = random.Random(5)
    pool = list("\u2018\u2019\u201a\u201b\u201c\u201d\u201e\u201f\u02bc") + list("ab .,'\"") + \
        list("\u00e9\u00c3\u00c2\u00e2\u20ac\u0153\u00a3\u0301\u00b0\u00c9\u2014")
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 12))) for _ in range(20000)]
    for t in texts:
        assert fix_segment(t) == fix(t), repr(t)
    check_exact(texts)


def test_nfd_text(real_docs):
    words = non_ascii_words(real_docs)
    texts = [unicodedata.normalize(form, w) for w in words for form in ("NFD", "NFKD", "NFC")]
    skipped, changed = check_exact(texts)
    assert changed > 0 and skipped > 0


def test_every_code_point_in_context():
    """All 0x110000 code points, in seeded random runs of 24 (and one by one where a run needs
    ftfy): wherever the fast path skips, ftfy leaves the text alone."""
    rng = random.Random(7)
    points = list(range(0x110000))
    rng.shuffle(points)
    checked = 0
    for i in range(0, len(points), 24):
        run = "".join(map(chr, points[i:i + 24]))
        if not needs_ftfy(run):
            assert fix(run) == run, repr(run)
            checked += len(run)
            continue
        for c in run:
            t = f"a{c}b"
            if not needs_ftfy(t):
                assert fix(t) == t, repr(t)
                checked += 1
    assert checked > 0x110000 - 0x10000  # all but the triggers and what NFC would change


def test_random_strings():
    """50,000 strings from a seeded generator: ordinary non-ASCII text, trigger characters,
    combining marks and arbitrary code points, mixed."""
    rng = random.Random(31)
    pools = [
        [chr(c) for c in range(0x20, 0x7f)],
        [chr(c) for c in range(0xa0, 0x250)],             # Latin-1 and Latin Extended
        [chr(c) for c in range(0x370, 0x530)],            # Greek, Cyrillic
        [chr(c) for c in range(0x300, 0x370)],            # combining marks
        [chr(c) for c in range(0x2000, 0x2070)],          # punctuation
        [chr(c) for c in range(0x3000, 0x3100)] + [chr(c) for c in range(0x4e00, 0x4f00)],
        [chr(c) for c in range(0xac00, 0xac40)] + [chr(c) for c in range(0x1100, 0x1200)],  # Hangul, jamo
        [chr(c) for c in range(0xff00, 0xfff0)],          # half/fullwidth
        sorted(FTFY_TRIGGERS - {chr(c) for c in range(0xd800, 0xe000)}),
        list("\r\n\t\x1b[;m&#x;0123456789\ud83d\ude00"),
    ]
    weights = [30, 12, 10, 3, 4, 8, 4, 2, 3, 2]
    texts = []
    for _ in range(50000):
        n = rng.randint(1, 24)
        if rng.random() < 0.1:
            texts.append("".join(chr(rng.randrange(0x110000)) for _ in range(n)))
        else:
            pool = rng.choices(pools, weights)[0]
            texts.append("".join(rng.choice(pool) if rng.random() < 0.8 else rng.choice(rng.choices(pools, weights)[0])
                                 for _ in range(n)))
    skipped, changed = check_exact(texts)
    assert skipped > 10000 and changed > 5000


def test_clean_text_equals_reference_on_real_documents(real_docs):
    for d in real_docs[::7] + [t for _, t in iter_default_corpus()]:
        assert clean_text(d) == normalize_whitespace(ftfy.fix_text(d))
