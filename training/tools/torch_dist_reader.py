"""Read Megatron-LM's ``torch_dist`` checkpoints (``--ckpt-format torch_dist``, its default since 2024) without
Megatron and without running code from them.

A ``torch_dist`` iteration folder holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``),
``common.pt`` (what is not sharded: ``args``, ``iteration``, ``checkpoint_version``, ...), and PyTorch Distributed
Checkpoint files (``.metadata`` and ``__R_I.distcp``). Megatron-Core saves every tensor whole (its *global*
shape), whatever the TP x PP x VP that wrote it: a layer's tensors are stacked over the model's layers
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[L, ...]``), QKV rows per key/value group and SwiGLU's
first linear ``[gate; up]`` as at TP=1, the vocabulary padded for the writer's TP, and the pre-attention and
pre-MLP norms under Transformer Engine's names (``linear_qkv.layer_norm_weight``) for every layer spec. So
:func:`read_torch_dist` gives what a TP=1 x PP=1 ``torch``-format file would hold (layers
``decoder.layers.i.*``), for :mod:`training.tools.megatron_names` to rename.

Safety: ``common.pt`` goes through :func:`training.safe_load.load` with the Megatron allow-list, as rank files do;
the tensor data through PyTorch's ``weights_only`` loader; the ``.metadata`` pickle (PyTorch's own format) through
:class:`MetadataUnpickler`, which builds only the checkpoint metadata classes PyTorch writes there. Optimizer
state, RNG states and Transformer Engine's extra state are not read.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from training import safe_load
from training.tools.megatron_reader import (
    ImportMegatronError,
    allowed_globals,
    check_args,
    checkpoint_version,
    megatron_arg,
)
from training.tools.untrusted_tree import leaves

MODEL_ROOTS = ("embedding", "decoder", "encoder", "output_layer", "pooler", "lm_head", "binary_head")
"""The first name component of a Megatron-Core model tensor (optimizer state is ``optimizer.*``, RNG states
``rng_state``)."""
STACKED = re.compile(r"(decoder|encoder)\.layers\.(.+)")
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # the writer's checkpoint_id (PyTorch's FileSystemWriter stores it)
}
"""What PyTorch's ``.metadata`` pickle may ask for (plus torch's dtypes); anything else is refused."""


def is_torch_dist(folder: Path) -> bool:
    return (folder / "metadata.json").is_file() or any(folder.glob("*.distcp"))


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` file building only :data:`METADATA_CLASSES` and torch dtypes."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                          torch.dtype)):
            return super().find_class(module, name)
        raise ImportMegatronError(f"refused to load {self.path}: it asks to run {module}.{name}, which a PyTorch "
                                  f"distributed checkpoint's metadata does not hold")


class SafeReader(FileSystemReader):
    """PyTorch's file-system checkpoint reader with :class:`MetadataUnpickler` for the ``.metadata`` pickle."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        if not path.is_file():
            raise ImportMegatronError(f"{path.parent} lacks .metadata: an incomplete torch_dist checkpoint")
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise ImportMegatronError(f"{path} holds a {type(metadata).__name__}, not PyTorch checkpoint metadata")
        return metadata


def read_common(folder: Path) -> tuple[argparse.Namespace | None, float]:
    """(args, checkpoint_version) from ``common.pt`` and ``metadata.json``, each refusal one line."""
    marker = folder / "metadata.json"
    try:
        backend = json.loads(marker.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise ImportMegatronError(f"{marker} is not Megatron's dist-checkpoint marker ({e.__class__.__name__})") from e
    if backend != "torch_dist":
        raise ImportMegatronError(f"{folder} is a {backend!r} distributed checkpoint; this import reads torch_dist "
                                  f"(and torch): re-save it from Megatron-LM with --ckpt-format torch_dist")
    path = folder / "common.pt"
    if not path.is_file():
        raise ImportMegatronError(f"{folder} lacks common.pt (Megatron's args and iteration): an incomplete checkpoint")
    with torch.serialization.safe_globals(allowed_globals()):
        state = safe_load.load(path)
    if not isinstance(state, dict):
        raise ImportMegatronError(f"{path} holds a {type(state).__name__}, not Megatron's common state dict")
    leaves(state, str(path))  # bounded: too deep, too many entries or a cycle is one line
    args = state.get("args") if isinstance(state.get("args"), argparse.Namespace) else None
    check_args(args, path)
    return args, checkpoint_version(state, path)


def unstack(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A global tensor -> the per-layer tensors of a TP=1 file (``decoder.layers.X`` [L, ...] ->
    ``decoder.layers.i.X``); a tensor outside the layers as it is."""
    m = STACKED.fullmatch(name)
    if m is None:
        return {name: tensor}
    return {f"{m.group(1)}.layers.{i}.{m.group(2)}": t.clone() for i, t in enumerate(tensor.unbind(0))}


def read_model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint at its global shape, layers unstacked (:func:`unstack`)."""
    reader = SafeReader(str(folder))
    metadata = reader.read_metadata()
    want = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and key.split(".", 1)[0] in MODEL_ROOTS:
            want[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not want:
        raise ImportMegatronError(f"{folder} holds no model tensors ({', '.join(MODEL_ROOTS)}): not a Megatron-Core "
                                  f"model checkpoint")
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(want, storage_reader=reader, no_dist=True)
    except (CheckpointException, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        first = " ".join(str(e).split())[:160]
        raise ImportMegatronError(f"{folder}: its tensors do not read ({type(e).__name__}: {first}): a damaged or "
                                  f"incomplete torch_dist checkpoint; copy the whole folder again") from None
    out: dict[str, torch.Tensor] = {}
    for key, tensor in want.items():
        out.update(unstack(key, tensor))
    return out


def read_torch_dist(folder: Path) -> tuple[dict[str, torch.Tensor], argparse.Namespace | None, float, tuple[int, int]]:
    """(Megatron-Core tensors as one TP=1 x PP=1 file names them, args, checkpoint_version, (source TP, PP) from the
    args)."""
    args, version = read_common(folder)
    if args is None:
        raise ImportMegatronError(f"{folder}/common.pt has no args: not a checkpoint Megatron-LM saved")
    tp = int(megatron_arg(args, "tensor_model_parallel_size", 1))
    pp = int(megatron_arg(args, "pipeline_model_parallel_size", 1))
    return read_model_tensors(folder), args, version, (tp, pp)
