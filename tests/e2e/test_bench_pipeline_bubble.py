"""The bubble benchmark's schedule rows (benchmarks/bench_pipeline_bubble.py): formulas as the planner's, the rules'
cells skipped, and each new schedule's stages running (tiny sizes; no timing is asserted)."""
from __future__ import annotations

import pytest

from benchmarks import bench_pipeline_bubble as bench
from tests.helpers.distributed import run_distributed
from training.layout import Layout
from training.plan.timing import bubble_fraction


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_formulas_are_the_planners(p, m):
    cases = {"1f1b": Layout(pp=p, micro_batch=1, global_batch=m),
             "interleaved": Layout(pp=p, micro_batch=1, global_batch=m, virtual_pipeline=bench.V),
             "dualpipev": Layout(pp=p, micro_batch=1, global_batch=m, dualpipev=True)}
    for name, lay in cases.items():
        sched = bench.SCHEDULES[name]
        assert sched.over_ideal(p, m) == pytest.approx(bubble_fraction(lay))
        f = sched.fraction(p, m)
        assert f / (1 - f) == pytest.approx(sched.over_ideal(p, m))


def test_cells_the_rules_refuse():
    interleaved, dualpipev = bench.SCHEDULES["interleaved"].refuse, bench.SCHEDULES["dualpipev"].refuse
    assert interleaved(2, 4, 2) is None and dualpipev(2, 4, 2) is None
    assert "multiple of p" in interleaved(4, 6, 2)
    assert "chunks" in interleaved(2, 4, 3)
    assert "2p" in dualpipev(4, 6, 2)
    assert "two stages" in dualpipev(2, 4, 3)
    assert bench.SCHEDULES["1f1b"].refuse(4, 3, 1) is None


def _worker(rank: int, world: int) -> dict:
    a = {"hidden": 16, "batch": 2, "layers_per_stage": 2, "steps": 1, "warmup": 0, "micro": 4}
    return {s: bench.stage_worker(rank, world, {**a, "schedule": s}) for s in ("interleaved", "dualpipev")}


def test_new_schedules_run_on_two_ranks():
    for rank in run_distributed(_worker, 2):
        for res in rank.values():
            assert 0.0 <= res["fraction"] < 1.0 and res["secs"] > 0
