"""data_pipeline.workers.run_task: what a pool worker raises while reading a damaged work file reaches the driver as
one StoreError line (the shard checksums usually find the damage first: tests/e2e/test_damaged_work_files.py)."""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.store import StoreError
from data_pipeline.workers import run_task
from megatron_ds_suite.core.errors import SuiteError


@dataclass
class Job:
    folder: Path


def _read_npy(job: Job):
    return np.load(job.folder / "x.npy")


def _read_json(job: Job):
    return json.loads((job.folder / "x.json").read_bytes())


def _read_text(job: Job):
    return (job.folder / "x.txt").read_bytes().decode("utf-8")


@pytest.mark.parametrize("reader,name,data", [
    (_read_npy, "x.npy", b"\0" * 128),                    # a zeroed .npy header
    (_read_json, "x.json", b'{"files": [1, 2'),            # a cut JSON work file
    (_read_text, "x.txt", b"ok \xff\xfe not utf-8"),       # texts no longer UTF-8
])
def test_a_damaged_file_read_in_a_task_is_one_store_error_line(tmp_path, reader, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(StoreError) as e:
        run_task(reader, Job(tmp_path))
    line = str(e.value)
    assert "\n" not in line and str(tmp_path) in line and "build --force" in line and reader.__name__ in line


def test_a_good_file_and_a_users_error_pass_through(tmp_path):
    buf = io.BytesIO()
    np.save(buf, np.arange(3))
    (tmp_path / "x.npy").write_bytes(buf.getvalue())
    assert run_task(_read_npy, Job(tmp_path)).tolist() == [0, 1, 2]

    def refuses(job):
        raise SuiteError("already one line")

    with pytest.raises(SuiteError, match="^already one line$"):
        run_task(refuses, Job(tmp_path))
