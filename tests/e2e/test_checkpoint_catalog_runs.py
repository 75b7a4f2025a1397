"""Real runs meeting a lost or rolled-back ``checkpoints/latest`` and a damaged shard (issue 38): nothing is deleted.

Before completion records, a run whose ``latest`` was missing removed every ``iter_*`` folder as "unfinished" and
trained from iteration 0 with exit 0, and a ``latest`` pointed at an older tag removed every newer checkpoint. Here
each refusal is one line with exit 2 that names the newest complete tag, every checkpoint byte survives it, the
documented way out (``train.resume_tag``) resumes exactly, and going back on purpose moves the newer checkpoints to
``checkpoints/superseded/`` instead of deleting them. The catalog's rules case by case: tests/unit/test_checkpoint_catalog.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"

pytestmark = pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data corpus/tokenizer absent")


def _train(tmp_path: Path, run: Path, **extra: str) -> subprocess.CompletedProcess:
    text = tmp_path / "small.txt"
    if not text.exists():
        text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    over = {"data.corpus": "null", "data.text_files": f"[{text}]", "data.tokenizer": json.dumps(spec),
            "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32", "parallel.tensor": "1",
            "train.micro_batch_size": "2", "train.global_batch_size": "2", "optimizer.warmup_iters": "1",
            "model.hidden_dropout": "0.0", "model.attention_dropout": "0.0", "train.save_interval": "2",
            "train.keep_last": "3", **extra}
    cmd = [sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
           *[f"{k}={v}" for k, v in over.items()]]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)


def _digests(folder: Path) -> dict[str, str]:
    """Every checkpoint file under ``folder`` by tag/name (wherever the tag folder now is) -> sha256."""
    return {f"{p.parent.name}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.pt"))}


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in rows if "event" not in r}


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("checkpoint error: "), res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout
    return lines[0]


def test_a_lost_or_rolled_back_latest_deletes_nothing_and_resume_tag_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    first = _train(tmp_path, run, **{"train.iters": "6"})
    assert first.returncode == 0, first.stderr[-3000:]
    reference = _losses(run)
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
    saved = _digests(ckpts)

    # 1. `latest` lost (a run folder copied without it): refused, naming the newest complete tag; nothing removed
    (ckpts / "latest").unlink()
    line = _one_error_line(_train(tmp_path, run, **{"train.iters": "8"}))
    assert "latest is missing" in line and "the newest is iter_0000006" in line
    assert "train.resume_tag=iter_0000006" in line and "nothing was deleted" in line
    assert _digests(ckpts) == saved

    # the way out the line names resumes from it
    res = _train(tmp_path, run, **{"train.iters": "8", "train.resume_tag": "iter_0000006"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from iter_0000006 at iteration 6" in res.stdout + res.stderr
    assert (ckpts / "latest").read_text() == "iter_0000008"
    saved = _digests(ckpts)

    # 2. `latest` pointed back at an older tag by hand: refused (it used to delete iter_6 and iter_8)
    (ckpts / "latest").write_text("iter_0000004")
    line = _one_error_line(_train(tmp_path, run, **{"train.iters": "10"}))
    assert "names iter_0000004 but newer complete checkpoints exist (iter_0000006, iter_0000008)" in line
    assert _digests(ckpts) == saved

    # going back on purpose: the newer ones are moved aside, and steps 5-6 are trained again exactly as before
    res = _train(tmp_path, run, **{"train.iters": "6", "train.resume_tag": "iter_0000004"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from iter_0000004 at iteration 4" in res.stdout + res.stderr
    assert sorted(p.name for p in (ckpts / "superseded").iterdir()) == ["iter_0000006", "iter_0000008"]
    assert _digests(ckpts / "superseded") == {
        k: v for k, v in saved.items() if k.startswith(("iter_0000006", "iter_0000008"))}
    assert [_losses(run)[i] for i in (5, 6)] == [reference[i] for i in (5, 6)]
    assert (ckpts / "latest").read_text() == "iter_0000006"

    # 3. a checkpoint file emptied or cut (a full disk on copy, a bad sync): one line naming the file
    shard = ckpts / "iter_0000006" / "mp_rank_00_model_states.pt"
    whole = shard.read_bytes()
    for cut in (0, len(whole) // 2):
        shard.write_bytes(whole[:cut])
        line = _one_error_line(_train(tmp_path, run, **{"train.iters": "8"}))
        assert f"checkpoint file {shard} has {cut} bytes but" in line, line
