"""A dataset given as a loading script is refused before ``datasets`` runs it (issue 14: nothing executed
from files we read). The script would create a marker file when imported."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.hf_datasets import UnsafeDatasetError, load_hf_dataset, local_scripts

ROOT = Path(__file__).resolve().parents[2]


def _script_dataset(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('code ran')\n")
    (folder / "train.jsonl").write_text('{"text": "a harmless row"}\n')
    return folder, marker


def test_local_script_folder_and_file_are_refused(tmp_path):
    folder, marker = _script_dataset(tmp_path)
    assert local_scripts(folder) == [folder / "evil.py"]
    for target in (folder, folder / "evil.py"):
        with pytest.raises(UnsafeDatasetError, match=r"is a loading script .*evil\.py.*give the data files instead"):
            load_hf_dataset(str(target), split="train")
    assert issubclass(UnsafeDatasetError, SuiteError)
    assert not marker.exists()


def test_plain_data_folder_still_loads(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert local_scripts(folder) == []
    ds = load_hf_dataset(str(folder), split="train")
    assert list(ds["text"]) == ["one", "two"]


@pytest.mark.parametrize("task", ["wikitext103", "lambada"])
def test_evaluation_refuses_a_script_dataset_in_one_line(tmp_path, task):
    folder, marker = _script_dataset(tmp_path)
    res = subprocess.run([sys.executable, "-m", "evaluation", task, "--checkpoint", str(tmp_path / "no-run"),
                          "--hf-dataset", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "is a loading script" in lines[0], res.stderr
    assert not marker.exists()


def test_corpus_build_refuses_a_script_source_in_one_line(tmp_path):
    folder, marker = _script_dataset(tmp_path)
    conf = tmp_path / "data.yaml"
    conf.write_text(f"output_dir: {tmp_path / 'out'}\nprogress: false\nsources:\n  - type: hf\n    path: {folder}\n")
    res = subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config", str(conf)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and "is a loading script" in lines[-1], res.stderr
    assert not marker.exists()
