"""The Slurm example (scripts/slurm/): the sbatch script parses, and two tasks started the way srun starts them
(SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR and MASTER_PORT exported by the sbatch script) train a
TP = 2 run through ``scripts/slurm/task.sh``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.distributed import free_port
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides


def test_the_sbatch_script_parses():
    for script in ("pretrain.sbatch", "task.sh"):
        res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "slurm" / script)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


def test_a_task_outside_srun_is_one_line():
    res = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "task.sh"), "training.pretrain"], cwd=ROOT,
                         env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                         capture_output=True, text=True)
    assert res.returncode != 0 and "SLURM_PROCID: run under srun" in res.stderr


@needs_corpus
def test_two_srun_tasks_train_a_tp2_run(spm_model, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    overrides = tiny_overrides(spm_model, run, **{"train.iters": 2, "parallel.tensor": 2})
    tasks = []
    for rank in (0, 1):
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHON=sys.executable, DS_ACCELERATOR="cpu",
                   PYTHONPATH=str(ROOT))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        tasks.append(subprocess.Popen(["bash", "scripts/slurm/task.sh", "training.pretrain", "--config",
                                       "configs/gpt2_tiny.yaml", *overrides], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [t.communicate(timeout=600)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "event" not in r] == [1, 2]
    assert json.loads((run / "config.json").read_text())["parallel"]["tensor"] == 2
