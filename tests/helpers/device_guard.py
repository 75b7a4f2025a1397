"""Emulated CUDA placement on a CPU-only torch, and a guard around every collective.

Why: on CPU with gloo every tensor lives on one device, so a host tensor handed to a collective or
mixed with the model's tensors goes unnoticed, while on a GPU (NCCL, CUDA kernels) it is an error.
Here the real numbers stay on the CPU, but each tensor carries the device the code *asked* for:

* :class:`EmulatedCuda` (a ``TorchFunctionMode``) turns ``device="cuda:N"`` in any torch call,
  ``.to("cuda:N")`` and ``.cuda()`` into CPU work and tags the result's storage with ``cuda:N``; tags
  follow every op, view, ``.data`` assignment and ``.grad``; ``tensor.device`` reports the tag. An op
  that mixes a tagged tensor with an untagged (host) one raises as CUDA would ("Expected all tensors
  to be on the same device"), host 0-dim tensors excepted where CUDA allows them (out-of-place).
  Inside autograd's backward pass, gradients are made by C++ and carry no tag; there the checks are
  off and tags only propagate (backward placement follows the forward's by construction).
* :func:`patched_accelerator` makes DeepSpeed's (CPU) accelerator report ``cuda``, so the engine and
  :func:`training.runtime.device.local_device` place the model on ``cuda:LOCAL_RANK`` -- emulated.
* :class:`CollectiveGuard` wraps ``torch.distributed`` and ``deepspeed.comm`` collectives and checks
  that every tensor operand is on the device the code claims is the engine's
  (:func:`training.runtime.device.local_device`), recording each violation with its caller (the run goes on, so
  one run lists them all); it counts what it checked so a test can show it ran.
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_TAG = "_emulated_device"


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (e.g. sparse): never tagged
        return None


def device_of(t: torch.Tensor) -> torch.device:
    """The emulated device of ``t``: its storage's tag, else its real device."""
    s = _storage(t)
    tag = getattr(s, _TAG, None) if s is not None else None
    return torch.device(tag) if tag is not None else t.device


def _tag(t: torch.Tensor, device: torch.device | None) -> None:
    s = _storage(t)
    if s is None:
        return
    if device is None or device.type == "cpu":
        if hasattr(s, _TAG):
            delattr(s, _TAG)
    else:
        setattr(s, _TAG, str(device))


def _cuda_device(d, default_index: int) -> torch.device | None:
    """``d`` as a CUDA device with an index, or None when it is not a CUDA device."""
    if d is None:
        return None
    d = torch.device(d) if not isinstance(d, torch.device) else d
    if d.type != "cuda":
        return None
    return torch.device("cuda", default_index if d.index is None else d.index)


_INPLACE_DUNDER = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                           "xor", "lshift", "rshift", "matmul")}


# metadata queries that take tensors on different devices by design
_NO_CHECK = {"_has_compatible_shallow_copy_type", "is_same_size", "is_set_to", "_is_zerotensor"}


class DeviceMismatch(RuntimeError):
    pass


class EmulatedCuda(TorchFunctionMode):
    """See the module docstring. ``index`` is the device index of a bare ``"cuda"``."""

    def __init__(self, index: int = 0):
        super().__init__()
        self.index = index
        self.ops = 0

    # -- helpers ------------------------------------------------------------------------------------
    def _rewrite_device(self, kwargs: dict) -> tuple[dict, torch.device | None, bool]:
        """kwargs with a CUDA ``device=`` made CPU; (kwargs, target device, whether device= was given)."""
        if "device" not in kwargs or kwargs["device"] is None:
            return kwargs, None, False
        cuda = _cuda_device(kwargs["device"], self.index)
        if cuda is None:
            return kwargs, torch.device(kwargs["device"]) if not isinstance(kwargs["device"], torch.device) \
                else kwargs["device"], True
        return {**kwargs, "device": "cpu"}, cuda, True

    def _to(self, func, args, kwargs):
        """``Tensor.to`` / ``.cuda`` / ``.cpu``: CPU work; a device change makes a tagged/untagged copy."""
        src = args[0]
        name = func.__name__
        if name == "cuda":
            want = args[1] if args[1:] else kwargs.get("device")
            target = _cuda_device("cuda" if want is None else (f"cuda:{want}" if isinstance(want, int) else want),
                                  self.index)
            rest_kwargs = {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
            out = src.to("cpu", **rest_kwargs)
        elif name == "cpu":
            target = torch.device("cpu")
            out = src.cpu()
        else:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is None:  # dtype/format only: stays where it is
                return func(*args, **kwargs)
            target = _cuda_device(device, self.index) or torch.device("cpu")
            call_kwargs = {"device": "cpu", "non_blocking": non_blocking}
            if dtype is not None:
                call_kwargs["dtype"] = dtype
            if memory_format is not None:
                call_kwargs["memory_format"] = memory_format
            out = src.to(**call_kwargs, copy=bool(kwargs.get("copy", False)))
        if device_of(src) == target:
            return out
        if out is src or _storage(out) is _storage(src):
            out = out.clone()  # a real device change copies; keep the host original untagged
        _tag(out, target)
        return out

    # -- the mode -----------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: C901
        kwargs = dict(kwargs or {})
        self.ops += 1
        if func == torch.Tensor.device.__get__:
            return device_of(args[0])
        if func == torch.Tensor.is_cuda.__get__:
            return device_of(args[0]).type == "cuda"
        if func == torch.Tensor.is_cpu.__get__:
            return device_of(args[0]).type == "cpu"
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._to(func, args, kwargs)
        if func == torch.Tensor.grad.__get__:
            g = func(*args, **kwargs)
            if g is not None and device_of(args[0]).type == "cuda":
                _tag(g, device_of(args[0]))  # autograd allocates a gradient where its parameter lives
            return g
        if func == torch.Tensor.numpy and device_of(args[0]).type == "cuda":
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first. (emulated CUDA)")
        kwargs, target, explicit = self._rewrite_device(kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        in_backward = torch._C._current_autograd_node() is not None
        name = getattr(func, "__name__", "")
        if not in_backward and not explicit:
            self._check(func, name, args, tensors)
        out = func(*args, **kwargs)
        if explicit:
            dev = target
        else:
            devs = [device_of(t) for t in tensors]
            cuda = [d for d in devs if d.type == "cuda"]
            dev = cuda[0] if cuda else None
        if dev is not None and dev.type == "cuda":
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    _tag(t, dev)
        return out

    def _check(self, func, name: str, args, tensors: list[torch.Tensor]) -> None:
        if func in (torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
                    torch.Tensor.data.__set__, torch.Tensor.grad.__set__, torch.Tensor.__repr__,
                    torch.Tensor.__format__) or name in _NO_CHECK or len(tensors) < 2:
            return
        inplace = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDER
        if inplace and args and isinstance(args[0], torch.Tensor):
            out = device_of(args[0])
            for t in tensors[1:]:
                d = device_of(t)
                if d != out and not (d.type == "cpu" and t.dim() == 0 and out.type == "cuda"):
                    raise DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two "
                                         f"devices, {out} and {d}! (emulated CUDA: in-place {name})")
            return
        devs = {device_of(t) for t in tensors if not (device_of(t).type == "cpu" and t.dim() == 0)}
        if len(devs) > 1:
            a, b = sorted(map(str, devs))[:2]
            raise DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two devices, "
                                 f"{a} and {b}! (emulated CUDA: {name or func})")


@contextlib.contextmanager
def patched_accelerator(index: int):
    """DeepSpeed's accelerator reports ``cuda``/``cuda:index`` (its CPU implementation does the work)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    saved = {k: acc.__dict__.get(k) for k in ("device_name", "current_device_name", "current_device", "set_device")}
    acc.device_name = lambda device_index=None: "cuda" if device_index is None else f"cuda:{device_index}"
    acc.current_device_name = lambda: f"cuda:{index}"
    acc.current_device = lambda: index
    acc.set_device = lambda device_index: None
    try:
        yield acc
    finally:
        for k, v in saved.items():
            if v is None:
                acc.__dict__.pop(k, None)
            else:
                setattr(acc, k, v)


_TORCH_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                      "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter")
_TORCH_P2P = ("send", "recv", "isend", "irecv")  # the pipeline schedules' own point-to-point


def _caller() -> str:
    """The project frame (training/, evaluation/, scripts/) that called the collective."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):
        if any(f"/{d}/" in frame.filename for d in ("training", "evaluation", "scripts")):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "outside the project"


class CollectiveGuard:
    """Checks every tensor operand of a collective is on ``expected()`` (the code's engine device);
    ``violations`` lists those that are not (a test asserts it is empty)."""

    def __init__(self, expected):
        self.expected = expected
        self.seen: Counter[str] = Counter()
        self.violations: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_guarded", False):
            return

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            if torch._C._current_autograd_node() is None:  # see the module docstring (backward pass)
                want = torch.device(self.expected())
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        got = device_of(t)
                        if got != want:  # NCCL would reject it; recorded so one run lists them all
                            self.violations.append(f"{label}: operand {tuple(t.shape)} {t.dtype} on {got}, "
                                                   f"engine device {want}, from {_caller()}")
                self.seen[label] += 1
            return original(*args, **kwargs)

        guarded._guarded = True  # type: ignore[attr-defined]
        self._saved.append((owner, name, original))
        setattr(owner, name, guarded)

    def __enter__(self):
        import deepspeed.comm as ds_comm
        import torch.distributed as dist

        for n in _TORCH_COLLECTIVES + _TORCH_P2P:
            self._wrap(dist, n, f"torch.distributed.{n}")
        for n in _TORCH_COLLECTIVES + ("inference_all_reduce",):
            self._wrap(ds_comm, n, f"deepspeed.comm.{n}")
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        return False


@contextlib.contextmanager
def emulated_cuda_run(index: int):
    """Accelerator reporting ``cuda:index``, emulated placement, and the collective guard, together."""
    from training.runtime.device import local_device

    with patched_accelerator(index), CollectiveGuard(local_device) as guard, EmulatedCuda(index) as mode:
        yield guard, mode
