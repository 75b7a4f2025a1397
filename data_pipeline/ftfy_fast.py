"""When ``ftfy.fix_text(text)`` provably returns ``text``: the set of characters ftfy can act on.

The pipeline calls ``ftfy.fix_text(text)`` with ftfy's default ``TextFixerConfig`` (see
:mod:`data_pipeline.clean`). :func:`needs_ftfy` is false only when that call is certain to return its
input, so :func:`data_pipeline.clean.clean_text` may skip it: a document that holds none of the
characters in :data:`FTFY_TRIGGERS` and is already in NFC is returned unchanged. :func:`fix_text`
applies the same test to each segment (line) ftfy fixes on its own, so ftfy runs only on the lines
that need it, and lines whose only triggers are curly quotes take a shortcut made of ftfy's own
``is_bad`` and ``uncurl_quotes`` (:func:`fix_segment` gives the argument).

The trigger set is **derived at import from ftfy's own tables and regexes**, not written by hand:

* from a regular expression, the characters one of which every match must contain
  (:func:`regex_must_contain`: ``re``'s own parser reads the pattern; for each alternative one
  mandatory element whose characters are listed explicitly is chosen);
* from a ``str.translate`` table, its keys;
* from ``fix_line_breaks`` (a chain of ``str.replace`` calls), the first character of each string it
  replaces, read from the function's constants.

Why each step of ``fix_text`` (ftfy 6.3, default config: every fixer on, ``unescape_html='auto'``,
``normalization='NFC'``) is a no-op on a text without those characters. ``fix_text`` cuts the text
into segments after each ``\\n`` (and every ``max_decode_length`` characters) and runs
``fix_and_explain`` on each; that function applies the steps below in order and repeats until a
pass changes nothing, so if every step leaves the segment alone the first pass returns it unchanged:

1. ``unescape_html`` substitutes matches of ``HTML_ENTITY_RE`` (``&#?[0-9A-Za-z]{1,24};``): needs
   ``&``. ('auto' only turns it off where ``<`` occurs, which can only remove changes.)
2. ``fix_encoding``: ``_fix_encoding_one_step_and_explain`` returns the text unchanged unless
   ``is_bad(text)``, i.e. unless ``badness.BADNESS_RE`` matches. Everything else in the encoding
   fixer (``restore_byte_a0``, ``replace_lossy_sequences``, ``decode_inconsistent_utf8``, the
   Latin-1/Windows-1252 re-decoding and its ``fix_c1_controls``) runs only after that test, so a text
   with no character every ``BADNESS_RE`` alternative needs is never touched by any of them.
3. ``fix_c1_controls``: ``C1_CONTROL_RE`` (U+0080-U+009F).
4. ``fix_latin_ligatures``: ``translate(LIGATURES)``: its keys.
5. ``fix_character_width``: ``translate(WIDTH_MAP)``: its keys (fullwidth forms, U+3000).
6. ``uncurl_quotes``: ``SINGLE_QUOTE_RE`` and ``DOUBLE_QUOTE_RE``.
7. ``fix_line_breaks``: replaces ``\\r\\n``, ``\\r``, U+2028, U+2029, U+0085; each starts with a
   trigger (the replacement ``\\n`` is not one: it is what the others become).
8. ``fix_surrogates``: acts only when ``SURROGATE_RE`` (U+D800-U+DFFF) matches.
9. ``remove_terminal_escapes``: ``ANSI_RE`` needs ESC.
10. ``remove_control_chars``: ``translate(CONTROL_CHARS)``: its keys (C0 controls but TAB/LF/FF/CR,
    DEL, U+206A-206F, U+FEFF, U+FFF9-FFFC).
11. NFC: ``unicodedata.normalize('NFC', segment)`` returns the segment iff it is already NFC, which
    :func:`needs_ftfy` tests with ``unicodedata.is_normalized('NFC', text)`` on the whole text. The
    segments are cut after ``\\n``, a starter that never composes with anything (on either side) and
    is never reordered, so the whole text is NFC iff each segment is; texts longer than
    ``max_decode_length`` (cut at arbitrary points) always go to ftfy.

ASCII text is NFC, so for it the test is only whether it holds an ASCII trigger (``&``, CR, ESC, the
C0 controls ``remove_control_chars`` deletes, DEL).

The argument was read off ftfy 6.3's source. With another ftfy minor version, a step or option this
module does not know (a field of ``TextFixerConfig`` or a key of ``ftfy.FIXERS`` not listed here), or
a regex whose must-contain set cannot be derived, :data:`FTFY_TRIGGERS` is ``None`` and every text
goes to ``ftfy.fix_text`` (correct, only slower) until the argument is checked again.
``tests/unit/test_ftfy_fast.py`` checks the equality with ``ftfy.fix_text`` on real text, mojibake,
every fixer's inputs and random strings.
"""
from __future__ import annotations

import re
import re._constants as sre_c  # the stdlib's own regex parser: the patterns are read, not copied
import re._parser as sre_parse
import unicodedata

import ftfy
from ftfy import badness, chardata, fixes

#: The steps and options this derivation covers (ftfy 6.x); anything else disables the fast path.
KNOWN_FIXERS = frozenset({
    "unescape_html", "remove_terminal_escapes", "restore_byte_a0", "replace_lossy_sequences",
    "decode_inconsistent_utf8", "fix_c1_controls", "fix_latin_ligatures", "fix_character_width",
    "uncurl_quotes", "fix_line_breaks", "fix_surrogates", "remove_control_chars",
})
KNOWN_CONFIG = KNOWN_FIXERS | {"fix_encoding", "normalization", "max_decode_length", "explain"}
#: The config ``clean.clean_text`` calls ftfy with (``ftfy.fix_text``'s own default).
CONFIG = ftfy.TextFixerConfig(explain=False)


def _class_chars(items) -> frozenset[str] | None:
    chars: set[str] = set()
    for op, av in items:
        if op is sre_c.LITERAL:
            chars.add(chr(av))
        elif op is sre_c.RANGE:
            chars.update(chr(c) for c in range(av[0], av[1] + 1))
        else:  # NEGATE, CATEGORY (\w, \s ...): not an explicit list
            return None
    return frozenset(chars)


def _choice_key(chars: frozenset[str]) -> tuple[int, int, int, int]:
    """Prefer, among the elements one of which a match must contain, the one whose characters are
    least likely in clean text: no ASCII, few lowercase letters, few characters, few letters."""
    ascii_n = sum(c.isascii() for c in chars)
    lower = sum(unicodedata.category(c) == "Ll" for c in chars)
    letters = sum(unicodedata.category(c).startswith("L") for c in chars)
    return ascii_n, lower, len(chars), letters


def _candidates(items, avoid: frozenset[str] = frozenset()) -> list[frozenset[str]]:
    """For a sequence of regex elements, the explicit character sets of its mandatory elements: a
    match of the sequence contains a character of each of them."""
    found_sets = []
    for op, av in items:
        found = None
        if op is sre_c.LITERAL:
            found = frozenset(chr(av))
        elif op is sre_c.IN:
            found = _class_chars(av)
        elif op is sre_c.SUBPATTERN:
            found = _must_contain(av[-1], avoid)
        elif op is sre_c.BRANCH:
            alts = [_must_contain(alt, avoid) for alt in av[1]]
            found = None if any(a is None for a in alts) else frozenset().union(*alts)
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) and av[0] >= 1:
            found = _must_contain(av[2], avoid)
        # anything else (anchors, look-arounds, optional parts, \w, negated classes) is not used
        if found and not found & avoid:
            found_sets.append(found)
    return found_sets


def _must_contain(items, avoid: frozenset[str] = frozenset()) -> frozenset[str] | None:
    found = _candidates(items, avoid)
    return min(found, key=_choice_key) if found else None


def regex_must_contain(pattern: re.Pattern[str], avoid: frozenset[str] = frozenset()) -> frozenset[str] | None:
    """Characters one of which every (non-empty) match of ``pattern`` contains; ``None`` when that
    cannot be read off the pattern (case-insensitive patterns, or an alternative made only of
    ``\\w``-like or optional parts).

    For a pattern that is one alternation (``BADNESS_RE``), each alternative's set is chosen so as to
    add as few new characters as possible to the others' (``[ÀÁ...]°`` needs an accented capital,
    which other alternatives already need, rather than the degree sign). With ``avoid``, only sets
    without those characters are chosen (``None`` if an alternative has none): a text holding none
    of the result cannot match even if it holds characters of ``avoid``."""
    if pattern.flags & re.IGNORECASE or not isinstance(pattern.pattern, str):
        return None
    parsed = sre_parse.parse(pattern.pattern, pattern.flags)
    if len(parsed) != 1 or parsed[0][0] is not sre_c.BRANCH:
        return _must_contain(parsed, avoid)
    per_alt = [_candidates(alt, avoid) for alt in parsed[0][1][1]]
    if not all(per_alt):
        return None
    picks = [min(c, key=_choice_key) for c in per_alt]
    for _ in range(3):
        for i, cands in enumerate(per_alt):
            others = frozenset().union(*(p for j, p in enumerate(picks) if j != i))
            picks[i] = min(cands, key=lambda c: _choice_key(c - others))
    return frozenset().union(*picks)


def _replaced_by_line_breaks() -> frozenset[str]:
    """First characters of the strings ``fixes.fix_line_breaks`` replaces (its non-docstring
    string constants other than the replacement ``\\n``)."""
    code = fixes.fix_line_breaks.__code__
    targets = [c for c in code.co_consts if isinstance(c, str) and c != fixes.fix_line_breaks.__doc__]
    return frozenset(t[0] for t in targets if t and t != "\n")


def derive_triggers() -> dict[str, frozenset[str] | None]:
    """Per ftfy step (default config), the characters without which that step changes nothing."""
    steps: dict[str, frozenset[str] | None] = {
        "unescape_html": regex_must_contain(chardata.HTML_ENTITY_RE),
        "fix_encoding": regex_must_contain(badness.BADNESS_RE),
        "fix_c1_controls": regex_must_contain(chardata.C1_CONTROL_RE),
        "fix_latin_ligatures": frozenset(map(chr, chardata.LIGATURES)),
        "fix_character_width": frozenset(map(chr, chardata.WIDTH_MAP)),
        "uncurl_quotes": _union(regex_must_contain(chardata.SINGLE_QUOTE_RE),
                                regex_must_contain(chardata.DOUBLE_QUOTE_RE)),
        "fix_line_breaks": _replaced_by_line_breaks(),
        "fix_surrogates": regex_must_contain(fixes.SURROGATE_RE),
        "remove_terminal_escapes": regex_must_contain(fixes.ANSI_RE),
        "remove_control_chars": frozenset(map(chr, chardata.CONTROL_CHARS)),
    }
    return steps


def _union(*sets: frozenset[str] | None) -> frozenset[str] | None:
    return None if any(s is None for s in sets) else frozenset().union(*sets)


def _char_class(chars: frozenset[str]) -> re.Pattern[str]:
    """One ``[...]`` class of ``chars``, written as ranges of consecutive code points."""
    points = sorted(map(ord, chars))
    parts, start = [], 0
    for i in range(1, len(points) + 1):
        if i == len(points) or points[i] != points[i - 1] + 1:
            lo, hi = points[start], points[i - 1]
            parts.append(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}")
            start = i
    return re.compile("[" + "".join(parts) + "]")


def _known_version() -> bool:
    return (ftfy.__version__.split(".")[:2] == ["6", "3"] and set(ftfy.TextFixerConfig._fields) <= KNOWN_CONFIG
            and set(ftfy.FIXERS) <= KNOWN_FIXERS and CONFIG.normalization in ("NFC", None))


TRIGGERS_BY_STEP = derive_triggers()
#: Every character some step of ``ftfy.fix_text`` (default config) needs in order to change a text;
#: ``None`` when the installed ftfy is not one this derivation covers.
FTFY_TRIGGERS: frozenset[str] | None = (
    _union(*TRIGGERS_BY_STEP.values()) if _known_version() else None
)
_TRIGGER_RE = _char_class(FTFY_TRIGGERS) if FTFY_TRIGGERS is not None else None
#: The ASCII triggers (``&``, CR, ESC, the C0 controls ftfy removes): ASCII text is NFC, so for it
#: this one small class is the whole test.
_ASCII_TRIGGER_RE = (_char_class(frozenset(c for c in FTFY_TRIGGERS if c.isascii()))
                     if FTFY_TRIGGERS is not None else None)
#: The characters ``uncurl_quotes`` replaces, and the triggers but them.
QUOTES: frozenset[str] = TRIGGERS_BY_STEP["uncurl_quotes"] or frozenset()
_OTHER_TRIGGER_RE = _char_class(FTFY_TRIGGERS - QUOTES) if FTFY_TRIGGERS is not None else None


def _quotes_path_holds() -> bool:
    """The quotes-only shortcut's premises (see :func:`fix_segment`): NFC, quotes uncurled, and what
    ``uncurl_quotes`` writes triggers nothing."""
    if FTFY_TRIGGERS is None or CONFIG.normalization != "NFC" or not CONFIG.uncurl_quotes or not QUOTES:
        return False
    out = fixes.uncurl_quotes("".join(sorted(QUOTES)))
    return out.isascii() and not set(out) & FTFY_TRIGGERS and not set(out) & QUOTES


QUOTES_PATH = _quotes_path_holds()
#: Characters one of which every match of the mojibake detector holds besides curly quotes: a
#: segment without them is not ``is_bad`` whatever its quotes.
BAD_BESIDES_QUOTES = regex_must_contain(badness.BADNESS_RE, QUOTES) if QUOTES_PATH else None
_BAD_BESIDES_QUOTES_RE = _char_class(BAD_BESIDES_QUOTES) if BAD_BESIDES_QUOTES else None


def needs_ftfy(text: str) -> bool:
    """False only when ``ftfy.fix_text(text) == text`` is certain (module docstring)."""
    if _TRIGGER_RE is None or len(text) > CONFIG.max_decode_length:
        return True
    return _segment_needs_ftfy(text)


def _segment_needs_ftfy(segment: str) -> bool:
    if _TRIGGER_RE is None or _ASCII_TRIGGER_RE is None:
        return True
    if segment.isascii():
        return _ASCII_TRIGGER_RE.search(segment) is not None
    if _TRIGGER_RE.search(segment) is not None:
        return True
    return CONFIG.normalization is not None and not unicodedata.is_normalized(CONFIG.normalization, segment)


def fix_text(text: str) -> str:
    """``ftfy.fix_text(text)`` (default config), calling ftfy only on the segments that need it.

    ``ftfy.fix_text`` fixes each segment (up to and including a ``\\n``, at most ``max_decode_length``
    characters) on its own with ``fix_and_explain``; the only state carried from one segment to the
    next is ``unescape_html='auto'`` turning into ``False`` from the first segment holding ``<`` on.
    This loop cuts the same segments and keeps the same state; a segment without triggers that is NFC
    is kept as it is (the argument of the module docstring holds for either ``unescape_html``), the
    others go through ``ftfy.fix_text`` with the state's config, which, as a segment is one segment
    for it too, is ``fix_and_explain`` on it. A document of many paragraphs with one curly quote
    pays ftfy for one paragraph."""
    if _TRIGGER_RE is None:
        return ftfy.fix_text(text, CONFIG)
    if not needs_ftfy(text):
        return text
    out, pos, n = [], 0, len(text)
    cfg, limit = CONFIG, CONFIG.max_decode_length
    while pos < n:
        brk = text.find("\n", pos) + 1 or n
        if brk - pos > limit:
            brk = pos + limit
        segment = text[pos:brk]
        if cfg.unescape_html == "auto" and "<" in segment:
            cfg = cfg._replace(unescape_html=False)
        out.append(fix_segment(segment, cfg) if _segment_needs_ftfy(segment) else segment)
        pos = brk
    return "".join(out)


def _is_bad(segment: str) -> bool:
    """``ftfy.badness.is_bad``, answered False without running it where no match is possible."""
    if _BAD_BESIDES_QUOTES_RE is not None and _BAD_BESIDES_QUOTES_RE.search(segment) is None:
        return False
    return badness.is_bad(segment)


def fix_segment(segment: str, cfg: ftfy.TextFixerConfig = CONFIG) -> str:
    """``ftfy.fix_text(segment, cfg)`` for one segment (no ``\\n`` but at its end), with a shortcut for
    the commonest case in real text, a segment whose only triggers are curly quotes.

    Such a segment, if NFC and not ``ftfy.badness.is_bad``, comes out of ftfy as
    ``ftfy.fixes.uncurl_quotes(segment)`` when that is NFC: in ``fix_and_explain``'s first pass
    ``unescape_html`` has no ``&``, ``fix_encoding`` stops at ``not is_bad``, the fixers before
    ``uncurl_quotes`` find none of their characters, the ones after it and NFC see a text without
    triggers that is NFC (what ``uncurl_quotes`` writes, ASCII ``'`` and ``"``, triggers nothing:
    :func:`_quotes_path_holds`); the second pass starts from that text and so changes nothing and
    returns it. Everything else (and any segment where a premise fails) goes to ``ftfy.fix_text``."""
    if QUOTES_PATH and _OTHER_TRIGGER_RE is not None and _OTHER_TRIGGER_RE.search(segment) is None \
            and unicodedata.is_normalized("NFC", segment) and not _is_bad(segment):
        fixed = fixes.uncurl_quotes(segment)
        if unicodedata.is_normalized("NFC", fixed):
            return fixed
    return ftfy.fix_text(segment, cfg)
