"""``training.parallel`` stands on its own: importing every one of its modules loads no other part of the
suite besides the shared core (no training config, runtime, models or tools, no data pipeline, no
evaluation). Checked in a fresh interpreter so that modules other tests imported do not hide a wrong-way
import."""
from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import training.parallel

REPO = Path(__file__).resolve().parents[2]


def _modules() -> list[str]:
    return sorted(f"training.parallel.{m.name}" for m in pkgutil.iter_modules(training.parallel.__path__))


def test_every_parallel_module_is_listed():
    names = _modules()
    for expected in ("cross_entropy", "grad_norm", "layers", "mappings", "random", "sharding", "state", "utils"):
        assert f"training.parallel.{expected}" in names


def test_training_parallel_imports_no_other_stage_module():
    code = (
        "import importlib, json, sys\n"
        f"for name in {_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "training.parallel.state" in loaded  # the import above really ran
    assert "training.config" not in loaded
    assert "training.runtime" not in loaded
    ours = ("training", "evaluation", "data_pipeline", "megatron_ds_suite")
    wrong = [m for m in loaded if m.split(".")[0] in ours and m != "training"
             and not m.startswith(("training.parallel", "megatron_ds_suite.core"))
             and m != "megatron_ds_suite"]
    assert wrong == [], f"training.parallel pulled in {wrong}"
