"""Write Megatron-LM's ``torch_dist`` format (``--ckpt-format torch_dist``) from whole Megatron-Core tensors.

What :mod:`training.tools.torch_dist_reader` reads, in the other direction: the tensors of one TP=1 x PP=1
Megatron-Core state dict (``decoder.layers.i.*``) are stacked over the layers into Megatron-Core's sharded keys
(``decoder.layers.self_attention.linear_qkv.weight`` ``[L, ...]``), the pre-attention and pre-MLP norms under the
names its layer specs map them to (``self_attention.linear_qkv.layer_norm_*``, ``mlp.linear_fc1.layer_norm_*``),
the tied output copy left out (Megatron-Core stores the embedding once), every linear module's (empty)
``_extra_state`` object added (its loader requires them), and saved with PyTorch Distributed
Checkpoint in one process: ``.metadata`` and one ``.distcp`` file. ``common.pt`` holds ``args``, ``iteration`` and
``checkpoint_version``; ``metadata.json`` names the backend. Megatron-Core loads it at any TP x PP (every
tensor is global), with the vocabulary padded for the TP the args name.
"""
from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

LAYER = re.compile(r"(decoder|encoder)\.layers\.(\d+)\.(.+)")
NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""Megatron-Core's ``sharded_state_dict_keys_map`` of its GPT and BERT layer specs (local and Transformer Engine)."""
LINEARS = re.compile(r"((?:decoder|encoder)\.layers\.(?:self_attention\.linear_(?:qkv|proj)|mlp\.linear_fc[12]))\.weight")
"""A layer's linear modules, whose ``_extra_state`` (Transformer Engine's FP8 metadata; None for the local spec)
Megatron-Core saves and loads as one object per layer."""
MARKER = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}


def sharded_key(body: str) -> str:
    for local, shared in NORM_KEYS.items():
        if body.startswith(local):
            return shared + body[len(local):]
    return body


def stack_layers(flat: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Per-layer tensors -> Megatron-Core's sharded keys, each ``[num_layers, ...]``; the rest as it is."""
    per_key: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in flat.items():
        m = LAYER.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            per_key.setdefault(f"{m.group(1)}.layers.{sharded_key(m.group(3))}", {})[int(m.group(2))] = t
    for key, layers in per_key.items():
        if sorted(layers) != list(range(num_layers)):
            raise ValueError(f"{key}: layers {sorted(layers)} of {num_layers}")  # a bug here, not a user's input
        out[key] = torch.stack([layers[i] for i in range(num_layers)]).contiguous()
    return out


def extra_states(keys: list[str], num_layers: int) -> dict[str, list]:
    """The ``_extra_state`` objects Megatron-Core's loader asks for, one per linear module and layer
    (``.../linear_proj._extra_state/shard_{i}_{L}``), each what it saves for a module without extra state: the list
    ``[None]``, which PyTorch's planner serialises as Megatron-Core's does (``torch.save`` into the ``.distcp``)."""
    out: dict[str, list] = {}
    for key in keys:
        m = LINEARS.fullmatch(key)
        for i in range(num_layers if m else 0):
            out[f"{m.group(1)}._extra_state/shard_{i}_{num_layers}"] = [None]
    if any(k.startswith("lm_head.") for k in keys):  # BertModel keeps its output layer's (GPTModel drops it)
        out["output_layer._extra_state/shard_0_1"] = [None]
    return out


def write_torch_dist(folder: Path, flat: dict[str, torch.Tensor], num_layers: int, tied: bool,
                     args: argparse.Namespace, iteration: int) -> None:
    """Megatron-Core's TP=1 state dict ``flat`` as a ``torch_dist`` iteration folder ``folder`` (created)."""
    folder.mkdir(parents=True)
    tensors = stack_layers({k: v for k, v in flat.items() if not (tied and k == "output_layer.weight")}, num_layers)
    tensors.update(extra_states(list(tensors), num_layers))
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0}, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps(MARKER))
