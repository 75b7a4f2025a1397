"""The pipeline bubble's timer (``training.optim.pipe_bubble``): what it sums, what it wraps (no process started)."""
from __future__ import annotations

import pytest


def test_comm_timer_reads_the_fraction_of_the_steps_since_the_last_read(monkeypatch):
    from training.optim import pipe_bubble

    clock = iter([0.0, 10.0, 20.0, 24.0])
    monkeypatch.setattr(pipe_bubble.time, "perf_counter", lambda: next(clock))
    t = pipe_bubble.CommTimer()
    t.add(5.0)                       # outside a step (an evaluation batch): not counted
    assert t.read() is None
    t.begin_step()                   # 0.0
    t.add(2.0)
    t.add(1.0)
    t.end_step()                     # 10.0: 3 s of 10
    t.begin_step()                   # 20.0
    t.add(1.0)
    t.end_step()                     # 24.0: 1 s of 4
    assert t.read() == pytest.approx(4.0 / 14.0)
    assert t.read() is None          # counted afresh after a read
    assert pipe_bubble.bubble_over_ideal(0.2) == pytest.approx(0.25)  # (p-1)/(m+p-1) -> (p-1)/m at p=2, m=4


def test_only_the_communication_instructions_are_timed():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from training.optim.engine import PipeEngine
    from training.optim.pipe_bubble import PIPE_COMM_INSTRUCTIONS, CommTimer, timed_instructions

    base, ours = PipelineEngine._INSTRUCTION_MAP, PipeEngine._INSTRUCTION_MAP
    assert set(ours) == set(base)
    for kind, fn in ours.items():
        assert (fn is base[kind]) == (kind not in PIPE_COMM_INSTRUCTIONS), kind
    assert schedule.ForwardPass not in PIPE_COMM_INSTRUCTIONS and schedule.RecvGrad in PIPE_COMM_INSTRUCTIONS

    class FakeEngine:  # what a wrapped instruction needs of its engine
        comm_timer = CommTimer()

    calls = []
    timed = timed_instructions({schedule.SendGrad: lambda engine, **kw: calls.append(kw) or engine})
    engine = FakeEngine()
    engine.comm_timer.begin_step()
    assert timed[schedule.SendGrad](engine, buffer_id=3) is engine and calls == [{"buffer_id": 3}]
    engine.comm_timer.end_step()
    assert 0.0 < engine.comm_timer.read() <= 1.0
    assert sum(kind in PIPE_COMM_INSTRUCTIONS for kind in ours) == 5  # 4 p2p + the tied-gradient all-reduce
