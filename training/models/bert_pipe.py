"""BERT as a DeepSpeed ``PipelineModule``: the same layers and parameters as :mod:`training.models.bert`, in stages.

Layer list (index: layer, PP=1 parameter names)::

    0            tied embedding (first stage)     embedding.* (and embedding_ln.* in the post-LN order)
    1 .. L       bidirectional layers             layers.{i}.*
    L + 1        heads (last stage)               final_ln.* (pre-LN), pooler.*, binary_head.*, lm_head.*
    L + 2        the tied embedding again: the MLM output layer, logits = h E_local^T + lm_head.bias

``TiedLayerSpec('embed')`` keeps one word-embedding weight per end and DeepSpeed all-reduces its gradient between
the first and last stage (as :mod:`training.models.gpt2_pipe`). Every parameter is drawn from the same per-name
generator as ``BertModel``'s, so a PP=k model holds exactly the PP=1 weights.

What crosses a stage boundary is a tuple ``(hidden [b, s, h] ([b, s/p, h] with sequence parallelism),
padding_mask [b, s] int64, loss_mask [b, s] int64)``. DeepSpeed's pipeline engine sends tuples of tensors of the
dtypes in its ``ID_TO_DTYPE``; a floating tensor is given ``requires_grad`` on receipt and a gradient is sent back
for it, an integer one is not, so the masks travel as int64 and need no gradient (a bool tensor would need the
engine's ``has_bool_tensors`` half-cast, which only handles the last element). The padding mask is the one the
attention of every layer needs; the loss mask lets the last stage run the MLM head on the masked positions only
(``x[loss_mask] -> [m, h] -> [m, V/p]``), as ``BertModel`` does, without the b*s*V/p logits tensor.

The last stage reads its labels from the loader's second element, ``(lm_labels, loss_mask, sop_labels)``; the loss
is :func:`training.models.bert.bert_loss` (MLM mean over the masked tokens + sentence-order cross-entropy), the
PP=1 loss. Sequence parallelism as in ``BertModel``: the stages send their sequence chunk; the heads gather it.

Every schedule runs these stages (``parallel.pipeline_schedule``): under interleaved 1F1B each chunk, the
wraparound rank p-1 -> rank 0 included, passes the same tuple on (the interleaved engine sends int64 tensors
without a gradient, as DeepSpeed's does); under DualPipeV the first and last stage, both on rank 0, share the tied
embedding as one module and the heads compute the loss there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from training.models.bert import BertLayer, BertLMHead, attention_mask, bert_loss
from training.models.blocks import embedding_dropout, mark_norm_sequence_parallel, normal_init
from training.models.config import ModelConfig
from training.models.pipe_chunks import schedule_module
from training.parallel import random as tp_random
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import VocabParallelEmbedding, mark_sequence_parallel
from training.parallel.mappings import (
    copy_to_parallel_region,
    gather_from_sequence_parallel_region,
    group_size,
    scatter_to_sequence_parallel_region,
    split_sequence,
)
from training.parallel.pipe_scatter import scatter_group
from training.parallel.state import ParallelState

Stage = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (hidden, padding_mask int64, loss_mask int64)


class BertEmbeddingPipe(nn.Module):
    """Word + position + token-type embeddings, the post-LN embedding LayerNorm and dropout (first stage):
    ``(tokens, types, padding_mask, loss_mask)`` -> ``(hidden, padding_mask, loss_mask)``. Its word embedding is
    the MLM output layer on the last stage (:func:`mlm_logits`)."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, group: dist.ProcessGroup | None, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.sequence_parallel = sp = sequence_parallel and group_size(group) > 1
        std, h = cfg.init_method_std, cfg.hidden_size
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, h, group, sequence_parallel=sp,
                                                      init_method=normal_init(seed, "embedding.word_embeddings", std))
        self.position_embeddings = nn.Embedding(cfg.positions, h)
        normal_init(seed, "embedding.position_embeddings", std)(self.position_embeddings.weight)
        self.tokentype_embeddings = nn.Embedding(cfg.num_tokentypes, h) if cfg.num_tokentypes > 0 else None
        if self.tokentype_embeddings is not None:
            normal_init(seed, "embedding.tokentype_embeddings", std)(self.tokentype_embeddings.weight)
            if sp:
                mark_sequence_parallel(self.tokentype_embeddings.weight, group)
        # post-LN (original BERT) normalises the embeddings (``BertModel.embedding_ln``)
        self.embedding_ln = None if cfg.layer_order == "pre_ln" else nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        if sp and self.embedding_ln is not None:
            mark_norm_sequence_parallel(self.embedding_ln, group)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Stage:
        tokens, types, padding_mask, loss_mask = inputs                        # int64 [b, s] each
        s = tokens.size(1)
        if s > self.cfg.positions:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings {self.cfg.positions}")
        sp = self.sequence_parallel
        pos = self.position_embeddings(torch.arange(s, device=tokens.device))  # [s, h]
        if sp:
            pos = scatter_to_sequence_parallel_region(pos, self.group, dim=0)
        x = self.word_embeddings(tokens) + pos                                  # [b, s, h] ([b, s/p, h] SP)
        if self.tokentype_embeddings is not None:
            x = x + self.tokentype_embeddings(split_sequence(types, self.group) if sp else types)
        if self.embedding_ln is not None:
            x = self.embedding_ln(x)
        x = embedding_dropout(x, self.cfg.hidden_dropout, self.training, sp)
        return x, padding_mask, loss_mask


class BertLayerPipe(BertLayer):
    """One bidirectional layer on the stage tuple: the masks pass through unchanged."""

    def forward(self, inputs: Stage) -> Stage:  # type: ignore[override]
        x, padding_mask, loss_mask = inputs
        return super().forward(x, attention_mask(padding_mask)), padding_mask, loss_mask


class BertHeadsPipe(nn.Module):
    """The last stage's heads, named as ``BertModel``'s: the pre-LN final LayerNorm, the pooler and binary
    (sentence-order) head, and the MLM head's transform (dense -> GeLU -> LayerNorm) on the masked positions.
    ``(hidden, padding_mask, loss_mask)`` -> ``(h_masked [m, h], lm_head.bias [V/p], sop_logits [b, 2])`` (no
    ``sop_logits`` without a binary head); :func:`mlm_logits` projects ``h_masked`` with the tied embedding."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, group: dist.ProcessGroup | None, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = sp = sequence_parallel and group_size(group) > 1
        h, std = cfg.hidden_size, cfg.init_method_std
        self.final_ln = nn.LayerNorm(h, eps=cfg.layernorm_epsilon) if cfg.layer_order == "pre_ln" else None
        if sp and self.final_ln is not None:
            mark_norm_sequence_parallel(self.final_ln, group)
        self.lm_head = BertLMHead(cfg, padded_vocab, group, seed)
        self.pooler = self.binary_head = None
        if cfg.binary_head:
            self.pooler = nn.Linear(h, h)
            normal_init(seed, "pooler", std)(self.pooler.weight)
            nn.init.zeros_(self.pooler.bias)
            self.binary_head = nn.Linear(h, 2)
            normal_init(seed, "binary_head", std)(self.binary_head.weight)
            nn.init.zeros_(self.binary_head.bias)

    def forward(self, inputs: Stage) -> tuple[torch.Tensor, ...]:
        x, _, loss_mask = inputs
        x = self.final_ln(x) if self.final_ln is not None else x
        if self.sequence_parallel:  # the heads are replicated: the whole sequence (backward keeps the chunk)
            x = gather_from_sequence_parallel_region(x, self.group, grad_is_partial=False)
        head = self.lm_head
        h = head.ln(head.act(head.dense(x[loss_mask.bool()])))                 # [m, h]
        if self.binary_head is None:
            return h, head.bias
        return h, head.bias, self.binary_head(torch.tanh(self.pooler(x[:, 0])))


def mlm_logits(embedding: BertEmbeddingPipe, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tied MLM output layer: f, then h E_local^T + bias -> vocab-parallel logits [m, V/p] (``BertLMHead``)."""
    h, bias, *sop = inputs
    return (F.linear(copy_to_parallel_region(h, embedding.group), embedding.word_embeddings.weight, bias), *sop)


def pipe_batch(batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A collated BERT micro-batch (``training.data.bert_data.collate``) as the pipeline engine loads it:
    (the first stage's inputs, the last stage's labels)."""
    return ((batch["text"], batch["types"], batch["padding_mask"], batch["loss_mask"]),
            (batch["labels"], batch["loss_mask"], batch["is_random"]))


def build_bert_pipe(cfg: ModelConfig, padded_vocab: int, ps: ParallelState, seed: int,
                    sequence_parallel: bool = False, schedule: str = "1f1b",
                    virtual_pipeline: int = 1) -> PipelineModule:
    """The stages for ``schedule`` (:func:`~training.models.pipe_chunks.schedule_module`: '1f1b', 'interleaved'
    with ``virtual_pipeline`` chunks per rank, 'dualpipev'); every chunk or phase passes the stage tuple on."""
    group, sp = ps.tp_group, sequence_parallel

    def loss_fn(outputs, labels):
        """MLM + SOP loss of one micro-batch, as ``BertModel.forward`` + ``bert_loss`` compute it at PP=1."""
        logits, *sop = outputs
        lm_labels, loss_mask, sop_labels = labels
        target = lm_labels[loss_mask.bool()].clamp(min=0)                       # [m]
        lm_loss = vocab_parallel_cross_entropy(logits.unsqueeze(0), target.unsqueeze(0), group).squeeze(0)
        return bert_loss(lm_loss, sop[0] if sop else None, sop_labels)[0]

    embed = ("embed", BertEmbeddingPipe, cfg, padded_vocab, group, seed)
    specs = [TiedLayerSpec(*embed, sequence_parallel=sp, tied_weight_attr="word_embeddings.weight"),
             *[LayerSpec(BertLayerPipe, cfg, group, seed, i, sequence_parallel=sp) for i in range(cfg.num_layers)],
             LayerSpec(BertHeadsPipe, cfg, padded_vocab, group, seed, sequence_parallel=sp),
             TiedLayerSpec(*embed, sequence_parallel=sp, forward_fn=mlm_logits,
                           tied_weight_attr="word_embeddings.weight")]
    return schedule_module(schedule, virtual_pipeline, scatter_group(group, sp), layers=specs, topology=ps.topology,
                           loss_fn=loss_fn, partition_method="type:BertLayerPipe",
                           activation_checkpoint_interval=1 if cfg.recompute == "full" else 0,
                           activation_checkpoint_func=tp_random.checkpoint, checkpointable_layers=["BertLayerPipe"])


def bert_model_name(pipe_name: str, num_layers: int) -> str | None:
    """A parameter name of the pipeline model (``tied_modules.embed.x``, ``0.x`` in the layer files, ``3.attn...``)
    -> the ``BertModel`` name (both embedding copies -> ``embedding.*``/``embedding_ln.*``); None for none."""
    for tied in ("tied_modules.embed.", "0."):
        if pipe_name.startswith(tied):
            rest = pipe_name[len(tied):]
            return rest if rest.startswith("embedding_ln.") else "embedding." + rest
    idx, rest = pipe_name.split(".", 1)
    if 1 <= int(idx) <= num_layers:
        return f"layers.{int(idx) - 1}.{rest}"
    return rest if int(idx) == num_layers + 1 else None  # the heads keep BertModel's names


def pipe_location(name: str, num_layers: int) -> tuple[int, str]:
    """The inverse of :func:`bert_model_name`: a ``BertModel`` parameter name -> (pipeline layer index, its name in
    that layer's ``layer_XX-*`` checkpoint file)."""
    if name.startswith("embedding."):
        return 0, name[len("embedding."):]
    if name.startswith("embedding_ln."):
        return 0, name
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return int(i) + 1, rest
    return num_layers + 1, name  # the heads
