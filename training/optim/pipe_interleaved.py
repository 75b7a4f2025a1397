"""Megatron's interleaved 1F1B schedule (Narayanan et al. 2021) on DeepSpeed's pipeline engine.

:class:`InterleavedSchedule` is a DeepSpeed ``PipeSchedule`` whose buffer instructions carry a ``chunk`` id (the
way ``DualPipeVSchedule``'s carry a ``phase``); :class:`InterleavedPipelineEngine` is a ``PipelineEngine`` that runs
it over an :class:`~training.models.pipe_chunks.InterleavedPipeModule` (one chunk active per instruction, as
``DualPipeVEngine`` activates a phase). The project's engine combines it with its own
(``training.optim.engine.InterleavedPipeEngine``), so the owned optimizer step and fp16/bf16 stay the same.

The order (Megatron-LM ``forward_backward_pipelining_with_interleaving``): with p ranks, v chunks and m
micro-batches (m a multiple of p), the v m forward units of rank r run in groups of p micro-batches per chunk,
unit i being micro-batch ``(i // (p v)) p + i % p`` of chunk ``(i // p) % v``; backward units the same with the
chunks reversed. Rank r first runs ``(p - r - 1) 2 + (v - 1) p`` forwards (all v m when m == p), then alternates one
forward and one backward, then finishes the backwards. The bubble is (p-1)/(v m) of the step instead of (p-1)/m.

Point-to-point traffic (:mod:`training.optim.pipe_channels`): each send is posted (``isend``) as soon as its
tensor exists and waited at the end of the step; each receive is posted and waited right before its tensor is
needed. No message carries a tag: each message stream (activations or gradients, from one stage to another: the
wraparound rank p-1 -> rank 0 is its own stream) has its own two-rank process group, and every rank walks its units
in the same order, so each group's messages arrive in the order they are received. That is what NCCL needs (it
ignores tags); gloo runs the same code. Without sequence parallelism each TP rank sends only its 1/t of every
activation and gradient and the receiving stage all-gathers them (Megatron's scatter/gather,
:mod:`training.parallel.pipe_scatter`; the TP group from the module's ``scatter_group``).
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from training.optim.pipe_channels import (
    Link,
    PipeChannels,
    activation_in,
    activation_out,
    check_backend,
    gradient_in,
    gradient_out,
)
from training.parallel import pipe_scatter

_INIT = object()  # before the engine's own state: PipelineEngine.__init__'s p2p warm-up asks for the stages

# the activation metadata, sent once per chunk on the activation link ahead of its first activation
META_SIZE = 16


class InterleavedSchedule(schedule.PipeSchedule):
    """Rank ``stage_id``'s instructions for one batch of Megatron's interleaved 1F1B (module docstring).

    Buffer ``chunk * micro_batches + micro_batch`` holds one unit's tensors; ``forward_only``: every forward in
    order and no backward (evaluation)."""

    def __init__(self, micro_batches, stages, stage_id, chunks, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        self.chunks, self.forward_only = chunks, forward_only

    def num_pipe_buffers(self):
        return self.chunks * self.micro_batches

    def unit(self, i: int, forward: bool) -> tuple[int, int]:
        """(chunk, micro-batch) of this rank's i-th forward (or backward) unit."""
        p, v = self.stages, self.chunks
        chunk = (i // p) % v
        return (chunk if forward else v - 1 - chunk), (i // (p * v)) * p + i % p

    def warmup(self) -> int:
        total = self.chunks * self.micro_batches
        if self.forward_only or self.micro_batches == self.stages:
            return total
        return min(total, (self.stages - self.stage_id - 1) * 2 + (self.chunks - 1) * self.stages)

    def order(self) -> list[tuple[bool, int, int]]:
        """(forward?, chunk, micro-batch) of every unit of this rank, in the order it runs them."""
        total, warm = self.chunks * self.micro_batches, self.warmup()
        units = [(True, *self.unit(i, True)) for i in range(warm)]
        for k in range(total - warm):
            units += [(True, *self.unit(warm + k, True)), (False, *self.unit(k, False))]
        if not self.forward_only:
            units += [(False, *self.unit(k, False)) for k in range(total - warm, total)]
        return units

    def steps(self):
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        v = self.chunks
        for forward, chunk, mb in self.order():
            buf = chunk * self.micro_batches + mb
            if forward:
                cmds = []
                if (first and chunk == 0) or (last and chunk == v - 1):
                    cmds.append(schedule.LoadMicroBatch(buf, chunk=chunk))
                if not (first and chunk == 0):
                    cmds.append(schedule.RecvActivation(buf, chunk=chunk, micro_batch=mb))
                cmds.append(schedule.ForwardPass(buf, chunk=chunk))
                if not (last and chunk == v - 1):
                    cmds.append(schedule.SendActivation(buf, chunk=chunk, micro_batch=mb))
            else:
                cmds = [] if last and chunk == v - 1 else [schedule.RecvGrad(buf, chunk=chunk, micro_batch=mb)]
                cmds.append(schedule.BackwardPass(buf, chunk=chunk))
                if not (first and chunk == 0):
                    cmds.append(schedule.SendGrad(buf, chunk=chunk, micro_batch=mb))
            yield cmds
        yield [schedule.CommitP2P()] + ([] if self.forward_only else
                                        [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()])


def _as_list(tensors):
    return [tensors] if torch.is_tensor(tensors) else list(tensors)


class InterleavedPipelineEngine(PipelineEngine):
    """Runs an ``InterleavedPipeModule`` with :class:`InterleavedSchedule` (module docstring)."""

    def __init__(self, *args, **kwargs):
        self._active_chunk = _INIT
        super().__init__(*args, **kwargs)
        check_backend(dist.get_backend(), os.environ)
        assert hasattr(self.module, "activate_chunk"), "model must be an InterleavedPipeModule"
        assert not (self.is_pipe_partitioned or self.is_grad_partitioned), \
            "the interleaved schedule sends whole tensors: set pipeline.pipe_partitioned/grad_partitioned false"
        self.chunks = len(self.module.chunk_bounds)
        self._active_chunk = None
        self._sends: list = []  # (work, tensor) of this batch's isends, waited by CommitP2P
        self._recv_specs: dict[int, tuple[bool, list]] = {}
        self._meta_sent: set[int] = set()
        # one process group per message stream (pipe_channels), on every rank in the same order
        self.channels = PipeChannels(self.grid.pipe_groups, self.device)
        # Megatron's scatter/gather: the TP group the stage-to-stage tensors travel in 1/t pieces over (None: whole)
        self.scatter_group = self.module.scatter_group
        self.pipe_buffers["grads"] = []
        self.pipe_buffers["losses"] = []

    # -- where a chunk sits in the pipeline ---------------------------------------------------------------
    def is_first_stage(self):
        if self._active_chunk is _INIT or self._active_chunk is None:
            return super().is_first_stage()
        return self.stage_id == 0 and self._active_chunk == 0

    def is_last_stage(self):
        """Outside a chunk (loss aggregation, the p2p warm-up): rank p-1, which holds the loss."""
        if self._active_chunk is _INIT or self._active_chunk is None:
            return super().is_last_stage()
        return self.stage_id == self.num_stages - 1 and self._active_chunk == self.chunks - 1

    @contextmanager
    def _chunk(self, chunk):
        self._active_chunk = chunk
        self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self._active_chunk = None

    def _train_schedule(self):
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.chunks)

    def _inference_schedule(self, micro_batches):
        return InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.chunks, forward_only=True)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._recv_specs, self._meta_sent = {}, set()

    # -- point to point --------------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, link: Link) -> None:
        tensor = tensor.contiguous()
        self._sends.append((self.channels.isend(tensor, link), tensor))

    def _recv_whole(self, shape, dtype: torch.dtype, link: Link) -> torch.Tensor:
        """The next tensor of ``shape`` on ``link``: received whole, or as this TP rank's piece and all-gathered
        (:mod:`training.parallel.pipe_scatter`)."""
        buf = pipe_scatter.receive_buffer(shape, dtype, self.scatter_group, self.device)
        return pipe_scatter.whole(self.channels.recv(buf, link), shape, self.scatter_group)

    def _exec_commit_p2p(self):
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def _send_meta(self, outputs, link: Link) -> None:
        """Once per chunk: [n, (dtype id, ndim, *shape) per tensor] of what the chunk sends downstream."""
        meta = [len(_as_list(outputs))]
        for t in _as_list(outputs):
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        assert len(meta) <= META_SIZE, f"activation metadata {meta} exceeds {META_SIZE} entries"
        buf = torch.zeros(META_SIZE, dtype=torch.int64, device=self.device)
        buf[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
        self._isend(buf, link)

    def _recv_meta(self, link: Link) -> tuple[bool, list]:
        meta = self.channels.recv(torch.zeros(META_SIZE, dtype=torch.int64, device=self.device), link).tolist()
        specs, at = [], 1
        for _ in range(meta[0]):
            ndim = meta[at + 1]
            specs.append((meta[at + 2:at + 2 + ndim], self.ID_TO_DTYPE[meta[at]]))
            at += 2 + ndim
        return meta[0] == 1, specs

    # -- the instructions -------------------------------------------------------------------------------------
    def _exec_load_micro_batch(self, buffer_id, chunk):
        with self._chunk(chunk):
            super()._exec_load_micro_batch(buffer_id)

    def _exec_forward_pass(self, buffer_id, chunk):
        with self._chunk(chunk):
            super()._exec_forward_pass(buffer_id)
            loss_stage = self.is_last_stage()
        if loss_stage and torch.is_grad_enabled():
            self.pipe_buffers["losses"][buffer_id] = self.loss
        if not torch.is_grad_enabled():  # no backward frees them (nor a send, the loss stage's outputs)
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if loss_stage:
                self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id, chunk):
        with self._chunk(chunk):
            if self.is_last_stage():
                self.loss = self.pipe_buffers["losses"][buffer_id]
                self.pipe_buffers["losses"][buffer_id] = None
            else:
                self.grad_layer = self.pipe_buffers["grads"][buffer_id]
                self.pipe_buffers["grads"][buffer_id] = None
            super()._exec_backward_pass(buffer_id)
            if self.is_first_stage():
                self.pipe_buffers["inputs"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["labels"][buffer_id] = None
        self.grad_layer = None

    def _exec_send_activations(self, buffer_id, chunk, micro_batch):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        link, _ = activation_out(self.stage_id, chunk, self.num_stages)
        if chunk not in self._meta_sent:  # ahead of the chunk's first activation, on the same link
            self._meta_sent.add(chunk)
            self._send_meta(outputs, link)
        for t in _as_list(outputs):  # several tensors in order on the link (each TP rank's piece: pipe_scatter)
            self._isend(pipe_scatter.piece(t.detach(), self.scatter_group), link)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, chunk, micro_batch):
        link, _ = activation_in(self.stage_id, chunk, self.num_stages)
        if chunk not in self._recv_specs:
            self._recv_specs[chunk] = self._recv_meta(link)
        is_tensor, specs = self._recv_specs[chunk]
        recvd = [self._recv_whole(shape, dtype, link).requires_grad_(dtype.is_floating_point)
                 for shape, dtype in specs]
        self.pipe_buffers["inputs"][buffer_id] = recvd[0] if is_tensor else tuple(recvd)

    def _exec_send_grads(self, buffer_id, chunk, micro_batch):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        link, _ = gradient_out(self.stage_id, chunk, self.num_stages)
        for t in _as_list(inputs):
            if t.is_floating_point():
                assert t.grad is not None
                self._isend(pipe_scatter.piece(t.grad, self.scatter_group), link)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, chunk, micro_batch):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        link, _ = gradient_in(self.stage_id, chunk, self.num_stages)  # from the next hop
        grads = [self._recv_whole(t.shape, t.dtype, link) for t in _as_list(outputs) if t.is_floating_point()]
        self.pipe_buffers["grads"][buffer_id] = grads[0] if torch.is_tensor(outputs) else grads

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.CommitP2P: _exec_commit_p2p,
    }
