"""Checkpoints are read without running code from them, and a bad ``latest`` is one line (issue 14).

A ``torch.save``d object whose pickle calls ``open(MARKER, "w")`` is placed as a run's
``mp_rank_00_model_states.pt``; every command that reads a checkpoint must refuse it with one line,
exit non-zero and never create the marker (with ``weights_only=False`` it is created on load).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"


class _Evil:
    """Unpickling this calls open(path, "w"): the marker file appears iff code from the file ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory whose only checkpoint is the malicious file; returns (run_dir, marker)."""
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    tag = run / "checkpoints" / "iter_0000001"
    tag.mkdir(parents=True)
    torch.save({"module": {}, "payload": _Evil(marker)}, tag / "mp_rank_00_model_states.pt")
    (run / "checkpoints" / "latest").write_text("iter_0000001")
    return run, marker


def _run(args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _error_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.strip() and "warn" not in line.lower()]


def test_safe_load_refuses_code_and_reads_plain_data(tmp_path):
    from training.safe_load import CheckpointError, load

    run, marker = _evil_run(tmp_path)
    with pytest.raises(CheckpointError, match=r"refused to load .*mp_rank_00_model_states\.pt: it asks to run "
                                              r"io\.open"):
        load(run / "checkpoints" / "iter_0000001" / "mp_rank_00_model_states.pt")
    assert not marker.exists()
    good = {"w": torch.arange(6.0).view(2, 3), "rng": {"numpy": ["MT19937", [1, 2], 3, 0, 0.0]}, "tags": (0, 1)}
    torch.save(good, tmp_path / "good.pt")
    back = load(tmp_path / "good.pt")
    assert torch.equal(back["w"], good["w"]) and back["rng"] == good["rng"] and back["tags"] == (0, 1)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or not a torch checkpoint"):
        load(tmp_path / "cut.pt")


def test_deepspeed_checkpoint_engine_loads_weights_only(tmp_path):
    """engine.load_checkpoint reads every file through TorchCheckpointEngine.load (model states, ZeRO
    partitions, pipeline layers): after training.optim.engine.install_process_wide() it refuses the malicious file too."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    from training.optim.engine import install_process_wide
    from training.safe_load import CheckpointError

    install_process_wide()
    run, marker = _evil_run(tmp_path)
    path = str(run / "checkpoints" / "iter_0000001" / "mp_rank_00_model_states.pt")
    engine = TorchCheckpointEngine()
    with pytest.raises(CheckpointError, match="refused to load"):
        engine.load(path, map_location=torch.device("cpu"))
    with pytest.raises(CheckpointError, match="refused to load"):  # the path engine._load_checkpoint takes
        SDLoaderFactory.get_sd_loader([path], checkpoint_engine=engine).load(1, 0)
    assert not marker.exists()


@pytest.mark.parametrize("command", ["lambada", "export_hf", "reshard"])
def test_commands_refuse_a_malicious_checkpoint(tmp_path, command):
    run, marker = _evil_run(tmp_path)
    if command == "lambada":
        (tmp_path / "l.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
        args = ["-m", "evaluation", "lambada", "--checkpoint", str(run), "--data", str(tmp_path / "l.jsonl"),
                "--no-progress"]
    elif command == "export_hf":
        pytest.importorskip("transformers")
        args = ["-m", "training.tools.export_hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]
    else:
        args = ["-m", "training.tools.reshard", "--checkpoint", str(run), "--tp", "1", "--out", str(tmp_path / "new")]
    res = _run(args)
    assert res.returncode == 2, res.stderr
    lines = _error_lines(res)
    assert len(lines) == 1 and "refused to load" in lines[0] and "mp_rank_00_model_states.pt" in lines[0], res.stderr
    assert not marker.exists()


@pytest.mark.parametrize("tag,message", [("iter_0000009", "'iter_0000009' but .* does not exist"),
                                         ("../../elsewhere", "which is not a checkpoint name"),
                                         ("/tmp", "which is not a checkpoint name")])
def test_latest_must_name_a_tag_inside_the_run(tmp_path, tag, message):
    from training.checkpoint_reader import latest_tag, read_client_state
    from training.safe_load import CheckpointError

    run, _ = _evil_run(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (run / "checkpoints" / "latest").write_text(tag)
    for read in (latest_tag, read_client_state):  # resume, evaluation/export/reshard
        with pytest.raises(CheckpointError, match=message):
            read(run)


def test_a_symlinked_tag_folder_is_refused(tmp_path):
    """checkpoints/iter_0000002 -> a folder elsewhere was followed (its files read as the run's checkpoint)."""
    from training.checkpoint_reader import latest_tag, model_files, read_client_state
    from training.safe_load import CheckpointError

    run, _ = _evil_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"module": {}, "step": 7}, elsewhere / "mp_rank_00_model_states.pt")
    (run / "checkpoints" / "iter_0000002").symlink_to(elsewhere, target_is_directory=True)
    (run / "checkpoints" / "latest").write_text("iter_0000002")
    for read in (latest_tag, read_client_state, lambda r: model_files(r, "iter_0000002")):
        with pytest.raises(CheckpointError, match=r"iter_0000002 is a symbolic link \(to .*elsewhere\)"):
            read(run)


@pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data corpus/tokenizer absent")
@pytest.mark.parametrize("case", ["malicious", "latest_missing"])
def test_resume_refuses_bad_checkpoints(tmp_path, case):
    run, marker = _evil_run(tmp_path)
    if case == "latest_missing":
        (run / "checkpoints" / "latest").write_text("iter_0000009")
    text = tmp_path / "small.txt"
    text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    over = {"data.corpus": "null", "data.text_files": f"[{text}]", "data.tokenizer": json.dumps(spec),
            "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32", "parallel.tensor": "1",
            "train.micro_batch_size": "2", "train.global_batch_size": "2", "train.iters": "2",
            "optimizer.warmup_iters": "1"}
    res = _run(["-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml", *[f"{k}={v}" for k, v in over.items()]])
    assert res.returncode == 2, res.stderr
    lines = _error_lines(res)
    assert len(lines) == 1 and lines[0].startswith("checkpoint error: "), res.stderr
    expected = {"malicious": "refused to load", "latest_missing": "'iter_0000009' but"}[case]
    assert expected in lines[0], lines[0]
    assert not marker.exists()


@pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data corpus/tokenizer absent")
def test_a_refused_launch_leaves_config_json_as_it_was(tmp_path):
    """A launch refused after the run directory is claimed (here: resume meets a `latest` naming a missing tag)
    must not replace RUN_DIR/config.json and ds_config.json, which describe the checkpoints already there."""
    run, _ = _evil_run(tmp_path)
    (run / "checkpoints" / "latest").write_text("iter_0000009")
    before = {name: '{"written by": "the run that made the checkpoints"}' for name in ("config.json", "ds_config.json")}
    for name, text in before.items():
        (run / name).write_text(text)
    text = tmp_path / "small.txt"
    text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    over = {"data.corpus": "null", "data.text_files": f"[{text}]", "data.tokenizer": json.dumps(spec),
            "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32", "parallel.tensor": "1",
            "train.micro_batch_size": "2", "train.global_batch_size": "2", "train.iters": "2",
            "optimizer.warmup_iters": "1"}
    res = _run(["-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml", *[f"{k}={v}" for k, v in over.items()]])
    assert res.returncode == 2 and "'iter_0000009' but" in res.stderr, res.stderr
    assert {name: (run / name).read_text() for name in before} == before
    assert not list(run.glob("*.tmp*")) and not (run / "metrics.jsonl").exists()
