"""What a training step asks of the host: dispatched operators and device-to-host reads, counted on any device.

On a GPU every non-view operator is (at least) one kernel launch and every read of a device value
(``.item()``, ``if tensor:``, ``.tolist()``) stalls the host until the GPU has drained, so these counts, made on
CPU, are the launches and syncs the same step costs on CUDA.

* operators: every ATen operator call that reaches the dispatcher below autograd, seen by a
  ``TorchDispatchMode``; ``kernels`` leaves out view and alias operators (metadata only, no launch);
* syncs: ``aten._local_scalar_dense`` (what ``.item()``, ``float(t)``, ``bool(t)`` and ``if t:`` call) plus each
  ``Tensor.tolist()`` / ``Tensor.numpy()`` (which read device memory without an operator on CPU).

    with HostWork() as w:
        trainer.train_step()
    w.kernels, w.syncs, w.top(10)
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense.default"}


class HostWork(TorchDispatchMode):
    """Counts operators, kernel operators and host reads inside the ``with`` block (this thread and the autograd
    threads it drives)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0
        self.reads = 0
        self._patched: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] += 1
        if getattr(func, "is_view", False) or name.startswith(("aten.detach", "aten.alias", "aten.lift_fresh")):
            self.views += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def counted(t, *a, _original=original, **k):
                self.reads += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        """Operators that do work on the device (launches on CUDA): all but views and host reads."""
        return self.total - self.views - self.scalar_reads

    @property
    def scalar_reads(self) -> int:
        return sum(self.ops[n] for n in SYNC_OPS)

    @property
    def syncs(self) -> int:
        """Device-to-host reads: each one a full stall on CUDA."""
        return self.scalar_reads + self.reads

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        return self.ops.most_common(n)
