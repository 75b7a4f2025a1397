"""What a pipeline engine really sends stage to stage, counted where the bytes leave: for the planner's check.

:class:`PipeTraffic` wraps, while it is entered, every function a pipeline schedule sends through and records the
floating-point tensors (the activations and their gradients; the int64 shape/partition metadata and BERT's masks
aside):

* ``deepspeed.comm.send``: DeepSpeed's 1F1B (``deepspeed.runtime.pipe.p2p.send``, synchronous only; ``isend`` is
  left alone: DualPipeV's ``P2POp`` checks its operation is DeepSpeed's own function);
* ``deepspeed.comm.batch_isend_irecv``: DeepSpeed's DualPipeV (each of its ``isend`` operations);
* ``PipeChannels.isend``: the interleaved engine (``training.optim.pipe_channels``);

and counts the all-gathers the schedules add on receipt: every ``torch.distributed.all_gather`` /
``all_gather_into_tensor`` and ``deepspeed.comm.all_gather_into_tensor`` call (DeepSpeed's ``PartitionedTensor``
reaches torch through a function it looked up once, so it is caught at ``deepspeed.comm``), less those the TP layers
issue (``training.parallel.mappings.COLLECTIVE_CALLS``), with the bytes each rank hands in.
"""
from __future__ import annotations

import functools

import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist

from training.optim.pipe_channels import PipeChannels
from training.parallel import mappings


class PipeTraffic:
    """``sends``: bytes of each floating-point message this rank sent; ``gathers``: bytes each all-gather took from
    this rank (the TP layers' among them; :meth:`pipe_gathers` counts the others). Entered once per step, it adds
    up over the blocks."""

    def __init__(self):
        self.sends: list[int] = []
        self.gathers: list[int] = []
        self._saved: list[tuple[object, str, object]] = []
        self._tp_gathers = 0  # the TP layers' all-gathers inside the blocks so far
        self._tp_start = 0

    def _send(self, t: torch.Tensor) -> None:
        if t.dtype.is_floating_point:
            self.sends.append(t.numel() * t.element_size())

    def _wrap(self, owner, name: str, record) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            record(*args, **kwargs)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self):
        self._tp_start = mappings.COLLECTIVE_CALLS["all_gather"]
        self._wrap(ds_comm, "send", lambda *a, **k: self._send(_operand(a, k, 0, "tensor")))
        self._wrap(ds_comm, "batch_isend_irecv",
                   lambda ops, *a, **k: [self._send(op.tensor) for op in ops if op.op == "isend"])
        self._wrap(PipeChannels, "isend", lambda channels, tensor, *a, **k: self._send(tensor))
        self._wrap(dist, "all_gather", lambda *a, **k: self.gathers.append(_bytes(_operand(a, k, 1, "tensor"))))
        for owner in (dist, ds_comm):
            self._wrap(owner, "all_gather_into_tensor",
                       lambda *a, **k: self.gathers.append(_bytes(_operand(a, k, 1, "input_tensor"))))
        return self

    def __exit__(self, *exc):
        self._tp_gathers += mappings.COLLECTIVE_CALLS["all_gather"] - self._tp_start
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        return False

    def pipe_gathers(self) -> int:
        """All-gathers the pipeline schedule added (after the block): all of them less the TP layers'."""
        return len(self.gathers) - self._tp_gathers


def _operand(args: tuple, kwargs: dict, at: int, name: str) -> torch.Tensor:
    """The tensor a collective was called with, by position or by keyword."""
    return args[at] if len(args) > at else kwargs[name]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
