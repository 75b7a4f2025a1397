"""Deterministic regex sentence splitter for BERT indexed datasets (no NLTK/punkt download).

Rules, in order:
1. blank lines separate paragraphs; a paragraph never shares a sentence with the next one;
2. inside a paragraph, a sentence ends after ``.``, ``!``, ``?`` or ``…`` (optionally followed by closing
   quotes/brackets) when whitespace follows and the next character starts a sentence (an upper-case
   letter, a digit, an opening quote or bracket);
3. it does not end after a known abbreviation (``Mr.``, ``e.g.``, ``i.e.``, ``etc.``, ``Dr.``, ``vs.``, …)
   or a single capital initial (``J. Smith``);
4. sentences are stripped; empty ones are dropped.
"""
from __future__ import annotations

import re

ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st vs etc e.g i.e cf al fig figs no nos vol vols ed eds p pp approx dept est
inc ltd co corp jan feb mar apr jun jul aug sep sept oct nov dec gen col lt sgt capt rev hon
""".split())

_BOUNDARY = re.compile(r"([.!?\u2026]+[\"'\u2019\u201d)\]]*)\s+(?=[\"'\u2018\u201c(\[]?[A-Z0-9])")
_PARAGRAPH = re.compile(r"\n\s*\n")


def _is_abbreviation(text_before: str) -> bool:
    m = re.search(r"(\S+)$", text_before)
    if not m:
        return False
    word = m.group(1).rstrip(".").lower().lstrip("\"'(\u201c\u2018[")
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str) -> list[str]:
    out: list[str] = []
    for para in _PARAGRAPH.split(text):
        start = 0
        for m in _BOUNDARY.finditer(para):
            end = m.end(1)
            if m.group(1).startswith(".") and len(m.group(1).rstrip("\"'\u2019\u201d)]")) == 1 \
                    and _is_abbreviation(para[start:m.start(1)]):
                continue
            s = para[start:end].strip()
            if s:
                out.append(s)
            start = m.end()
        s = para[start:].strip()
        if s:
            out.append(s)
    return out
