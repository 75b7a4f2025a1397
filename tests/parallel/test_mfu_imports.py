"""The trainer's MFU metric loads only the planner's accounting module (issue 32 item 6), checked in a fresh
interpreter so that what other tests imported does not count."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_mfu_metric_loads_only_the_planners_accounting():
    """The trainer's metrics and its FLOP count (``training.plan.accounting``) load no more of the planner: not its
    CLI, report or time model; the ``training.plan`` package re-exports nothing, so it loads no submodule of its
    own."""
    code = ("import sys, training.metrics, training.plan.accounting; "
            "print(sorted(m for m in sys.modules if m.startswith('training.plan')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['training.plan', 'training.plan.accounting']", out
