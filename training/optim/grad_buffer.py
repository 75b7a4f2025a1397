"""Gradients in one contiguous buffer per dtype, and the data-parallel reduction bucketed and overlapped with backward.

Megatron-Core's ``ParamAndGradBuffer`` + ``overlap_grad_reduce``, for DeepSpeed's ZeRO-0 engine without pipeline
parallelism (:func:`training.optim.engine.build_engine` decides where):

* **static gradients**: every trained parameter's ``.grad`` is set once to a view of one buffer per dtype, before
  the first backward. Autograd's ``AccumulateGrad`` then adds each micro-batch's gradient into that view in place
  (it keeps an existing ``.grad`` whenever grad mode is off in backward: any backward without ``create_graph``,
  reentrant checkpoints included), so the addresses never change; a step ends with :meth:`GradBuffer.zero` (one
  ``zero_`` per dtype) instead of ``p.grad = None``. The price: the first micro-batch adds its gradients to zeros
  (one ``add_`` per parameter) where autograd would have kept the fresh tensor.
* **memory order**: the optimizer's parameter groups one after another, each in its own order (per dtype), so a
  group's gradients are one slice of the buffer (:meth:`GradBuffer.span_of`: the mixed-precision step casts that
  slice once instead of concatenating).
* **buckets**: runs of about ``bucket_size`` elements (Megatron: 40M; here :data:`DEFAULT_BUCKET_SIZE`), cut
  walking each (dtype, group) run from its end, so a bucket holds neighbouring layers. Buckets are launched in one
  fixed order, the same on every rank (a collective must be issued in the same order everywhere): by the expected
  time of their last gradient, i.e. the lowest registration index among their parameters, highest first (backward
  runs roughly in reverse registration order). :func:`assign_buckets` is the rule.
* **overlap**: on the last micro-batch of a step (:meth:`GradBuffer.begin` with ``reduce=True``) each parameter's
  post-accumulate-grad hook counts it into its bucket; a complete bucket, once all buckets before it in the launch
  order are launched, starts its all-reduce asynchronously while backward goes on. :meth:`GradBuffer.finish` (the
  engine's ``allreduce_gradients``, at the end of backward) launches what is left and waits.

The arithmetic is DeepSpeed's ZeRO-0 reduction (``DeepSpeedEngine.allreduce_bucket``), element for element
(:class:`DpReduction`): the same pre/post multiplications by the same Python scalars on the same communication
dtype, so the result is bitwise DeepSpeed's wherever the all-reduce's own sum is independent of how the gradients
are cut into buckets: two ranks on any backend (``a + b == b + a``). With more ranks, gloo's ring (and NCCL) sums
an element in an order that depends on its position in the buffer reduced, for DeepSpeed's single 500M-element
bucket as for these.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_SIZE = 25_000_000  # elements per bucket (Megatron-Core: max(40M, 1M x DP))


@dataclass(frozen=True)
class DpReduction:
    """DeepSpeed's ZeRO-0 gradient reduction (``allreduce_bucket``): how a bucket is scaled and summed.

    ``world_size`` is DeepSpeed's ``dp_world_size``: the group's size divided by the (Ulysses) sequence-parallel
    size, a float. The scalars below are computed by the same Python expressions, so the multiplications match
    to the bit."""

    group: dist.ProcessGroup | None
    world_size: float
    average: bool  # gradient_allreduce_op "mean" (DeepSpeed's default)
    postscale: bool  # not prescale_gradients (the default): divide after the sum
    predivide: float  # gradient_predivide_factor
    comm_dtype: torch.dtype

    def before(self, t: torch.Tensor) -> None:
        if not self.average:
            return
        if self.postscale:
            if self.predivide != 1.0:
                t.mul_(1.0 / self.predivide)
        else:
            t.mul_(1. / self.world_size)

    def after(self, t: torch.Tensor) -> None:
        if self.average and self.postscale and self.predivide != self.world_size:
            t.mul_(self.predivide / self.world_size)


@dataclass(frozen=True)
class Bucket:
    """A run ``[start, end)`` of the ``dtype`` buffer and the parameters it holds (indices into
    :attr:`GradBuffer.params`)."""

    dtype: torch.dtype
    start: int
    end: int
    params: tuple[int, ...]


def assign_buckets(runs: list[list[tuple[int, int]]], bucket_size: int) -> list[list[int]]:
    """Cut ``runs`` into buckets and order them for launch.

    ``runs``: the buffer's runs of one dtype and one parameter group, each a list of ``(registration index,
    numel)`` in memory order. Each run is walked from its end (the parameters backward reaches first), and a bucket
    closes once it holds ``bucket_size`` elements or more (a larger parameter is a bucket alone); buckets never
    cross runs. Returns each bucket's registration indices in memory order, the buckets in launch order: the
    lowest registration index in the bucket, highest first (ties: memory order)."""
    buckets: list[list[int]] = []
    for run in runs:
        current: list[int] = []
        numel = 0
        for idx, n in reversed(run):
            current.append(idx)
            numel += n
            if numel >= bucket_size:
                buckets.append(current[::-1])
                current, numel = [], 0
        if current:
            buckets.append(current[::-1])
    return sorted(buckets, key=lambda b: -min(b))  # stable: ties keep memory order


class GradBuffer:
    """One gradient buffer per dtype over ``params`` (those that train), laid out by ``groups`` (the optimizer's
    parameter groups; parameters in none of them follow in registration order), with the bucketed,
    overlapped data-parallel reduction ``reduction`` (None: no reduction, e.g. one replica; the buffer still
    fixes the gradients' addresses)."""

    params: list[torch.nn.Parameter]  # in registration order (``module.parameters()``)
    buffers: dict[torch.dtype, torch.Tensor]
    buckets: list[Bucket]  # in launch order
    reduction: DpReduction | None

    def __init__(self, params: list[torch.nn.Parameter], groups: list[list[torch.nn.Parameter]],
                 reduction: DpReduction | None, bucket_size: int = DEFAULT_BUCKET_SIZE):
        self.params = [p for p in params if p.requires_grad and p.numel() > 0]  # what DeepSpeed reduces
        self.reduction, self.bucket_size = reduction, bucket_size
        index = {id(p): i for i, p in enumerate(self.params)}
        seen: set[int] = set()
        ordered: list[list[int]] = []
        for group in [*groups, self.params]:  # a parameter in no group: one more group
            run = [index[id(p)] for p in group if id(p) in index and id(p) not in seen]
            seen.update(id(self.params[i]) for i in run)
            ordered.append(run)
        # memory: per dtype (first seen first), the groups one after another
        dtypes = list(dict.fromkeys(p.dtype for p in self.params))
        runs: list[list[int]] = [[i for i in run if self.params[i].dtype == dt] for dt in dtypes for run in ordered]
        runs = [r for r in runs if r]
        self.offsets: list[int] = [0] * len(self.params)
        sizes = dict.fromkeys(dtypes, 0)
        for run in runs:
            dt = self.params[run[0]].dtype
            for i in run:
                self.offsets[i] = sizes[dt]
                sizes[dt] += self.params[i].numel()
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
        self.views = [self._view(i) for i in range(len(self.params))]
        with torch.no_grad():
            for p, v in zip(self.params, self.views):
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v
        self.buckets = []
        for b in assign_buckets([[(i, self.params[i].numel()) for i in run] for run in runs], bucket_size):
            first, last = self.params[b[0]], self.params[b[-1]]
            self.buckets.append(Bucket(first.dtype, self.offsets[b[0]], self.offsets[b[-1]] + last.numel(), tuple(b)))
        self._pending: list[tuple[torch.Tensor, torch.Tensor, object]] = []  # (span, what is reduced, its work)
        self._reset(armed=False)
        if reduction is not None:  # no reduction, no hooks
            for b, bucket in enumerate(self.buckets):
                for slot, i in enumerate(bucket.params):
                    self.params[i].register_post_accumulate_grad_hook(functools.partial(self._on_grad, b, slot))

    def _view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffers[p.dtype][self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def span_of(self, group: list[torch.Tensor]) -> torch.Tensor | None:
        """The 1-D slice of the buffer holding ``group``'s gradients in ``group``'s order, or None when they are not
        consecutive there."""
        index = {id(p): i for i, p in enumerate(self.params)}
        idx = [index.get(id(p)) for p in group]
        if not idx or None in idx or len({self.params[i].dtype for i in idx}) != 1:
            return None
        start = end = self.offsets[idx[0]]
        for i in idx:
            if self.offsets[i] != end:
                return None
            end += self.params[i].numel()
        return self.buffers[self.params[idx[0]].dtype][start:end]

    # ------------------------------------------------------------------------------------------------
    def zero(self) -> None:
        """After the optimizer step: every gradient zero, and every ``.grad`` the buffer's view again (DeepSpeed's
        own step, where it runs, sets them to None)."""
        for buf in self.buffers.values():
            buf.zero_()
        for p, v in zip(self.params, self.views):
            if p.grad is not v:
                p.grad = v

    def begin(self, reduce: bool) -> None:
        """Before a micro-batch's backward: the views in place (a gradient set to None meanwhile is zero, one
        replaced is copied in), and the reduction armed when ``reduce`` (the step's last micro-batch)."""
        if self._pending:  # a backward that failed after launching: finish its collectives, drop the result
            for _, _, work in self._pending:
                work.wait()
            self._pending.clear()
        with torch.no_grad():
            for p, v in zip(self.params, self.views):
                g = p.grad
                if g is v:
                    continue
                if g is None:
                    v.zero_()
                else:
                    v.copy_(g)
                p.grad = v
        self._reset(armed=reduce and self.reduction is not None)

    def finish(self) -> None:
        """End of the last micro-batch's backward: launch the buckets not launched yet (in order), wait for all,
        and finish DeepSpeed's arithmetic (the post-division, the copy back from the communication dtype)."""
        if self.reduction is None:
            return
        self._launch_ready(until=len(self.buckets))
        in_place = set(self.buffers)  # dtypes reduced in their own dtype: post-divided as one tensor, not per bucket
        for span, t, work in self._pending:
            work.wait()
            if t is not span:  # reduced in the communication dtype: divided there, then back into the buffer
                in_place.discard(span.dtype)
                self.reduction.after(t)
                span.copy_(t)
        for dt in in_place:  # the buckets cover the buffer: elementwise the same multiplication
            self.reduction.after(self.buffers[dt])
        self._pending.clear()
        self._reset(armed=False)

    # ------------------------------------------------------------------------------------------------
    def _reset(self, armed: bool) -> None:
        self._armed = armed
        self._seen = [bytearray(len(b.params)) for b in self.buckets]
        self._count = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch, in launch order

    def _on_grad(self, b: int, slot: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count the parameter into bucket ``b``; launch what is complete, in order."""
        if not self._armed:
            return
        if b < self._next:
            raise RuntimeError(f"a gradient of bucket {b} accumulated after its all-reduce started (a parameter "
                               f"used in two separate backward passes of one micro-batch)")
        if self._seen[b][slot]:
            return
        if param.grad is not self.views[self.buckets[b].params[slot]]:  # e.g. a create_graph backward
            raise RuntimeError("a gradient was accumulated out of place (not into the buffer's view): its bucket "
                               "would reduce stale values")
        self._seen[b][slot] = 1
        self._count[b] += 1
        self._launch_ready(until=self._next)

    def _launch_ready(self, until: int) -> None:
        """Launch bucket ``_next`` and its successors while they are complete (or below ``until``)."""
        red = self.reduction
        while self._next < len(self.buckets):
            b = self._next
            bucket = self.buckets[b]
            if b >= until and self._count[b] < len(bucket.params):
                return
            span = self.buffers[bucket.dtype][bucket.start:bucket.end]
            t = span if red.comm_dtype == span.dtype else span.to(red.comm_dtype)
            red.before(t)
            self._pending.append((span, t, dist.all_reduce(t, group=red.group, async_op=True)))
            self._next += 1
