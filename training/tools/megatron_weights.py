"""Megatron-LM's tensors in our names, merged over its TP and PP ranks, for :mod:`training.tools.import_megatron`:
the QKV row orders (:func:`qkv_parts`), the agreement of the TP ranks of one stage (:func:`check_shards`) and the
merge of all rank files into TP=1 weights (:func:`read_weights`). The name map of both of Megatron's layouts
(legacy and Megatron-Core) and how TP splits each tensor are :mod:`training.tools.megatron_names`.

QKV row order within one TP rank's shard (np query heads and ng key/value groups on that rank, hn head size), by
the file's ``checkpoint_version`` (Megatron's ``fix_query_key_value_ordering`` reads the old orders the same way):

    absent (0)  [3, np, hn]            all queries, then all keys, then all values (multi-head attention only)
    1.0         [np, hn, 3]            q, k, v interleaved row by row (multi-head attention only)
    2.0, 3.0    [ng, np/ng + 2, hn]    per key/value group its query heads' rows, its key rows, its value rows
                                       (multi-head: ng = np, per head [q; k; v]); Megatron-Core's ``linear_qkv``

The rank shards' queries, keys and values are concatenated over the TP ranks and fused in our layout
(:func:`training.models.qkv.fuse_qkv`). SwiGLU's ``dense_h_to_4h`` / ``linear_fc1`` holds on each rank its part of
the gate then its part of the up projection: the gates are concatenated, then the ups (ours: [gate; up]).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from training.models.qkv import fuse_qkv
from training.tools.megatron_names import layer_of, rename, split_dim
from training.tools.megatron_reader import (
    ImportMegatronError,
    RankFile,
    check_rank_files,
    check_same_checkpoint,
    load_file,
    megatron_arg,
)
from training.tools.tensor_check import few
from training.tools.torch_dist_reader import read_torch_dist


def qkv_parts(shard: torch.Tensor, heads: int, groups: int, version: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TP rank's ``query_key_value`` / ``linear_qkv`` weight [(np + 2 ng) hn, h] or bias -> its (queries
    [np hn, ...], keys [ng hn, ...], values [ng hn, ...]) from the row order of ``checkpoint_version`` (module
    docstring; ``heads`` = np, ``groups`` = ng of this rank)."""
    rest = shard.shape[1:]
    rows = heads + 2 * groups
    if shard.dim() == 0 or shard.size(0) % rows or heads % groups:
        raise ImportMegatronError(f"a query_key_value shard of shape {list(shard.shape)} does not split into q, k and v "
                                  f"of {heads} query heads and {groups} key/value groups per TP rank: args or tensors "
                                  f"damaged")
    hn = shard.size(0) // rows
    if version < 2.0 and groups != heads:
        raise ImportMegatronError(f"grouped-query attention in a checkpoint_version {version} file: Megatron-LM wrote "
                                  f"grouped-query attention only with version 3.0; a damaged or edited checkpoint")
    if version == 0:
        q, k, v = shard.view(3, heads * hn, *rest).unbind(0)
    elif version == 1.0:
        q, k, v = shard.view(heads, hn, 3, *rest).movedim(2, 0).reshape(3, heads * hn, *rest).unbind(0)
    else:
        per = heads // groups
        q, k, v = shard.view(groups, per + 2, hn, *rest).split([per, 1, 1], dim=1)
    return q.reshape(heads * hn, *rest), k.reshape(groups * hn, *rest), v.reshape(groups * hn, *rest)


def merge_ranks(per_rank: list[dict[str, torch.Tensor]], heads: int, groups: int, version: float, swiglu: bool
                ) -> dict[str, torch.Tensor]:
    """TP shards of one pipeline stage (our names) -> full tensors: QKV in our layout for ``heads`` query heads
    and ``groups`` key/value groups in all; SwiGLU's first MLP linear as [gate; up] (module docstring)."""
    out = {}
    tp = len(per_rank)
    for name in per_rank[0]:
        parts = [sd[name].detach().to(torch.float32).cpu() for sd in per_rank]
        if ".attn.qkv." in name:
            q, k, v = zip(*(qkv_parts(p, heads // tp, groups // tp, version) for p in parts))
            out[name] = fuse_qkv(torch.cat(q), torch.cat(k), torch.cat(v), heads, groups).contiguous()
        elif swiglu and ".mlp.fc." in name:
            if any(p.size(0) % 2 for p in parts):
                raise ImportMegatronError(f"{name}: a SwiGLU shard of {parts[0].size(0)} rows does not hold a gate and "
                                          f"an up projection of equal size")
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
            out[name] = torch.cat([*gates, *ups]).contiguous()
        elif split_dim(name) is None:
            out[name] = parts[0].contiguous()
        else:
            out[name] = torch.cat(parts, dim=split_dim(name)).contiguous()
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


class RankFiles:
    """The rank files of one checkpoint, each loaded when first needed, checked against the first
    (:func:`check_same_checkpoint`, the same number of virtual pipeline chunks) and dropped by :meth:`done`."""

    def __init__(self, files: dict[tuple[int, int], Path]):
        self.files = files
        self.first = load_file(files[min(files)])
        self.loaded: dict[tuple[int, int], RankFile] = {min(files): self.first}
        chunks = len(self.first.chunks)
        want = megatron_arg(self.first.args, "virtual_pipeline_model_parallel_size") or 1
        if want != chunks:
            raise ImportMegatronError(f"{self.first.path} holds {chunks} model chunk(s) but the checkpoint's args say "
                                      f"virtual_pipeline_model_parallel_size={want}: a damaged checkpoint")

    def get(self, rank: int, stage: int) -> RankFile:
        if (rank, stage) not in self.loaded:
            rf = self.loaded[(rank, stage)] = load_file(self.files[(rank, stage)])
            check_same_checkpoint(self.first, rf)
            if len(rf.chunks) != len(self.first.chunks):
                raise ImportMegatronError(f"{rf.path} holds {len(rf.chunks)} model chunk(s), {self.first.path} "
                                          f"{len(self.first.chunks)}: rank files of different checkpoints mixed in one "
                                          f"folder")
        return self.loaded[(rank, stage)]

    def done(self, stage: int) -> None:
        """Forget a stage's files (after its last chunk: with v = 1, one stage's files in memory at a time)."""
        for key in [k for k in self.loaded if k[1] == stage]:
            del self.loaded[key]


def stage_shards(rank_files: list[RankFile], chunk: int, offset: int, untied: bool
                 ) -> tuple[list[dict[str, torch.Tensor]], int]:
    """(each TP rank's tensors of chunk ``chunk`` of one stage in our names, layers shifted by ``offset``; how many
    layers the chunk holds)."""
    per_rank, layers = [], set()
    for rf in rank_files:
        layers = {i for i in map(layer_of, rf.chunks[chunk]) if i is not None}
        renamed = {}
        for name, t in rf.chunks[chunk].items():
            ours = rename(name, offset, untied)
            if ours is not None:
                renamed[ours] = t
        per_rank.append(renamed)
    return per_rank, len(layers)


def attention_heads(args: argparse.Namespace | None, heads: int | None, tp: int) -> tuple[int, int]:
    """(query heads, key/value groups) from the args (``heads`` given on the command line first), checked against the
    source's TP degree; one line when they are missing or do not split."""
    heads = heads or megatron_arg(args, "num_attention_heads")
    if heads is None:
        raise ImportMegatronError("the checkpoint has no args (an early release): pass --num-attention-heads")
    if heads % tp:
        raise ImportMegatronError(f"{heads} attention heads do not split over the source's {tp} TP ranks")
    groups = megatron_arg(args, "num_query_groups") if megatron_arg(args, "group_query_attention", False) else None
    groups = groups or heads
    if groups % tp or heads % groups:
        raise ImportMegatronError(f"{groups} key/value groups do not split over the source's {tp} TP ranks or do not "
                                  f"divide its {heads} attention heads: args damaged")
    return heads, groups


def read_global_weights(folder: Path, heads: int | None
                        ) -> tuple[dict[str, torch.Tensor], argparse.Namespace | None, float, tuple[int, int]]:
    """A ``torch_dist`` folder -> the :func:`read_weights` tuple: its global tensors are one TP=1 x PP=1 file's
    (:mod:`training.tools.torch_dist_reader`), renamed and fused like one rank's."""
    tensors, args, version, source = read_torch_dist(folder)
    heads, groups = attention_heads(args, heads, 1)
    untied = bool(megatron_arg(args, "untie_embeddings_and_output_weights", False))
    ours = {}
    for name, t in tensors.items():
        renamed = rename(name, 0, untied)
        if renamed is not None:
            ours[renamed] = t
    return merge_ranks([ours], heads, groups, version, bool(megatron_arg(args, "swiglu", False))), args, version, source


def read_weights(files: dict[tuple[int, int], Path], heads: int | None
                 ) -> tuple[dict[str, torch.Tensor], argparse.Namespace | None, float, tuple[int, int]]:
    """All files -> (TP=1 weights in our names, Megatron's args or None, checkpoint_version, (source TP, PP)).
    The first file's args say how many rank files there must be (:func:`check_rank_files`), every other file must
    be of the same checkpoint (:func:`check_same_checkpoint`) and agree with its stage's other ranks
    (:func:`check_shards`) before its tensors are merged. With a virtual pipeline of v chunks (``model0``, ...),
    the layers are chunk 0 of every stage, then chunk 1, ... (Megatron's assignment)."""
    ranks = RankFiles(files)
    first = ranks.first
    check_rank_files(first.args, files)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    args, version = first.args, first.version
    heads, groups = attention_heads(args, heads, tp)
    untied = bool(megatron_arg(args, "untie_embeddings_and_output_weights", False))
    swiglu = bool(megatron_arg(args, "swiglu", False))
    weights: dict[str, torch.Tensor] = {}
    offset = 0
    chunks = len(first.chunks)
    for chunk in range(chunks):
        for stage in range(pp):
            rank_files = [ranks.get(rank, stage) for rank in range(tp)]
            per_rank, layers = stage_shards(rank_files, chunk, offset, untied)
            check_shards(per_rank, [rf.path for rf in rank_files])
            weights.update(merge_ranks(per_rank, heads, groups, version, swiglu))
            offset += layers
            if chunk == chunks - 1:
                ranks.done(stage)
    return weights, args, version, (tp, pp)
