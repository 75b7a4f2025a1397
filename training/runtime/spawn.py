"""The one process spawner: run a function on N local gloo ranks on CPU.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each initialising a gloo process
group through :func:`training.runtime.distributed.init_distributed` on a free loopback port, runs
``fn(rank, world_size, *args)`` and returns the list of per-rank return values (must be picklable). A child
exception raises in the parent with the child's traceback, a child that dies without a word (killed, a crash in
native code) with its exit code; a hung child is killed after ``timeout`` seconds; a failed rendezvous (another
process took the free port between probe and bind) is retried on a new port.

Its users: the offline tools that build a layout (:mod:`training.tools.reshard` the target one,
:mod:`training.tools.reshard_optim` the source one), the multi-rank tests (``tests/parallel``) and the
benchmarks.
"""
from __future__ import annotations

import io
import logging
import os
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ds_suite.core.network import free_port
from training.runtime.distributed import init_distributed

__all__ = ["run_distributed"]

# what a rendezvous that lost its port race says (worth a retry on a new port); anything else is the function's
_TRANSIENT = ("Address already in use", "EADDRINUSE", "connectFullMesh failed", "Connection reset by peer")


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size),
                      DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)  # world_size ranks share the machine's cores
    logging.basicConfig(level=logging.WARNING)
    try:
        # DeepSpeed's comm layer wraps torch.distributed (its checkpointing RNG and engine need it)
        init_distributed("gloo")
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: no shared-memory handles that die with the child
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float | None = 300.0, retries: int = 2) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and return their results in rank order.
    Raises AssertionError (``distributed worker failed``, with the child's traceback) when a rank raised;
    retried (on a new port) when the rendezvous itself failed. ``timeout=None`` waits as long as the ranks
    run (the offline tools, whose time grows with the checkpoint)."""
    for attempt in range(retries + 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except AssertionError as e:
            if attempt == retries or not any(t in str(e) for t in _TRANSIENT):
                raise


def _run_once(fn, world_size: int, args, timeout: float | None) -> list:  # noqa: C901
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []

    def take(message) -> None:
        rank, status, payload = message
        if status == "error":
            errors.append(f"rank {rank}:\n{payload}")
        else:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)

    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                take(queue.get(timeout=1.0))
                continue
            except Empty:
                pass
            # a rank that left without a word (killed by the OOM killer, a crash in native code, an error before
            # its function ran) would otherwise be waited for until the timeout, or forever without one
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if gone:
                try:  # its last words may have arrived just now
                    take(queue.get(timeout=1.0))
                    continue
                except Empty:
                    errors.append(f"rank {gone[0]}: exited with code {procs[gone[0]].exitcode} without a result")
            elif deadline is not None and time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in results]
                errors.append(f"rank(s) {missing}: no result within {timeout:g} s")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
