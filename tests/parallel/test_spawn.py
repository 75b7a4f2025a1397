"""The one process spawner (training.runtime.spawn.run_distributed): results in rank order, a rank's exception
with its traceback, and a rank that dies without a word reported at once (not waited for until the timeout)."""
from __future__ import annotations

import time

import pytest

from tests.helpers.distributed import run_distributed


def _rank_and_world(rank, world):
    import torch.distributed as dist

    return rank, world, dist.get_world_size()


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("planted on rank 1")
    return rank


def _rank1_dies(rank, world):
    import os

    if rank == 1:
        os._exit(7)  # no exception, no result: as a rank killed by the OOM killer
    return rank


def test_results_come_in_rank_order():
    assert run_distributed(_rank_and_world, 2) == [(0, 2, 2), (1, 2, 2)]


def test_a_rank_that_raises_fails_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)rank 1:.*ValueError: planted on rank 1"):
        run_distributed(_rank1_raises, 2, retries=0)


def test_a_rank_that_dies_without_a_word_is_reported_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1: exited with code 7 without a result"):
        run_distributed(_rank1_dies, 2, timeout=None, retries=0)
    assert time.monotonic() - start < 60
