"""Process-group start-up shared by every entry point (training, fine-tuning, resharding, tests).

DeepSpeed's CPU backend builds a shared-memory all-reduce kernel (``deepspeed_shm_comm``) at
``init_distributed`` and maps a buffer per rank under /dev/shm, named after the master address and
port, that is never unlinked: every run leaves ~64 MB per rank behind, and a test suite of short
runs fills /dev/shm (RAM) until the OOM killer stops it. That kernel only serves DeepSpeed's
inference all-reduce, which this project does not use (all collectives go through
torch.distributed), so it is switched off before DeepSpeed's backend starts. The process-wide DeepSpeed
adaptations (weights-only checkpoint reads; ``training.optim.engine.install_process_wide``) are installed here too,
since every entry point passes here before it reads a checkpoint or builds an engine.
"""
from __future__ import annotations

from megatron_ds_suite.core.errors import SuiteError


class PortInUse(SuiteError):
    """The rendezvous port is taken: one line naming ``--master_port`` (exit 2, like other bad input)."""


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed's comm layer. Without the launcher (one plain
    process) the rendezvous variables default to a single local rank on a free port (``MASTER_PORT`` when
    set)."""
    import os

    if "MASTER_PORT" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        # one plain process: a free port, not a fixed one (two runs on one machine would both take 29500)
        from megatron_ds_suite.core.network import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    import deepspeed.ops
    import torch.distributed
    from deepspeed.accelerator import get_accelerator

    from training.optim.engine import install_process_wide

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    install_process_wide()  # DeepSpeed's checkpoint reads weights-only (training/optim/engine.py)
    # each process on its own GPU before the first group: NCCL (the accelerator's backend on CUDA) and
    # all_gather_object otherwise all use GPU 0 (training/runtime/device.py)
    from training.runtime.device import set_local_device

    set_local_device()
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    except torch.distributed.DistNetworkError as e:
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        raise PortInUse(f"the rendezvous port {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} is already in "
                        f"use (EADDRINUSE: another run or service holds it): choose a free one with `deepspeed --master_port N` "
                        f"(MASTER_PORT=N for one process)") from None


def rank0_first(build):
    """Collective: rank 0 runs ``build()`` first (writing caches such as index maps), then the other
    ranks run it (reading them). A :class:`~megatron_ds_suite.core.errors.SuiteError` met by rank 0 is
    sent to every rank and all raise it together, the copies marked ``agreed`` (printed by rank 0 only),
    instead of the other ranks waiting at a barrier for a rank that left."""
    import torch.distributed as dist

    from megatron_ds_suite.core.errors import SuiteError

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    out, error = None, None
    if rank == 0:
        try:
            out = build()
        except SuiteError as e:
            error = e
    if world > 1:
        box = [None if error is None else (type(error), str(error))]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and rank != 0:
            cls, message = box[0]
            try:
                error = cls(message)
            except TypeError:  # a class with another constructor: the same line, as the base class
                error = SuiteError(message)
            error.agreed = True
    if error is not None:
        raise error
    if rank != 0:
        out = build()
    return out


def agreed(run):
    """Collective: every rank runs ``run()``; a :class:`~megatron_ds_suite.core.errors.SuiteError` met by any
    rank (a truncated or refused shard of its own, ...) is raised by every rank, the lowest failing rank's,
    printed by rank 0 alone (the other copies marked ``agreed``), instead of one rank printing the line and
    the others a gloo traceback when it leaves. ``run`` must hold no collective that a failing rank could skip."""
    import torch.distributed as dist

    from megatron_ds_suite.core.errors import SuiteError

    world = dist.get_world_size() if dist.is_initialized() else 1
    out, error = None, None
    try:
        out = run()
    except SuiteError as e:
        error = e
    if world > 1:
        rank = dist.get_rank()
        boxes: list = [None] * world
        dist.all_gather_object(boxes, None if error is None else (type(error), str(error)))
        first = next((b for b in boxes if b is not None), None)
        if first is not None:
            if error is None or str(error) != first[1]:
                cls, message = first
                try:
                    error = cls(message)
                except TypeError:  # a class with another constructor: the same line, as the base class
                    error = SuiteError(message)
            error.agreed = rank != 0
    if error is not None:
        raise error
    return out
