"""Megatron-LM's tensors in our names, merged over its TP and PP ranks, for :mod:`training.tools.import_megatron`:
the name map (:func:`rename`), how TP splits each tensor (:data:`SPLIT_DIM`), the QKV row orders
(:func:`qkv_to_ours`), the agreement of the TP ranks of one stage (:func:`check_shards`) and the merge of all rank
files into TP=1 weights (:func:`read_weights`).

Names (``language_model.embedding`` / ``.encoder``, called ``.transformer`` before 2021; attention
``self_attention`` or ``attention``; norms ``*_layernorm`` or ``*_norm``):

    embedding.word_embeddings.weight [V_pad/t, h] per rank  -> embedding.word_embeddings.weight (rows, re-padded)
    embedding.position_embeddings / tokentype_embeddings    -> the same names
    layers.i.input_layernorm / post_attention_layernorm     -> layers.i.ln1 / ln2
    layers.i.*attention.query_key_value [3h/t, h]           -> layers.i.attn.qkv (rows [Q; K; V], see below)
    layers.i.*attention.dense [h, h/t]                      -> layers.i.attn.proj (input columns)
    layers.i.mlp.dense_h_to_4h [f/t, h] / dense_4h_to_h     -> layers.i.mlp.fc (rows) / mlp.proj (columns)
    final_layernorm                                         -> final_ln
    BERT: lm_head.dense / lm_head.layernorm / lm_head.bias [V_pad/t] -> lm_head.dense / lm_head.ln / lm_head.bias;
          language_model.pooler.dense -> pooler; binary_head -> binary_head

Layer i of pipeline stage s is global layer (layers of stages < s) + i. The tied output copy
``word_embeddings_for_head`` of the last stage is not read (it equals the embedding).

QKV row order within one TP rank's shard (np heads on that rank, hn head size), by the file's
``checkpoint_version`` (Megatron's ``fix_query_key_value_ordering`` reads the old orders the same way):

    absent (0)  [3, np, hn]   all queries, then all keys, then all values
    1.0         [np, hn, 3]   q, k, v interleaved row by row
    2.0, 3.0    [np, 3, hn]   per head its q rows, k rows, v rows
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from training.tools.megatron_reader import (
    ImportMegatronError,
    check_rank_files,
    check_same_checkpoint,
    load_file,
    megatron_arg,
)
from training.tools.tensor_check import few

# A layer's own names -> ours; Megatron renamed attention -> self_attention (2021) and *layernorm -> *norm (2023)
LAYER_NAMES = {
    r"input_(?:layer)?norm": "ln1",
    r"post_attention_(?:layer)?norm": "ln2",
    r"(?:self_)?attention\.query_key_value": "attn.qkv",
    r"(?:self_)?attention\.dense": "attn.proj",
    r"mlp\.dense_h_to_4h": "mlp.fc",
    r"mlp\.dense_4h_to_h": "mlp.proj",
}
# how TP splits each of our tensors in Megatron's files: dim of the split (None: replicated)
SPLIT_DIM = {"attn.qkv": 0, "attn.proj.weight": 1, "mlp.fc": 0, "mlp.proj.weight": 1,
             "embedding.word_embeddings.weight": 0, "lm_head.bias": 0}


def rename(name: str, layer_offset: int) -> str | None:
    """A flattened Megatron name -> ours (layer index shifted by the stage's offset); None = not a weight we
    import (the tied head copy); raises on a name the layout does not have."""
    m = re.fullmatch(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m:
        for pattern, ours in LAYER_NAMES.items():
            if re.fullmatch(pattern, m.group(2)):
                return f"layers.{int(m.group(1)) + layer_offset}.{ours}.{m.group(3)}"
        raise ImportMegatronError(f"unknown layer tensor {name!r}: not Megatron-LM's legacy GPT/BERT layout "
                                  f"(a Transformer Engine or Megatron-Core checkpoint?)")
    fixed = {
        "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
        "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
        "language_model.embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
        "language_model.pooler.dense.weight": "pooler.weight", "language_model.pooler.dense.bias": "pooler.bias",
        "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
        "lm_head.bias": "lm_head.bias", "binary_head.weight": "binary_head.weight",
        "binary_head.bias": "binary_head.bias",
    }
    m = re.fullmatch(r"language_model\.(?:encoder|transformer)\.final_(?:layer)?norm\.(weight|bias)", name)
    if m:
        return f"final_ln.{m.group(1)}"
    m = re.fullmatch(r"lm_head\.(?:layer)?norm\.(weight|bias)", name)
    if m:
        return f"lm_head.ln.{m.group(1)}"
    if name in fixed:
        return fixed[name]
    if name.startswith("word_embeddings_for_head."):
        return None
    if name.startswith("language_model.output_layer."):
        raise ImportMegatronError("the checkpoint has an untied output layer (--untie-embeddings-and-output-weights); "
                                  "only GPT-2/BERT with the output tied to the word embedding import")
    raise ImportMegatronError(f"unknown tensor {name!r}: not Megatron-LM's legacy GPT/BERT layout")


def split_dim(name: str) -> int | None:
    body = re.sub(r"^layers\.\d+\.", "", name)
    for key, dim in SPLIT_DIM.items():
        if body == key or body.startswith(key + "."):
            return dim
    return None


def qkv_to_ours(shard: torch.Tensor, heads: int, version: float) -> torch.Tensor:
    """One TP rank's ``query_key_value`` weight [3 np hn, h] or bias [3 np hn] -> [3, np hn, ...] (its
    queries, keys, values) from the row order of ``checkpoint_version`` (module docstring)."""
    rest = shard.shape[1:]
    if shard.dim() == 0 or shard.size(0) % (3 * heads):
        raise ImportMegatronError(f"a query_key_value shard of shape {list(shard.shape)} does not split into q, k and v "
                                  f"of {heads} heads per TP rank: args or tensors damaged")
    hn = shard.size(0) // (3 * heads)
    if version == 0:
        t = shard.view(3, heads, hn, *rest)
    elif version == 1.0:
        t = shard.view(heads, hn, 3, *rest).movedim(2, 0)
    else:
        t = shard.view(heads, 3, hn, *rest).movedim(1, 0)
    return t.reshape(3, heads * hn, *rest)


def merge_ranks(per_rank: list[dict[str, torch.Tensor]], heads_per_rank: int, version: float
                ) -> dict[str, torch.Tensor]:
    """TP shards of one pipeline stage (our names) -> full tensors; QKV -> rows [Q; K; V]."""
    out = {}
    for name in per_rank[0]:
        parts = [sd[name].detach().to(torch.float32).cpu() for sd in per_rank]
        if ".attn.qkv." in name:
            qkv = [qkv_to_ours(p, heads_per_rank, version) for p in parts]     # each [3, np hn, ...]
            out[name] = torch.cat([torch.cat([t[k] for t in qkv]) for k in range(3)]).contiguous()
            continue
        dim = split_dim(name)
        if dim is None:
            out[name] = parts[0].contiguous()
        else:
            out[name] = torch.cat(parts, dim=dim).contiguous()
    return out


def check_shards(per_rank: list[dict[str, torch.Tensor]], paths: list[Path]) -> None:
    """The TP ranks of one stage must hold the same tensors (our names) of the same shapes, and the same values
    where Megatron replicates a tensor on every TP rank (LayerNorms, the row-parallel biases, position
    embeddings, ...); else one line naming the tensors and files."""
    fix = "rank files of different checkpoints are mixed in one folder; copy one checkpoint's whole folder"
    for i, sd in enumerate(per_rank[1:], 1):
        if set(sd) != set(per_rank[0]):
            diff = sorted(set(sd) ^ set(per_rank[0]))
            raise ImportMegatronError(f"{paths[i]} holds other tensors than {paths[0]} ({few(diff)}): {fix}")
        shapes = [f"{n} {list(sd[n].shape)} vs {list(per_rank[0][n].shape)}" for n in sd
                  if sd[n].shape != per_rank[0][n].shape]
        if shapes:
            raise ImportMegatronError(f"{paths[i]} holds {len(shapes)} tensor(s) of other shapes than {paths[0]} "
                                      f"({few(shapes)}): {fix}")
        differ = [n for n in sd if split_dim(n) is None and ".attn.qkv." not in n
                  and not torch.equal(sd[n].float(), per_rank[0][n].float())]
        if differ:
            raise ImportMegatronError(f"{len(differ)} tensor(s) every TP rank holds a copy of differ between {paths[0]} "
                                      f"and {paths[i]} ({few(differ)}): {fix}")


def read_weights(files: dict[tuple[int, int], Path], heads: int | None
                 ) -> tuple[dict[str, torch.Tensor], argparse.Namespace | None, float, tuple[int, int]]:
    """All files -> (TP=1 weights in our names, Megatron's args or None, checkpoint_version, (source TP, PP)).
    The first file's args say how many rank files there must be (:func:`check_rank_files`), every other file must
    be of the same checkpoint (:func:`check_same_checkpoint`) and agree with its stage's other ranks
    (:func:`check_shards`), all before any tensor is merged."""
    first = load_file(files[min(files)])
    check_rank_files(first.args, files)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    args, version = first.args, first.version
    heads = heads or megatron_arg(args, "num_attention_heads")
    if heads is None:
        raise ImportMegatronError("the checkpoint has no args (an early release): pass --num-attention-heads")
    if heads % tp:
        raise ImportMegatronError(f"{heads} attention heads do not split over the source's {tp} TP ranks")
    weights: dict[str, torch.Tensor] = {}
    offset = 0
    for stage in range(pp):
        per_rank, paths, layers = [], [], set()
        for rank in range(tp):
            rf = first if (rank, stage) == min(files) else load_file(files[(rank, stage)])
            check_same_checkpoint(first, rf)
            layers = {int(m.group(1)) for m in (re.match(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.", k)
                                                for k in rf.model) if m}
            renamed = {}
            for name, t in rf.model.items():
                ours = rename(name, offset)
                if ours is not None:
                    renamed[ours] = t
            per_rank.append(renamed)
            paths.append(rf.path)
        check_shards(per_rank, paths)
        weights.update(merge_ranks(per_rank, heads // tp, version))
        offset += len(layers)
    return weights, args, version, (tp, pp)
