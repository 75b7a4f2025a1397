"""A process killed while saving leaves the previous checkpoint loadable; the launcher runs from a
localhost hostfile."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA, free_port

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
VOCAB = Path(SHARED_DATA) / "tokenizers" / "gpt2"
pytestmark = pytest.mark.skipif(not (BOTCHAN.is_file() and VOCAB.is_dir()), reason="../shared/data not present")


def _overrides(run_dir: Path, **extra) -> list[str]:
    spec = {"kind": "gpt2_bpe", "vocab_file": str(VOCAB / "gpt2-vocab.json"), "merges_file": str(VOCAB / "gpt2-merges.txt")}
    o = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]", "data.tokenizer": json.dumps(spec),
         "run.dir": str(run_dir), "train.progress_bar": "false", "model.seq_length": "16", "model.hidden_size": "32",
         "model.num_attention_heads": "2", "train.micro_batch_size": "2", "train.global_batch_size": "2",
         "optimizer.warmup_iters": "1", "train.iters": "4", "train.save_interval": "2", "parallel.tensor": "1"}
    o.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in o.items()]


def _env():
    return dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "die_while_saving.py"
    # DeepSpeed writes checkpoint files with torch.save: the patched one writes half a file of the
    # second checkpoint and kills the process on the spot, as SIGKILL would.
    script.write_text(textwrap.dedent(f"""
        import os, sys, torch
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            if "iter_0000004" in str(f):
                with open(f, "wb") as fh:
                    fh.write(b"half a checkpoint")
                os._exit(137)
            return real_save(obj, f, *a, **k)
        torch.save = dying_save
        from training import pretrain
        sys.exit(pretrain.main(["--config", "configs/gpt2_tiny.yaml", *{_overrides(run_dir)!r}]))
    """))
    res = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 137, res.stdout[-2000:] + res.stderr[-2000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "iter_0000002"  # still the previous, complete checkpoint
    assert (ckpts / "iter_0000004").is_dir()                  # the torn one exists but is not pointed to
    # rerunning the same command resumes from iteration 2 and finishes
    res = subprocess.run([sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
                          *_overrides(run_dir)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "resumed from iter_0000002 at iteration 2" in res.stdout
    assert (ckpts / "latest").read_text() == "iter_0000004"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in steps if "event" not in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_two_node_launch_from_hostfile_without_ssh(tmp_path):
    """Two "nodes" on this machine (two host names for the loopback address, one process each),
    each started by its own launcher with --no_ssh --node_rank, as on a cluster without ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes, one process each\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    run_dir = tmp_path / "hf"
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
               "--module", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
               *_overrides(run_dir, **{"parallel.tensor": 2, "train.iters": 2, "train.save_interval": 0})]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert "dist_world_size=2" in outs[0] and "node_rank=1" in outs[1]
    assert "ParallelState(world=2, tp=2" in outs[0]
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000002"
