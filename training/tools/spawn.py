"""Run a function in N local processes joined by a gloo process group: how the offline tools build a
layout (:mod:`training.tools.reshard` the target one, :mod:`training.tools.reshard_optim` the source one)."""
from __future__ import annotations

import logging
import os

import torch

from megatron_ds_suite.core.network import free_port


def spawn_gloo(fn, world: int, args: tuple) -> None:
    """Run ``fn(*args)`` in ``world`` spawned processes joined by a gloo process group."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, start_method="spawn")


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from training.runtime.distributed import init_distributed

    logging.basicConfig(level=logging.WARNING)
    init_distributed("gloo")
    try:
        fn(*args)
    finally:
        torch.distributed.destroy_process_group()
