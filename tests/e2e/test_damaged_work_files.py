"""A finished stage's work file damaged in place (same size, so a size check passes) and then read by a later stage: one
``error:`` line naming the file and the remedy, exit code 2, no worker traceback (issue 38). The shard checksums
(``data_pipeline/shard_sums.py``) find the changed bytes when the stage opens the shard; what a pool worker still meets
(a file damaged between the check and the read) is the same one line through ``data_pipeline.workers.run_task``."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers.distributed import SHARED_DATA

SHAKESPEARE = Path(SHARED_DATA) / "corpus" / "tinyshakespeare.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
pytestmark = pytest.mark.skipif(not (SHAKESPEARE.is_file() and GPT2.is_dir()), reason="../shared/data absent")


def _config(folder: Path, out: Path, text: Path) -> Path:
    cfg = {"output_dir": str(out), "workers": 2, "progress": False, "shard_size": 300, "length": {"min_tokens": 8},
           "sources": [{"type": "text", "path": str(text), "text_mode": "blocks"}],
           "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                         "merges_file": str(GPT2 / "gpt2-merges.txt")}}
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    from data_pipeline.__main__ import main

    folder = tmp_path_factory.mktemp("built")
    text = folder / "t.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:150_000], encoding="utf-8")
    assert main(["build", "--config", str(_config(folder, folder / "out", text))]) == 0
    return folder


def _garble(data: bytes) -> bytes:
    return bytes(0xFF if i % 7 == 0 else b for i, b in enumerate(data))


def _zero_header(data: bytes) -> bytes:
    return b"\0" * 60 + data[60:]


def _ff_tail(data: bytes) -> bytes:
    return data[:len(data) // 2] + b"\xff" * (len(data) - len(data) // 2)


@pytest.mark.parametrize("rel,damage,stage", [
    ("work/ingest/docs-00001.idx.npy", _zero_header, "filter"),
    ("work/ingest/docs-00001.idx.npy", _ff_tail, "filter"),
    ("work/ingest/docs-00001.meta.jsonl", _garble, "export"),
    ("work/filter/docs-00001.tok.npy", _zero_header, "export"),
    ("work/filter/docs-00001.tokoff.npy", _ff_tail, "export"),
], ids=["index_header", "index_body", "meta_not_utf8", "tokens_header", "token_offsets_body"])
def test_a_damaged_work_file_read_in_a_worker_is_one_line(built, tmp_path, capsys, rel, damage, stage):
    from data_pipeline.__main__ import main

    shutil.copytree(built / "out", tmp_path / "out")
    for f in (tmp_path / "out").rglob("*.json"):  # the bookkeeping names the copy's own folders
        f.write_text(f.read_text().replace(str(built / "out"), str(tmp_path / "out")))
    target = tmp_path / "out" / rel
    target.write_bytes(damage(target.read_bytes()))
    conf = _config(tmp_path, tmp_path / "out", built / "t.txt")
    capsys.readouterr()
    assert main(["stage", stage, "--config", str(conf)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and " INFO " not in x and " WARNING " not in x]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: ") and target.name in lines[0] and "build --force" in lines[0], lines
    assert "is changed" in lines[0] or "is damaged" in lines[0], lines
