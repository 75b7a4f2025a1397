"""Training stopped from outside (issue 14): Ctrl-C mid-run and a full disk while saving a checkpoint; Ctrl-C to
the process group of a run under the ``deepspeed`` launcher (issue 38), as a terminal sends it.

Both must end with one line on stderr and a non-zero exit, leave no half-written checkpoint or temporary
file behind, keep ``latest`` naming a complete checkpoint, and let the same command resume from it.
The full disk is the kernel's own refusal: ``RLIMIT_FSIZE`` makes every write past the limit fail with
EFBIG (SIGXFSZ ignored), as ENOSPC would, in the middle of DeepSpeed's ``torch.save``.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA, free_port

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"

pytestmark = pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data corpus/tokenizer absent")


def _command(tmp_path: Path, run: Path, **extra: str) -> list[str]:
    text = tmp_path / "small.txt"
    if not text.exists():
        text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
            "merges_file": str(GPT2 / "gpt2-merges.txt")}
    over = {"data.corpus": "null", "data.text_files": f"[{text}]", "data.tokenizer": json.dumps(spec),
            "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32", "parallel.tensor": "1",
            "train.micro_batch_size": "2", "train.global_batch_size": "2", "optimizer.warmup_iters": "1",
            "model.hidden_dropout": "0.0", "model.attention_dropout": "0.0", **extra}
    return [sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
            *[f"{k}={v}" for k, v in over.items()]]


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))


def _leftovers(run: Path) -> list[str]:
    """Temporary or partial files anywhere under the run directory."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*")
                  if p.name.startswith(".") and p.name != ".lock" or p.name.endswith((".tmp", ".partial")))


def _checkpoints(run: Path) -> tuple[str, list[str]]:
    root = run / "checkpoints"
    return (root / "latest").read_text().strip(), sorted(p.name for p in root.iterdir() if p.is_dir())


def _archive_records(path: Path) -> list[str]:
    """The record names of a torch.save archive, after checking every record's CRC (a cut file fails here)."""
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None, f"{path}: a damaged record"
        return sorted(name.split("/", 1)[1] for name in archive.namelist())


def _stderr_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def test_ctrl_c_mid_training_keeps_the_last_checkpoint_and_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = _command(tmp_path, run, **{"train.iters": "100000", "train.save_interval": "2"})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "latest").exists():  # wait for the first complete checkpoint
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        time.sleep(1.0)  # let it go on training (and saving) for a while
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = _stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interrupted: the newest complete checkpoint is kept"), err
    assert _leftovers(run) == []
    latest, tags = _checkpoints(run)
    assert latest in tags and all(t.startswith("iter_") for t in tags)
    assert (run / "checkpoints" / latest / "mp_rank_00_model_states.pt").is_file()
    stopped_at = int(latest.removeprefix("iter_"))

    # the same command (with a reachable end) resumes from `latest`
    res = subprocess.run(_command(tmp_path, run, **{"train.iters": str(stopped_at + 2), "train.save_interval": "2"}),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"resumed from {latest} at iteration {stopped_at}" in res.stderr + res.stdout
    assert _checkpoints(run)[0] == f"iter_{stopped_at + 2:07d}"


def _deepspeed(cmd: list[str]) -> list[str]:
    """``cmd`` (a ``python -m training.pretrain`` command) under ``deepspeed --num_gpus 2`` at TP=2."""
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            "--module", *cmd[2:], "parallel.tensor=2"]


def _foreign_tracebacks(out: str) -> list[str]:
    """The tracebacks in ``out`` other than DeepSpeed's runner's own (``deepspeed`` itself, waiting for its launcher
    when SIGINT arrives: docs/errors.md)."""
    blocks = out.split("Traceback (most recent call last):")[1:]
    return [b for b in blocks if "deepspeed/launcher/runner.py" not in b.split("KeyboardInterrupt")[0]
            or "/training/" in b or "/megatron_ds_suite/" in b]


def test_ctrl_c_to_the_deepspeed_launchers_group_stops_every_rank_cleanly_and_resumes(tmp_path):
    """A terminal's Ctrl-C reaches the runner, ``deepspeed.launcher.launch`` and both ranks; ``launch`` then sends
    SIGTERM to every rank at once. Each rank must finish its teardown (the run's lock released, not left as a
    stale claim), one rank says the one line, and the same command resumes."""
    run = tmp_path / "run"
    cmd = _deepspeed(_command(tmp_path, run, **{"train.iters": "100000", "train.save_interval": "2"}))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "latest").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: runner, launcher and ranks
        out, _ = proc.communicate(timeout=120)
        deadline = time.monotonic() + 60
        while _group_alive(proc.pid):  # the launcher and the ranks finish after the runner
            assert time.monotonic() < deadline, "ranks still running 60 s after Ctrl-C"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode in (130, -signal.SIGINT), out  # what the shell shows as 130
    assert [x for x in out.splitlines() if x.startswith("interrupted:")] == [f"interrupted: {RESUME}"], out
    assert _foreign_tracebacks(out) == [], out
    assert (run / ".lock").read_text() == "", "a rank was killed before it released the run's lock"
    assert _leftovers(run) == []
    latest, tags = _checkpoints(run)
    assert latest in tags
    stopped_at = int(latest.removeprefix("iter_"))

    cmd = _deepspeed(_command(tmp_path, run, **{"train.iters": str(stopped_at + 2), "train.save_interval": "2"}))
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"resumed from {latest} at iteration {stopped_at}" in res.stderr + res.stdout
    assert "stale lock" not in res.stderr + res.stdout
    assert _checkpoints(run)[0] == f"iter_{stopped_at + 2:07d}"


RESUME = "the newest complete checkpoint is kept; rerun the same command to resume"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_full_disk_while_saving_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    run = tmp_path / "run"
    first = subprocess.run(_command(tmp_path, run, **{"train.iters": "2", "train.save_interval": "2"}),
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert _checkpoints(run) == ("iter_0000002", ["iter_0000002"])
    model_bytes = (run / "checkpoints" / "iter_0000002" / "mp_rank_00_model_states.pt").stat().st_size
    # every file the run writes stays far below 1 MB except the checkpoint's tensors (the 50k x 64 embedding)
    assert model_bytes > 2_000_000

    res = subprocess.run(_command(tmp_path, run, **{"train.iters": "4", "train.save_interval": "2"}),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                         preexec_fn=_limit_file_size(1_000_000))
    assert res.returncode == 1, res.stderr
    lines = _stderr_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "check free disk space" in lines[0], res.stderr
    assert _leftovers(run) == []
    assert _checkpoints(run) == ("iter_0000002", ["iter_0000002"])  # the complete one kept, no partial iter_4

    # a save killed outright (SIGKILL, power loss) leaves a folder newer than `latest` holding the .saving marker
    # and no completion record: the next run moves it to checkpoints/incomplete/ (never deletes it) and saves anew
    killed = run / "checkpoints" / "iter_0000004"
    killed.mkdir()
    (killed / ".saving").write_text("")
    (killed / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut short")
    again = subprocess.run(_command(tmp_path, run, **{"train.iters": "4", "train.save_interval": "2"}),
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resumed from iter_0000002 at iteration 2" in again.stderr + again.stdout
    assert "moved checkpoint iter_0000004, whose save never completed, to " in again.stderr + again.stdout
    moved = run / "checkpoints" / "incomplete" / "iter_0000004"
    assert (moved / "mp_rank_00_model_states.pt").read_bytes() == b"PK\x03\x04 cut short"  # kept as it was
    # written anew, whole: a valid archive holding the same records as the complete checkpoint (sizes may differ
    # by the archive's 64-byte record alignment, since the pickled counters differ)
    assert _archive_records(killed / "mp_rank_00_model_states.pt") == _archive_records(
        run / "checkpoints" / "iter_0000002" / "mp_rank_00_model_states.pt")
    assert (killed / "mp_rank_00_model_states.pt").stat().st_size > model_bytes - 4096
    assert _checkpoints(run) == ("iter_0000004", ["incomplete", "iter_0000002", "iter_0000004"])
    assert sorted(p.name for p in killed.iterdir()) == ["complete.json", "mp_rank_00_model_states.pt"]
