"""RACE reading and encoding, shared by evaluation and fine-tuning (Megatron ``tasks/race/data.py``).

Layout: ``RACE/{train,dev,test}/{high,middle}/*.txt``; every line of a file is one JSON object with
``article``, ``questions`` (list), ``options`` (list of 4-lists), ``answers`` (letters A-D), ``id``.

Encoding of one question (evaluation.md §4.2), for each of its 4 options:

* ``qa`` = the question with **every** ``_`` replaced by the option (cloze), else question + " " + option;
  ``clean_text`` -> token ids -> keep the first ``max_qa_length`` (128) ids;
* article: ``clean_text`` -> ids, once per article;
* ``[CLS] qa [SEP] article [SEP]``; token types 0 up to and including the first [SEP], 1 after; if
  ``[CLS] qa [SEP] article`` has >= ``max_seq_length`` tokens it is cut to ``max_seq_length - 1`` (the
  article loses its end) and [SEP] appended; then padded with the pad id. ``padding_mask`` is 1 on real
  tokens. Quirk kept from Megatron: token types of padding are the **pad id**.

A sample is ``{"text", "types", "padding_mask"}: int64 [4, max_seq_length]`` + ``label`` + ``uid``.
Bad files (empty, not UTF-8, invalid JSON, not 4 options, an answer outside A-D, mismatched list lengths)
are reported with the file name, skipped and counted -- a whole JSON object (article) is skipped for a JSON
error, a single question otherwise; an empty file counts as one (its questions are unknown).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_ds_suite.core.errors import RaceDataError
from megatron_ds_suite.core.textfile import BadJsonLine, json_line

logger = logging.getLogger(__name__)

NUM_CHOICES = 4
MAX_QA_LENGTH = 128
LEVELS = ("middle", "high")
SPLITS = ("train", "dev", "test")


def clean_text(text: str) -> str:
    """Newlines -> space, whitespace runs -> one space, ``' . '`` -> ``'. '`` three times."""
    text = text.replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def build_tokens_types_paddings_from_ids(
    text_a_ids: Sequence[int], text_b_ids: Sequence[int] | None, max_seq_length: int, cls_id: int, sep_id: int, pad_id: int
) -> tuple[list[int], list[int], list[int]]:
    """``[CLS] a [SEP] b [SEP]`` + padding; Megatron's ``build_tokens_types_paddings_from_ids``."""
    ids = [cls_id, *text_a_ids, sep_id]
    types = [0] * len(ids)
    paddings = [1] * len(ids)
    if text_b_ids is not None:
        ids.extend(text_b_ids)
        types.extend([1] * len(text_b_ids))
        paddings.extend([1] * len(text_b_ids))
    trimmed = False
    if len(ids) >= max_seq_length:
        ids, types, paddings = ids[: max_seq_length - 1], types[: max_seq_length - 1], paddings[: max_seq_length - 1]
        trimmed = True
    if text_b_ids is not None or trimmed:
        ids.append(sep_id)
        types.append(0 if text_b_ids is None else 1)
        paddings.append(1)
    pad = max_seq_length - len(ids)
    if pad > 0:
        ids.extend([pad_id] * pad)
        types.extend([pad_id] * pad)  # sic: Megatron fills types of padding with the pad id
        paddings.extend([0] * pad)
    return ids, types, paddings


def option_text(question: str, option: str) -> str:
    """Cloze (``_`` in the question: every ``_`` replaced) or question + " " + option; then cleaned."""
    qa = question.replace("_", option) if "_" in question else " ".join([question, option])
    return clean_text(qa)


def _special_ids(tokenizer) -> tuple[int, int, int]:
    ids = (getattr(tokenizer, "cls", None), getattr(tokenizer, "sep", None), getattr(tokenizer, "pad", None))
    if any(i is None for i in ids):
        raise RaceDataError(f"RACE encoding needs a tokenizer with [CLS], [SEP] and [PAD] ids; {tokenizer!r} lacks them "
                        "(use a BERT-flavour vocabulary)")
    return ids  # type: ignore[return-value]


def encode_question(
    question: str,
    options: Sequence[str],
    article_ids: Sequence[int],
    tokenizer,
    max_seq_length: int = 512,
    max_qa_length: int = MAX_QA_LENGTH,
) -> dict[str, np.ndarray]:
    """The 4 sequences of one question: ``text``, ``types``, ``padding_mask`` int64 [4, max_seq_length]."""
    cls_id, sep_id, pad_id = _special_ids(tokenizer)
    qa_ids = tokenizer.encode_batch([option_text(question, o) for o in options])
    rows = [build_tokens_types_paddings_from_ids(q[:max_qa_length], article_ids, max_seq_length, cls_id, sep_id, pad_id)
            for q in qa_ids]
    ids, types, pads = zip(*rows)
    return {
        "text": np.asarray(ids, dtype=np.int64),
        "types": np.asarray(types, dtype=np.int64),
        "padding_mask": np.asarray(pads, dtype=np.int64),
    }


@dataclass
class RaceQuestion:
    """One question as read from disk (before tokenization)."""

    file: str
    article: str
    question: str
    options: list[str]
    label: int
    level: str
    qid: str


@dataclass
class RaceReadReport:
    files: int = 0
    articles: int = 0
    questions: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)

    def skip(self, msg: str, n: int = 1) -> None:
        logger.warning("RACE: skipped %d question(s): %s", n, msg)
        self.problems.append(msg)
        self.skipped += n


def read_race_dir(path: str | Path, level: str | None = None, report: RaceReadReport | None = None) -> tuple[list[RaceQuestion], RaceReadReport]:  # noqa: C901
    """Questions of every ``*.txt`` in one directory (sorted by name, so the order is deterministic)."""
    d = Path(path)
    report = report if report is not None else RaceReadReport()
    if not d.is_dir():
        raise RaceDataError(f"RACE directory {d} does not exist (expected RACE/<split>/<middle|high>/*.txt)")
    level = level or d.name
    out: list[RaceQuestion] = []
    for f in sorted(d.glob("*.txt")):
        report.files += 1
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            report.skip(f"{f}: not UTF-8 text")
            continue
        if not any(line.strip() for line in lines):  # an emptied or truncated-to-nothing file: its article is lost
            report.skip(f"{f}: empty file (no article)")
            continue
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                data = json_line(line)
            except BadJsonLine as e:
                report.skip(f"{f}:{lineno}: invalid JSON ({e})")
                continue
            missing = [k for k in ("article", "questions", "options", "answers") if not isinstance(data, dict) or k not in data]
            if missing:  # every question of the article is lost, not one
                qs = data.get("questions") if isinstance(data, dict) else None
                report.skip(f"{f}:{lineno}: missing key(s) {', '.join(missing)}", len(qs) if isinstance(qs, list) else 1)
                continue
            qs, opts, ans = data["questions"], data["options"], data["answers"]
            if not (isinstance(qs, list) and isinstance(opts, list) and isinstance(ans, list)) or not (len(qs) == len(opts) == len(ans)):
                report.skip(f"{f}:{lineno}: questions/options/answers are not lists of equal length",
                            len(qs) if isinstance(qs, list) else 1)
                continue
            report.articles += 1
            for qi, (q, o, a) in enumerate(zip(qs, opts, ans)):
                if not isinstance(o, list) or len(o) != NUM_CHOICES or not all(isinstance(x, str) for x in o):
                    report.skip(f"{f}: question {qi}: expected {NUM_CHOICES} string options, got {o!r:.80}")
                    continue
                if not isinstance(a, str) or len(a) != 1 or not 0 <= ord(a) - ord("A") < NUM_CHOICES:
                    report.skip(f"{f}: question {qi}: answer {a!r} is not one of A-D")
                    continue
                if not isinstance(q, str):
                    report.skip(f"{f}: question {qi}: question is not a string")
                    continue
                report.questions += 1
                out.append(RaceQuestion(f.name, str(data["article"]), q, list(o), ord(a) - ord("A"), level,
                                        f"{data.get('id', f.stem)}-{qi}"))
    if report.files == 0:
        raise RaceDataError(f"RACE directory {d} has no *.txt files")
    return out, report


def read_race_split(root: str | Path, split: str = "test", levels: Sequence[str] = LEVELS) -> tuple[list[RaceQuestion], RaceReadReport]:
    """``root/split/{middle,high}`` (the Megatron layout); questions in level order."""
    r = Path(root)
    if split not in SPLITS:
        raise RaceDataError(f"RACE split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not (r / split).is_dir():
        raise RaceDataError(f"RACE folder {r} has no {split}/ directory (expected {r}/{split}/{{middle,high}}/*.txt)")
    report = RaceReadReport()
    out: list[RaceQuestion] = []
    for lv in levels:
        qs, _ = read_race_dir(r / split / lv, lv, report)
        out.extend(qs)
    return out, report


def encode_questions(
    questions: Sequence[RaceQuestion], tokenizer, max_seq_length: int = 512, max_qa_length: int = MAX_QA_LENGTH
) -> list[dict]:
    """Samples ``{text, types, padding_mask [4, L], label, uid, level}``; articles tokenized once each."""
    cache: dict[str, list[int]] = {}
    arts = sorted({q.article for q in questions})
    for a, ids in zip(arts, tokenizer.encode_batch([clean_text(a) for a in arts])):
        cache[a] = list(ids)
    samples = []
    for uid, q in enumerate(questions):
        s = encode_question(q.question, q.options, cache[q.article], tokenizer, max_seq_length, max_qa_length)
        s.update(label=q.label, uid=uid, level=q.level, qid=q.qid)
        samples.append(s)
    return samples


def collate(samples: Sequence[dict]) -> dict:
    """Stack samples: ``text/types/padding_mask`` torch int64 [n, 4, L], ``label`` [n]."""
    import torch

    return {
        "text": torch.from_numpy(np.stack([s["text"] for s in samples])),
        "types": torch.from_numpy(np.stack([s["types"] for s in samples])),
        "padding_mask": torch.from_numpy(np.stack([s["padding_mask"] for s in samples])),
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.long),
    }
