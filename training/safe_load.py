"""Load checkpoint files without running code from them.

``torch.load(..., weights_only=False)`` unpickles arbitrary objects: a file whose pickle stream calls
``os.system`` (or ``open``, ...) runs that call when it is loaded. Every checkpoint this project reads
goes through :func:`load` instead: ``weights_only=True`` (tensors, containers, numbers, strings), plus
the few plain-data types checkpoints contain: numpy arrays (the numpy RNG state of checkpoints written
before it was stored as a list, see ``training.checkpoint``) and DeepSpeed's ZeRO stage enum, flat-buffer
fragment addresses and fp16 loss scalers (ZeRO optimizer files).

DeepSpeed's ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)`` for every file
of ``engine.load_checkpoint`` (model states, ZeRO partitions, pipeline layer files); :func:`install`
replaces that method with :func:`load`, so resuming a run is as safe as evaluating one. A file that
needs anything else is refused with one line naming the file and the type it asked for.
"""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from megatron_ds_suite.core.errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint file that cannot be loaded safely or at all (one line: which file, why, what to do)."""

    label = "checkpoint error"


class CheckpointMissing(CheckpointError, FileNotFoundError):
    """A run directory, ``checkpoints/latest``, tag folder or model shard that is not there. Also a
    FileNotFoundError, so callers that put a missing file into their own line (``train.init_from=...: ...``)
    keep doing so; everywhere else it is one ``checkpoint error:`` line."""


def _numpy_array_types() -> list:
    """What a pickled numpy array needs (checkpoints written before the RNG state was stored as a list
    hold numpy's uint32 key array): reconstruct-an-empty-array, the array and dtype classes. torch
    documents these as safe to allow; an object array's elements still go through the restricted
    unpickler."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _deepspeed_safe_types() -> list:
    """Plain-data DeepSpeed classes found in its checkpoints (no custom ``__reduce__``/``__setstate__``)."""
    types = _numpy_array_types()
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        types += [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]
    except ImportError:  # reading checkpoints without DeepSpeed installed (evaluation-only environments)
        pass
    return types


# torch's wording for a global off the allow-list, for one in a blocked module (os, posix, subprocess, ...: "Trying
# to load unsupported GLOBAL posix.system whose module posix is blocked"), and for other refused opcodes
_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)|unsupported GLOBAL (\S+) whose module|Unsupported operand \S+"
                     r"|Trying to call reduce for \S+")


def load(path: str | Path, map_location="cpu"):
    """``torch.load`` with ``weights_only=True``; a file that needs more is refused (CheckpointError)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_types()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        m = _GLOBAL.search(str(e))
        what = (m.group(1) or m.group(2) or m.group(0)) if m else str(e).splitlines()[0][:120]
        raise CheckpointError(f"refused to load {path}: it asks to run {what}, which a checkpoint of this project "
                              f"never needs (only tensors and plain data are loaded); do not use files from an "
                              f"untrusted source") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; resume from "
                              f"an earlier tag or retrain") from None
    except (RuntimeError, EOFError, OSError) as e:
        size = path.stat().st_size if path.is_file() else 0
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]  # EOFError of a 0-byte file says nothing
        what = "empty: 0 bytes" if size == 0 else f"truncated or not a torch checkpoint: {why}"
        raise CheckpointError(f"cannot read checkpoint file {path} ({what}); resume from an earlier tag") from None


def install() -> None:
    """Route DeepSpeed's checkpoint reads (``TorchCheckpointEngine.load``) through :func:`load` (idempotent)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if getattr(TorchCheckpointEngine.load, "_weights_only", False):
        return

    def safe_engine_load(self, path: str, map_location=None):
        # DeepSpeed passes map_location=lambda storage, loc: storage (keep on CPU) or a torch.device
        return load(path, map_location=map_location if map_location is not None else "cpu")

    safe_engine_load._weights_only = True
    TorchCheckpointEngine.load = safe_engine_load
