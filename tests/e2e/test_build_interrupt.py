"""Ctrl-C in a terminal during a corpus build (issue 38): the terminal signals the whole process group, the pool
workers as well as the driver. At every stage the build must stop with one line and exit 130 (no worker
traceback, no hang in ``Pool.terminate``), and the same command must resume and write what an uninterrupted
build writes.

The build runs as a session leader (``start_new_session``) and SIGINT goes to its group (``os.killpg``), as a
terminal sends it. The interrupt lands inside a stage: when its ``work/<stage>/_stage.json`` appears (the
ingest stage: when its first shard is finished, so its workers are busy), and the test checks that stage was
left unfinished.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = Path(SHARED_DATA) / "corpus" / "tinyshakespeare.txt"

pytestmark = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="../shared/data corpus absent")

#: the files of a built corpus that must not depend on whether the build was interrupted
OUTPUTS = ("gpt_text_document.bin", "gpt_text_document.idx", "documents.jsonl", "duplicates.jsonl", "rejects.jsonl",
           "tokenizer/spm_gpt_1000.model")


def _config(tmp: Path, name: str) -> Path:
    """Two workers, 15 ingest shards, a SentencePiece tokenizer trained on the corpus: every stage runs long
    enough (0.2-1 s) to be interrupted inside it, and uses the worker pool or trains in the driver."""
    cfg = {"output_dir": str(tmp / name), "workers": 2, "progress": False, "shard_size": 500,
           "length": {"min_tokens": 8}, "tokenizer": {"type": "sentencepiece", "vocab_size": 1000},
           "sources": [{"type": "text", "path": str(SHAKESPEARE), "text_mode": "blocks"}]}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _build(conf: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "data_pipeline", "build", "--config", str(conf)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _user_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.strip() and " INFO " not in x and " WARNING " not in x]


def _outputs(out: Path) -> dict[str, bytes | dict]:
    got: dict[str, bytes | dict] = {f: (out / f).read_bytes() for f in OUTPUTS}
    manifest = json.loads((out / "corpus.json").read_text())
    got["corpus.json"] = {k: manifest["extra"][k] for k in ("documents", "tokens")}
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes | dict]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = _build(_config(tmp, "out"))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return _outputs(tmp / "out")


STAGES = ("ingest", "tokenizer", "filter", "dedup", "export")


def _interrupt_in(conf: Path, out: Path, stage: str) -> None:
    """Start the build of ``conf``, send the terminal's Ctrl-C to its group once ``stage`` has begun, and check the
    one line, exit 130, no traceback, and ``stage`` left unfinished."""
    work = out / "work" / stage
    marker = work / ("docs-00000.done.json" if stage == "ingest" else "_stage.json")
    proc = _build(conf)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, f"the build ended before stage {stage} began: {proc.stderr.read()}"
            assert time.monotonic() < deadline, f"stage {stage} did not begin within 240 s"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the driver and every worker
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the build hung after Ctrl-C in stage {stage}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 130, (stage, err)
    assert "Traceback" not in err, (stage, err)
    lines = _user_lines(err)
    assert lines == ["interrupted: finished work is kept, rerun the same command to resume"], (stage, err)
    record = json.loads((work / "_stage.json").read_text())
    assert record["status"] == "started", f"stage {stage} finished before the interrupt reached it"


def test_ctrl_c_to_the_process_group_at_each_stage_is_one_line_and_resumes(tmp_path, reference):
    """One build folder, interrupted once inside each stage in turn: every rerun of the same command resumes the
    stage it was stopped in (it must finish it for the next stage to begin) until the next interrupt, and the last
    rerun finishes with what an uninterrupted build writes. (One chain of reruns rather than one build per stage:
    the same interrupts and resumes, about a fifth of the builds.)"""
    conf = _config(tmp_path, "out")
    for stage in STAGES:
        _interrupt_in(conf, tmp_path / "out", stage)

    again = _build(conf)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert _outputs(tmp_path / "out") == reference
    leftovers = [str(p) for p in (tmp_path / "out").rglob("*") if ".tmp-" in p.name]
    assert leftovers == [], leftovers
