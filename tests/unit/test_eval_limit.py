"""``python -m evaluation ... --limit N``: the WikiText cut equals the main job (megatron_ds_suite.app.main_job)'s first-N-lines file
(byte for byte, on the real file and on odd line endings); N < 1 is a one-line error before any model.

Scoring with ``--limit`` against scoring main_job's cut file is checked end to end with a real checkpoint in
tests/parallel/test_eval_checkpoint.py (WikiText, LAMBADA) and tests/parallel/test_bert_race.py (RACE).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from evaluation.errors import EvalError
from evaluation.wikitext import first_lines, read_tokens_file
from tests.helpers.eval_files import main_job_cut

ROOT = Path(__file__).resolve().parents[2]
WT = ROOT / ".." / "shared" / "data" / "eval" / "wikitext-103" / "wiki.test.tokens"


@pytest.mark.parametrize("limit", [2, 3, 40, 1000])
def test_wikitext_limit_equals_main_job_cut_real_file(limit, tmp_path):
    if not WT.is_file():
        pytest.skip(f"shared data {WT} is absent")
    cut = main_job_cut(WT, limit, tmp_path)
    got = read_tokens_file(WT, limit)
    assert got == cut.read_text(encoding="utf-8") == read_tokens_file(cut)
    assert got.count("\n") == limit and WT.read_text(encoding="utf-8").startswith(got)


def test_wikitext_limit_odd_line_endings(tmp_path):
    # \r\n and lone \r end lines (text mode translates them to \n); \f, \v, \x1c, \u2028 do not;
    # no newline at the end of the file
    src = tmp_path / "odd.tokens"
    src.write_bytes(" = A = \r\n a\x0cb \u2028 c \r d\x1c e \n\n f @-@ g".encode())
    for limit in range(1, 8):
        cut = main_job_cut(src, limit, tmp_path / f"run{limit}")
        assert read_tokens_file(src, limit) == cut.read_text(encoding="utf-8"), limit
    assert read_tokens_file(src, 2) == " = A = \n a\x0cb \u2028 c \n"
    assert read_tokens_file(src, 10) == " = A = \n a\x0cb \u2028 c \n d\x1c e \n\n f @-@ g"
    assert first_lines("x\ny", 1) == "x\n"
    with pytest.raises(EvalError, match="--limit must be >= 1"):
        first_lines("x\n", 0)


def test_wikitext_limit_on_blank_lines_is_a_clear_error(tmp_path):
    src = tmp_path / "blank.tokens"
    src.write_text(" \n\n = A = \n", encoding="utf-8")
    with pytest.raises(EvalError, match="first 2 line.*are blank"):
        read_tokens_file(src, 2)
    assert read_tokens_file(src, 3) == " \n\n = A = \n"


@pytest.mark.parametrize("task,extra", [("wikitext103", ["--data", "x.tokens"]), ("lambada", ["--data", "x.jsonl"]),
                                        ("race", ["--data", "RACE"])])
@pytest.mark.parametrize("limit", ["0", "-2"])
def test_limit_below_one_is_a_one_line_error(task, extra, limit, capsys):
    from evaluation.cli import main

    assert main([task, "--checkpoint", "no-such-run", *extra, "--limit", limit]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --limit must be >= 1 (the number of leading items to score), got {limit}"
