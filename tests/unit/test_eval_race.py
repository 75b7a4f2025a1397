"""RACE reading + encoding on the real files (61 questions, 29 cloze), truncation, bad input, accuracy."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.race import race_accuracy
from megatron_ds_suite.core.errors import RaceDataError
from megatron_ds_suite.core.race import (
    SPLITS,
    clean_text,
    encode_question,
    encode_questions,
    read_race_dir,
    read_race_split,
)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
RACE = DATA / "eval" / "RACE"


def _need(p: Path) -> Path:
    if not p.exists():
        pytest.skip(f"shared data {p} is absent")
    return p


@pytest.fixture(scope="module")
def all_questions():
    _need(RACE)
    return {sp: read_race_split(RACE, sp)[0] for sp in SPLITS}


@pytest.fixture(scope="module")
def bert_tok(tmp_path_factory, all_questions):
    """A real BERT-flavour (WordPiece-like) SentencePiece vocabulary trained on the RACE text itself."""
    from data_pipeline.tokenizer_train import train_sentencepiece

    texts = sorted({q.article for qs in all_questions.values() for q in qs})
    return train_sentencepiece(texts, tmp_path_factory.mktemp("sp") / "race", 600, flavor="bert", lowercase=True)


def test_real_counts(all_questions):
    qs = [q for v in all_questions.values() for q in v]
    assert len(qs) == 61
    assert sum("_" in q.question for q in qs) == 29
    assert all(len(q.options) == 4 and 0 <= q.label < 4 for q in qs)
    assert {sp: len(v) for sp, v in all_questions.items()} == {"train": 22, "dev": 17, "test": 22}
    assert {q.level for q in all_questions["dev"]} == {"middle", "high"}


def test_encoding_real_files(all_questions, bert_tok):
    tok = bert_tok
    qs = [q for v in all_questions.values() for q in v]
    L = 512
    samples = encode_questions(qs, tok, max_seq_length=L)
    assert len(samples) == 61
    n_trunc = 0
    for q, s in zip(qs, samples):
        assert s["text"].shape == s["types"].shape == s["padding_mask"].shape == (4, L)
        art = tok.encode(clean_text(q.article))
        for k, opt in enumerate(q.options):
            # independent construction of the expected option text
            qa_text = q.question.replace("_", opt) if "_" in q.question else q.question + " " + opt
            qa = tok.encode(" ".join(qa_text.split()).replace(" . ", ". ").replace(" . ", ". ").replace(" . ", ". "))[:128]
            full = [tok.cls] + qa + [tok.sep] + art
            if len(full) >= L:
                n_trunc += 1
                exp_ids = full[: L - 1] + [tok.sep]
            else:
                exp_ids = full + [tok.sep]
            n = len(exp_ids)
            row = s["text"][k]
            assert row[:n].tolist() == exp_ids
            assert (row[n:] == tok.pad).all()
            assert s["padding_mask"][k].tolist() == [1] * n + [0] * (L - n)
            assert s["types"][k].tolist() == [0] * (len(qa) + 2) + [1] * (n - len(qa) - 2) + [tok.pad] * (L - n)
        if "_" in q.question:  # cloze: the option replaces the blank, no trailing append
            assert "_" not in clean_text(q.question.replace("_", q.options[0]))
    assert 0 < n_trunc < 61 * 4  # both the truncated and the padded path occur on the real files
    # short max length forces the article to lose its end
    short = encode_question(qs[0].question, qs[0].options, tok.encode(clean_text(qs[0].article)), tok, 64)
    assert (short["padding_mask"] == 1).all() and (short["text"][:, -1] == tok.sep).all()


def test_clean_text():
    # whitespace collapsed, then ' . ' -> '. ' three times, non-overlapping, left to right
    assert clean_text("a\nb  c\t d . e . . f") == "a b c d. e.. f"
    assert clean_text("x . . . y") == "x. .. y"


def test_bad_input_is_reported_and_skipped(tmp_path):
    src = _need(RACE / "test" / "middle")
    d = tmp_path / "RACE" / "test" / "middle"
    d.mkdir(parents=True)
    (tmp_path / "RACE" / "test" / "high").mkdir()
    good = sorted(src.glob("*.txt"))[0]
    shutil.copy(good, d / good.name)
    obj = json.loads(good.read_text())
    n_good = len(obj["questions"])
    (d / "broken.txt").write_text('{"article": "x", "questions": [')
    bad = dict(obj)
    bad["options"] = [o[:3] for o in obj["options"]]  # 3 options everywhere
    (d / "three.txt").write_text(json.dumps(bad))
    bad2 = dict(obj)
    bad2["answers"] = ["E"] + obj["answers"][1:]
    (d / "answer_e.txt").write_text(json.dumps(bad2))
    (d / "no_answers.txt").write_text(json.dumps({k: v for k, v in obj.items() if k != "answers"}))
    (d / "emptied.txt").write_text("")  # its article is lost: counted, not "skipped 0" (issue 30 item 8)
    (d / "blank.txt").write_text("\n  \n")
    (d / "deep.txt").write_text("[" * 5000)  # nested past Python's stack: a skipped file, not a RecursionError
    qs, rep = read_race_split(tmp_path / "RACE", "test")
    assert len(qs) == n_good + (n_good - 1)
    # an article without answers loses all its questions (issue 14); each empty or too deep file counts one
    assert rep.skipped == 1 + n_good + 1 + n_good + 3
    msgs = "\n".join(rep.problems)
    assert "broken.txt" in msgs and "invalid JSON" in msgs
    assert f"{d / 'emptied.txt'}: empty file (no article)" in msgs and f"{d / 'blank.txt'}: empty file" in msgs
    assert f"{d / 'deep.txt'}:1: invalid JSON (nested too deep)" in msgs
    assert "three.txt" in msgs and "answer_e.txt" in msgs and "'E'" in msgs
    with pytest.raises(RaceDataError, match="no \\*.txt"):
        read_race_dir(tmp_path / "RACE" / "test" / "high")
    with pytest.raises(RaceDataError, match="no dev/"):
        read_race_split(tmp_path / "RACE", "dev")


def test_accuracy_with_a_lexical_overlap_scorer(all_questions, bert_tok):
    """A real (weak) multiple-choice scorer: number of option tokens that occur in the article."""
    qs = all_questions["test"] + all_questions["dev"]
    samples = encode_questions(qs, bert_tok, 256)

    def score_fn(batch):
        text, types, mask = batch["text"], batch["types"], batch["padding_mask"]
        out = torch.zeros(text.shape[:2])
        for i in range(text.shape[0]):
            for k in range(4):
                art = set(text[i, k][(types[i, k] == 1) & (mask[i, k] == 1)].tolist())
                qa = text[i, k][(types[i, k] == 0) & (mask[i, k] == 1)].tolist()
                out[i, k] = sum(t in art for t in qa)
        return out

    res = race_accuracy(samples, score_fn, batch_size=3, progress=False)
    # independent computation straight from the question text
    exp = {"middle": [0, 0], "high": [0, 0]}
    for q in qs:
        art_ids = bert_tok.encode(clean_text(q.article))
        scores = []
        for o in q.options:
            qa_text = q.question.replace("_", o) if "_" in q.question else q.question + " " + o
            qa = bert_tok.encode(clean_text(qa_text))[:128]
            head = [bert_tok.cls] + qa + [bert_tok.sep]
            kept = art_ids if len(head) + len(art_ids) < 256 else art_ids[: 256 - 1 - len(head)]
            scores.append(sum(t in set(kept) for t in head))
        exp[q.level][0] += int(int(np.argmax(scores)) == q.label)
        exp[q.level][1] += 1
    for lv in ("middle", "high"):
        assert res[f"{lv}/count"] == exp[lv][1]
        assert res[f"{lv}/correct"] == exp[lv][0]
    assert res["count"] == 39
    assert res["accuracy"] == pytest.approx((exp["middle"][0] + exp["high"][0]) / 39)
