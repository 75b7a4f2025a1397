"""Evaluation starts its process groups through the training runtime (``init_distributed``) and checks the launched
processes against ``--tp`` with the training layout's one check (issue 39)."""
from __future__ import annotations

import pytest

from megatron_ds_suite.core.errors import SuiteError
from tests.helpers.distributed import free_port, run_distributed


def _own_groups(rank, world, port):
    """The spawner's group torn down, then evaluation's start-up on the launcher's variables (a new port)."""
    import os

    import torch.distributed as dist
    from deepspeed import comm as ds_comm

    from evaluation.model import setup_runtime

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    rt = setup_runtime(tp=2)
    return {"tp": rt.pstate.dims.tp, "dp": rt.dp.world, "main": rt.is_main, "deepspeed_comm": ds_comm.is_initialized(),
            "world": dist.get_world_size()}


def test_evaluation_starts_its_groups_through_the_training_runtime():
    first, second = run_distributed(_own_groups, 2, free_port())
    assert first == {"tp": 2, "dp": 1, "main": True, "deepspeed_comm": True, "world": 2}
    assert second == {**first, "main": False}


def test_processes_not_dividing_tp_are_one_line_before_any_group(monkeypatch):
    import torch.distributed as dist

    from evaluation.model import setup_runtime

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SuiteError) as e:
        setup_runtime(tp=3)
    assert str(e.value) == "2 processes are not divisible by --tp 3: launch a multiple of 3 processes"
    assert not dist.is_initialized()
