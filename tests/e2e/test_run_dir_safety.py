"""One run per run directory, resumes that survive a damaged metrics.jsonl, no orphaned ranks (issue 14)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))


def _wait_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    return line.strip()


def _dead(pid: int, within: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------- lock
def test_lock_busy_then_stale_after_kill(tmp_path, caplog):
    from training.runtime.run_lock import RunDirBusy, RunDirLock

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from training.runtime.run_lock import RunDirLock
        RunDirLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        time.sleep(120)""")], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert _wait_line(holder) == "locked"
        with pytest.raises(RunDirBusy, match=rf"in use by another training run \(pid {holder.pid} on "):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: no clean-up, the file still names it
        holder.wait()
    lock = RunDirLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="training"):
        lock.acquire()  # the kernel released the dead holder's flock
    assert f"stale lock of pid {holder.pid}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / ".lock").read_text() == ""  # clean exit: nothing stale for the next run


@pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data corpus/tokenizer absent")
def test_second_training_run_into_a_locked_run_dir_is_refused(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from training.runtime.run_lock import RunDirLock
        RunDirLock({str(run)!r}).acquire()
        print("locked", flush=True)
        time.sleep(300)""")], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert _wait_line(holder) == "locked"
        text = tmp_path / "small.txt"
        text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
        spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                "merges_file": str(GPT2 / "gpt2-merges.txt")}
        over = {"data.corpus": "null", "data.text_files": f"[{text}]", "data.tokenizer": json.dumps(spec),
                "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32", "parallel.tensor": "1",
                "train.micro_batch_size": "2", "train.global_batch_size": "2", "train.iters": "2",
                "optimizer.warmup_iters": "1"}
        res = subprocess.run([sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
                              *[f"{k}={v}" for k, v in over.items()]], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"is in use by another training run (pid {holder.pid}" in lines[0], res.stderr
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert not (run / "config.json").exists() and not (run / "ds_config.json").exists()  # nothing overwritten
    # refused before anything was built: no tokenized text or index maps written into the busy run directory,
    # and the holder's lock file still names the holder
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    assert json.loads((run / ".lock").read_text())["pid"] == holder.pid


# ------------------------------------------------------------------------------------------- metrics
def test_resume_repairs_a_partial_metrics_line(tmp_path, caplog):
    from training.metrics import MetricsWriter

    rows = [{"iteration": i, "loss": 5.0 - i} for i in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 4, "lo')  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="training"):
        w = MetricsWriter(tmp_path, 10, True, resume_iteration=2)
    w.event("valid", {"loss": 1.5}, 3)
    w.close()
    assert "dropped 1 damaged line(s) (line 4" in caplog.text
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:2] + [
        {"event": "valid", "iteration": 3, "loss": 1.5}]


# ------------------------------------------------------------------------------------- signals / orphans
def test_ranks_stop_when_the_deepspeed_runner_alone_gets_sigint(tmp_path):
    """runner -> `... deepspeed.launcher.launch` -> rank, as the deepspeed command lays them out; SIGINT to the
    runner alone ends it (DeepSpeed's single-node runner forwards nothing): the rank must stop by itself."""
    rank = textwrap.dedent("""
        import os, time
        from training.runtime import orphan_guard
        runner = orphan_guard.launcher_runner_pid()
        orphan_guard.exit_when_gone(runner, interval=0.1)
        print(os.getpid(), runner, flush=True)
        time.sleep(120)""")
    launch = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {rank!r}])"
    runner = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               f"{launch!r}, 'deepspeed.launcher.launch'])"],
                              env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        rank_pid, seen_runner = map(int, _wait_line(runner).split())
        assert seen_runner == runner.pid
        runner.send_signal(signal.SIGINT)
        runner.wait(timeout=10)
        assert _dead(rank_pid, within=10), "the rank kept running after the runner was gone"
    finally:
        runner.kill()


def test_main_job_sighup_stops_the_stage_group(tmp_path):
    log_file = tmp_path / "stage.log"
    orchestrator = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from megatron_ds_suite.app.main_job.cli import install_signal_handlers
        from megatron_ds_suite.app.main_job.proc import run_logged
        install_signal_handlers()
        run_logged([sys.executable, "-c", "import os, time; print('child', os.getpid(), flush=True); time.sleep(120)"],
                   Path({str(log_file)!r}), grace=5.0)""")], env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        child = None
        for _ in range(200):
            words = log_file.read_text().split() if log_file.exists() else []
            if "child" in words:
                child = int(words[words.index("child") + 1])
                break
            time.sleep(0.05)
        assert child is not None
        orchestrator.send_signal(signal.SIGHUP)  # the ssh session dropped
        orchestrator.wait(timeout=30)
        assert _dead(child, within=10), "the stage kept running after the orchestrator got SIGHUP"
        assert "interrupted" in log_file.read_text()
    finally:
        orchestrator.kill()
