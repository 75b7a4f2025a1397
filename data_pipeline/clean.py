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

import ftfy

_LINE_BREAKS = re.compile(r"\r\n?|[\u2028\u2029\x85\x0b\x0c]")
_SPACES = re.compile(r"[^\S\n]+")
_EDGE_SPACES = re.compile(r" *\n *")
_MANY_NEWLINES = re.compile(r"\n{3,}")


def normalize_whitespace(text: str) -> str:
    text = _LINE_BREAKS.sub("\n", text.replace("\ufeff", ""))
    text = _SPACES.sub(" ", text)
    text = _EDGE_SPACES.sub("\n", text)
    text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip()


def clean_text(text: str, use_ftfy: bool = True, whitespace: bool = True) -> str:
    """Cleaned text; an empty result means the document is rejected as ``empty``."""
    if use_ftfy:
        text = ftfy.fix_text(text)
    if whitespace:
        text = normalize_whitespace(text)
    else:
        text = text.replace("\ufeff", "").strip()
    return text
