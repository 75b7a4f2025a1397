"""Planted near-duplicate corpora built from real text, for tests and benchmarks (dedup.md §9).

Each *family* starts from a base document (``doc_words`` consecutive words of a real text, families
taken from disjoint windows) and adds variants made by replacing a random number of words at random
positions with words drawn from the same text (0 to ``max_edit_frac`` of the words). Replacing one word
destroys the (up to) n word n-grams that cover it, so the variants' Jaccard to the base and to each
other spreads over roughly 0.3–1.0. The ground truth is not assumed: callers measure the exact
Jaccard of every pair with their own shingler.
"""
from __future__ import annotations

import random
import re
from pathlib import Path


def real_words(paths: list[Path]) -> list[str]:
    words: list[str] = []
    for p in paths:
        words += re.findall(r"\S+", p.read_text(encoding="utf-8-sig"))
    return words


def planted_corpus(words: list[str], families: int, variants: int, doc_words: int = 300,
                   max_edit_frac: float = 0.12, seed: int = 0) -> tuple[list[str], list[int]]:
    """Documents (shuffled deterministically) and the family id of each."""
    rng = random.Random(seed)
    if families * doc_words > len(words):
        raise ValueError(f"need {families * doc_words} words, the texts have {len(words)}")
    docs: list[tuple[str, int]] = []
    for f in range(families):
        base = words[f * doc_words:(f + 1) * doc_words]
        docs.append((" ".join(base), f))
        for _ in range(variants):
            v = list(base)
            m = rng.randint(0, int(max_edit_frac * doc_words))
            for p in rng.sample(range(doc_words), m):
                v[p] = rng.choice(words)
            docs.append((" ".join(v), f))
    rng.shuffle(docs)
    return [d for d, _ in docs], [f for _, f in docs]
