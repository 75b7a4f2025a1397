"""Megatron's zero-shot detokenizers (``tasks/zeroshot_gpt/detokenizer.py``), reproduced verbatim.

The WikiText rules undo the word-level tokenization of the ``.tokens`` files (`` @-@ ``, spaced
punctuation, spaced brackets/quotes, spaced ``= =`` headings) so GPT-2 BPE sees natural text. The
order of the rules matters and two quirks are kept on purpose, or numbers stop being comparable with
Megatron and lm-evaluation-harness (which applies the identical list):

* rule 2 (``re.sub(r"/' [0-9]/", ...)``) has literal slashes in its pattern and never matches: a no-op;
* the quote rules pair the 1st ``"``/``'`` with the 2nd, the 3rd with the 4th ... over the whole
  stream, across lines, apostrophes of contractions included.

Megatron picks the detokenizer from a substring of the data *path*; here it is an explicit choice
(:data:`DETOKENIZERS`), defaulting per task.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from evaluation.errors import EvalError

_PAREN = re.compile(r"\(\s*([^\)]*?)\s*\)")
_BRACKET = re.compile(r"\[\s*([^\]]*?)\s*\]")
_BRACE = re.compile(r"{\s*([^}]*?)\s*}")
_DQUOTE = re.compile(r"\"\s*([^\"]*?)\s*\"")
_SQUOTE = re.compile(r"'\s*([^']*?)\s*'")
_NOOP_SLASHES = re.compile(r"/' [0-9]/")


def wikitext_detokenizer(string: str) -> str:
    """The 24 WikiText rules of evaluation.md §2.2, in order."""
    # contractions
    string = string.replace("s '", "s'")
    string = _NOOP_SLASHES.sub(r"/'[0-9]/", string)  # never matches (literal slashes): kept as in Megatron
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # brackets and quotes (shortest runs, across lines)
    string = _PAREN.sub(r"(\1)", string)
    string = _BRACKET.sub(r"[\1]", string)
    string = _BRACE.sub(r"{\1}", string)
    string = _DQUOTE.sub(r'"\1"', string)
    string = _SQUOTE.sub(r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def ptb_detokenizer(string: str) -> str:
    """Penn Treebank rules (Megatron's ``ptb_detokenizer``)."""
    string = string.replace(" '", "'")
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" n't", "n't")
    string = string.replace(" N ", "1 ")
    string = string.replace("$ 1", "$1")
    string = string.replace("# 1", "#1")
    return string


def identity_detokenizer(string: str) -> str:
    """No change (Megatron's ``lambada_detokenizer``; use for text that is already natural)."""
    return string


DETOKENIZERS: dict[str, Callable[[str], str]] = {
    "wikitext": wikitext_detokenizer,
    "ptb": ptb_detokenizer,
    "none": identity_detokenizer,
}


def get_detokenizer(name: str) -> Callable[[str], str]:
    try:
        return DETOKENIZERS[name]
    except KeyError:
        raise EvalError(f"unknown detokenizer {name!r}; choose one of {', '.join(DETOKENIZERS)}") from None
