"""Text cleaning: ftfy, then whitespace normalisation.

ftfy settings: ``ftfy.fix_text(text)`` with ftfy's **default** ``TextFixerConfig`` — the call
Megatron-LM's ``cleanup_dataset.py`` makes — so the cleaned text matches the reference recipe. Besides
fixing mojibake (``unescape_html='auto'``, ``fix_encoding``), the defaults uncurl quotes, expand latin
ligatures, fold full-width characters, unify line breaks, remove control characters and apply NFC.
These normalising fixers are kept on purpose: they make the same sentence typed two ways tokenise and
shingle the same way, which helps both the tokenizer and near-duplicate detection. (datatrove turns
them off to preserve the source text verbatim; set ``clean.ftfy=false`` to skip ftfy entirely.)

Whitespace normalisation (after ftfy): ``\\r\\n``/``\\r`` → ``\\n``; every other whitespace character
(tabs, NBSP, U+2000–U+200A, …) → a space; runs of spaces collapse to one; spaces at the ends of lines
are removed; three or more newlines collapse to a blank line (paragraphs survive, the sentence
splitter uses them); the byte-order mark U+FEFF is removed; the document is stripped.
"""
from __future__ import annotations

import re

from data_pipeline.ftfy_fast import fix_text, needs_ftfy

__all__ = ["clean_text", "needs_ftfy", "normalize_whitespace"]

#: Line-break characters besides ``\n``: CR (alone or in CRLF), LS, PS, NEL, VT, FF → ``\n``.
_LINE_BREAKS = re.compile(r"\r\n?|[\u2028\u2029\x85\x0b\x0c]")
#: Every code point for which ``str.isspace()`` (= the ``re`` class ``\s``) is true, minus ``\n`` and the
#: line breaks above, mapped to a space. Listed explicitly because scanning all 0x110000 code points
#: costs ~0.16 s per import; ``tests/unit/test_data_clean.py`` checks the list against ``str.isspace``.
_OTHER_SPACES: dict[int, str] = {
    c: " " for c in (
        0x09, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000,
    )
}
#: The same characters less the space itself (which the table maps to itself): a text without any of them is
#: left unchanged by the ``translate``, so the per-character table lookup runs only on texts that hold one.
_ODD_SPACE = re.compile("[" + "".join(re.escape(chr(c)) for c in _OTHER_SPACES if c != 0x20) + "]")
#: The same, in ASCII: tested one by one with ``in`` (a memchr each), faster than the class's scan.
_ODD_ASCII_SPACES = "".join(chr(c) for c in _OTHER_SPACES if c < 0x80 and c != 0x20)
_SPACE_RUN = re.compile(r"  +")
_MANY_NEWLINES = re.compile(r"\n{3,}")


def normalize_whitespace(text: str) -> str:
    """Whitespace normalisation (module docstring), output identical to the regex chain::

        _LINE_BREAKS.sub("\\n", text.replace("\\ufeff", ""))   ->  re.sub(r"[^\\S\\n]+", " ", ...)
        -> re.sub(r" *\\n *", "\\n", ...)  ->  re.sub(r"\\n{3,}", "\\n\\n", ...)  ->  .strip()

    but ~9x faster: after the line-break pass (skipped for pure-ASCII text without CR/VT/FF, where
    it cannot match) every other whitespace character becomes a space with one ``str.translate`` (run only
    when a regex scan finds such a character);
    collapsing runs of spaces leaves at most one space on each side of a newline, so two plain
    ``str.replace`` calls remove them, which is what `` *\\n *`` did. The regex passes run only when
    a cheap ``in`` test says they can match.
    """
    text = text.replace("\ufeff", "")
    if text.isascii():
        if "\r" in text or "\x0b" in text or "\x0c" in text:
            text = _LINE_BREAKS.sub("\n", text)
        odd = any(c in text for c in _ODD_ASCII_SPACES)
    else:
        text = _LINE_BREAKS.sub("\n", text)
        odd = _ODD_SPACE.search(text) is not None  # a C scan
    if odd:  # translate looks up every character (~40 ns each)
        text = text.translate(_OTHER_SPACES)
    if "  " in text:
        text = _SPACE_RUN.sub(" ", text)
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    if "\n\n\n" in text:
        text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip()


def clean_text(text: str, use_ftfy: bool = True, whitespace: bool = True) -> str:
    """Cleaned text; an empty result means the document is rejected as ``empty``.

    ftfy runs only on texts (and, within them, on the lines) :func:`needs_ftfy` flags: on the others it
    provably returns its input
    (:mod:`data_pipeline.ftfy_fast` derives, from ftfy's own tables and regexes, the characters any of
    its steps needs in order to act; a text without them that is already NFC is skipped, ASCII or
    not), and skipping it there is most of ingest's time on clean text."""
    if use_ftfy:
        text = fix_text(text)
    if whitespace:
        text = normalize_whitespace(text)
    else:
        text = text.replace("\ufeff", "").strip()
    return text
