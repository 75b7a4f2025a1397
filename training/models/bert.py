"""BERT with Megatron tensor parallelism, built from the blocks it shares with GPT-2 (``training.models.blocks``).

Notation: b batch, s sequence, h hidden, p = TP degree, V padded vocabulary, m masked positions.

Differences from GPT-2 (``training.models.gpt2``):

* bidirectional attention; the [b, s] padding mask (1 = real token) becomes a boolean key mask
  [b, 1, 1, s] (True = attend), i.e. Megatron's additive ``(1 - m) * -10000`` with -inf instead;
* token-type (segment) embeddings added to word + position embeddings;
* two layer orders (``model.layer_order``), Figure 7 of the Megatron-LM paper:

  ``pre_ln``  (the paper's rearranged order)  x = x + Drop(Attn(LN1(x)));  x = x + Drop(MLP(LN2(x)));
              final LayerNorm after the last layer, no LayerNorm on the embeddings.
  ``post_ln`` (original BERT)                 x = LN1(x + Drop(Attn(x)));  x = LN2(x + Drop(MLP(x)));
              LayerNorm on the embeddings, none after the last layer (its output is already normalised).

* heads: MLM head = dense(h, h) -> GeLU -> LayerNorm -> logits tied to the vocab-parallel word
  embedding (each rank: [.., V/p]) + vocab-parallel bias [V/p], loss by vocab-parallel cross-entropy
  (fp32, logits never gathered); pooler = tanh(dense(hidden at [CLS])); binary head Linear(h, 2)
  for sentence-order prediction.

Sequence parallelism (``sequence_parallel=True``, ``parallel.sequence_parallel``; :mod:`training.models.blocks`):
the encoder runs on this rank's sequence chunk as GPT-2 does (word embedding reduce-scattered, the chunk's
position and token-type embeddings added, the embedding LayerNorm, dropout, the layers and the final LayerNorm
on the chunk; token-type table and LayerNorm gradients all-reduced over TP), and :meth:`BertModel.encode` gathers
the whole sequence at its end: the heads (pooler, SOP, MLM on the masked positions) are unchanged. RACE
fine-tuning (:class:`BertMultipleChoice`) keeps it off.

The MLM head runs only on the masked positions (x[loss_mask] -> [m, h] -> [m, V/p]): the same loss as
Megatron's full [b, s, V/p] logits masked afterwards, without the b*s*V/p logits tensor.

Weights: as GPT-2, every parameter comes from its own generator seeded by (seed, name), so a TP=k
model equals the TP=1 model split k ways (same padded vocabulary).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.models.blocks import (
    TransformerLayer,
    activation,
    embedding_dropout,
    mark_norm_sequence_parallel,
    normal_init,
)
from training.models.config import ModelConfig
from training.models.ops import dropout
from training.parallel import random as tp_random
from training.parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.layers import VocabParallelEmbedding, mark_sequence_parallel
from training.parallel.mappings import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    group_size,
    scatter_to_sequence_parallel_region,
    split_sequence,
)
from training.parallel.utils import divide, set_tensor_parallel_attributes

NUM_CHOICES = 4


def attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] (1 = token, 0 = padding) -> boolean [b, 1, 1, s] key mask for SDPA (True = attend)."""
    return padding_mask.bool()[:, None, None, :]


class BertLayer(TransformerLayer):
    """One bidirectional transformer layer in the configured order (``model.layer_order``, see the module
    docstring): the shared :class:`training.models.blocks.TransformerLayer` without the causal mask."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None, seed: int, index: int,
                 sequence_parallel: bool = False):
        super().__init__(cfg, group, seed, index, causal=False, pre_ln=cfg.layer_order == "pre_ln",
                         sequence_parallel=sequence_parallel)


class BertLMHead(nn.Module):
    """dense -> GeLU (``model.lm_head_activation``, else ``model.activation``) -> LayerNorm -> tied vocab-parallel
    logits + vocab-parallel bias."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None, seed: int):
        super().__init__()
        self.group = group
        self.act = activation(cfg.lm_head_activation or cfg.activation)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        normal_init(seed, "lm_head.dense", cfg.init_method_std)(self.dense.weight)
        nn.init.zeros_(self.dense.bias)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.bias = nn.Parameter(torch.zeros(divide(padded_vocab_size, group_size(group))))
        set_tensor_parallel_attributes(self.bias, partition_dim=0)

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        """x [..., h] (replicated) -> logits [..., V/p] for this rank's vocabulary rows."""
        x = self.ln(self.act(self.dense(x)))
        return F.linear(copy_to_parallel_region(x, self.group), word_embeddings, self.bias)


class BertModel(nn.Module):
    """BERT encoder + optional MLM head, pooler and SOP head.

    ``forward(tokens, types, padding_mask, lm_labels, loss_mask)`` (all int64 [b, s]) returns
    ``(lm_loss [m] fp32 per masked token, sop_logits [b, 2] or None)``; without ``lm_labels`` it
    returns ``(vocab-parallel logits [b, s, V/p], sop_logits)``.
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None = None,
                 seed: int = 1234,
                 add_lm_head: bool = True, add_binary_head: bool | None = None, add_pooler: bool | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.sequence_parallel = sp = sequence_parallel and group_size(group) > 1
        self.padded_vocab_size = padded_vocab_size
        add_binary_head = cfg.binary_head if add_binary_head is None else add_binary_head
        add_pooler = add_binary_head if add_pooler is None else add_pooler
        if add_binary_head and not add_pooler:
            raise ValueError("the binary (SOP) head needs the pooler")
        std, h = cfg.init_method_std, cfg.hidden_size
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, h, group, init_method=normal_init(seed, "embedding.word_embeddings", std),
            sequence_parallel=sp)
        self.embedding.position_embeddings = nn.Embedding(cfg.positions, h)
        normal_init(seed, "embedding.position_embeddings", std)(self.embedding.position_embeddings.weight)
        self.embedding.tokentype_embeddings = nn.Embedding(cfg.num_tokentypes, h) if cfg.num_tokentypes > 0 else None
        if self.embedding.tokentype_embeddings is not None:
            normal_init(seed, "embedding.tokentype_embeddings", std)(self.embedding.tokentype_embeddings.weight)
            if sp:  # looked up for this rank's tokens only
                mark_sequence_parallel(self.embedding.tokentype_embeddings.weight, group)
        self.pre_ln = cfg.layer_order == "pre_ln"
        # post-LN (original BERT) normalises the embeddings; pre-LN normalises the last layer's output
        self.embedding_ln = None if self.pre_ln else nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        self.layers = nn.ModuleList(BertLayer(cfg, group, seed, i, sequence_parallel=sp) for i in range(cfg.num_layers))
        self.final_ln = nn.LayerNorm(h, eps=cfg.layernorm_epsilon) if self.pre_ln else None
        for ln in (self.embedding_ln, self.final_ln):
            if sp and ln is not None:
                mark_norm_sequence_parallel(ln, group)
        self.lm_head = BertLMHead(cfg, padded_vocab_size, group, seed) if add_lm_head else None
        self.pooler = None
        if add_pooler:
            self.pooler = nn.Linear(h, h)
            normal_init(seed, "pooler", std)(self.pooler.weight)
            nn.init.zeros_(self.pooler.bias)
        self.binary_head = None
        if add_binary_head:
            self.binary_head = nn.Linear(h, 2)
            normal_init(seed, "binary_head", std)(self.binary_head.weight)
            nn.init.zeros_(self.binary_head.bias)

    # ---- pieces ----------------------------------------------------------------------------------
    def encode(self, tokens: torch.Tensor, types: torch.Tensor | None, padding_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states [b, s, h] of tokens/types/padding_mask [b, s]."""
        b, s = tokens.shape
        if s > self.cfg.positions:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings {self.cfg.positions}")
        sp = self.sequence_parallel
        pos = self.embedding.position_embeddings(torch.arange(s, device=tokens.device))  # [s, h]
        if sp:  # this rank's chunk of the sequence: positions, token types (the word embedding reduce-scatters)
            pos = scatter_to_sequence_parallel_region(pos, self.group, dim=0)
        x = self.embedding.word_embeddings(tokens) + pos                   # [b, s, h] ([b, s/p, h] SP)
        if self.embedding.tokentype_embeddings is not None:
            if types is None:
                types = torch.zeros_like(tokens)
            x = x + self.embedding.tokentype_embeddings(split_sequence(types, self.group) if sp else types)
        if self.embedding_ln is not None:
            x = self.embedding_ln(x)
        x = embedding_dropout(x, self.cfg.hidden_dropout, self.training, sp)
        mask = attention_mask(padding_mask)
        for layer in self.layers:
            if self.cfg.recompute == "full" and self.training and torch.is_grad_enabled():
                x = tp_random.checkpoint(layer, x, mask)
            else:
                x = layer(x, mask)
        x = self.final_ln(x) if self.final_ln is not None else x
        # the heads are replicated: every rank computes the whole gradient of x, backward keeps its chunk
        return gather_from_sequence_parallel_region(x, self.group, grad_is_partial=False) if sp else x

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """tanh(dense(hidden[:, 0])) -> [b, h] (the [CLS] position)."""
        if self.pooler is None:
            raise RuntimeError("this BertModel was built without a pooler")
        return torch.tanh(self.pooler(hidden[:, 0]))

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MLM head: hidden [..., h] -> vocab-parallel logits [..., V/p] (tied to the word embedding)."""
        return self.lm_head(hidden, self.embedding.word_embeddings.weight)

    # ---- pretraining forward ---------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, types: torch.Tensor, padding_mask: torch.Tensor,
                lm_labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None):
        hidden = self.encode(tokens, types, padding_mask)
        sop_logits = self.binary_head(self.pool(hidden)) if self.binary_head is not None else None
        if self.lm_head is None:
            return hidden, sop_logits
        if lm_labels is None:
            return self.output_logits(hidden), sop_logits
        sel = (loss_mask if loss_mask is not None else lm_labels >= 0).bool()  # [b, s]
        logits = self.output_logits(hidden[sel])                                # [m, V/p]
        lm_loss = vocab_parallel_cross_entropy(logits.unsqueeze(0), lm_labels[sel].clamp(min=0).unsqueeze(0),
                                               self.group).squeeze(0)          # [m] fp32
        return lm_loss, sop_logits

    def full_lm_logits(self, tokens, types, padding_mask) -> torch.Tensor:
        """MLM logits over the whole padded vocabulary [b, s, V] (gathers across TP; for inspection)."""
        logits, _ = self(tokens, types, padding_mask)
        return gather_from_parallel_region(logits, self.group)

    def num_parameters(self, exclude_padding: bool = False) -> int:
        """Parameters of the whole model (all TP shards), counting tied weights once."""
        world = group_size(self.group)
        n = sum(p.numel() * (world if getattr(p, "tensor_model_parallel", False) else 1) for p in self.parameters())
        if exclude_padding and self.cfg.vocab_size:
            pad = self.padded_vocab_size - self.cfg.vocab_size
            n -= pad * self.cfg.hidden_size + (pad if self.lm_head is not None else 0)
        return n


def bert_loss(lm_loss: torch.Tensor, sop_logits: torch.Tensor | None, sop_labels: torch.Tensor | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MLM (mean over masked tokens) + SOP cross-entropy; returns (loss, {"mlm_loss", "sop_loss"}), the parts
    as detached device tensors (read with the step's other metrics, not one host sync each)."""
    mlm = lm_loss.float().mean() if lm_loss.numel() else lm_loss.float().sum()
    parts = {"mlm_loss": mlm.detach()}
    if sop_logits is None:
        return mlm, parts
    sop = F.cross_entropy(sop_logits.float(), sop_labels.long())
    parts["sop_loss"] = sop.detach()
    return mlm + sop, parts


class BertMultipleChoice(nn.Module):
    """Megatron's ``MultipleChoice``: [n, 4, L] -> [4n, L] -> BERT -> pooler -> dropout -> Linear(h, 1) -> [n, 4].

    The encoder is ``self.bert`` (a :class:`BertModel` without MLM/SOP heads); pretrained weights are
    loaded with :func:`load_pretrained_encoder`.
    """

    num_choices = NUM_CHOICES

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None = None,
                 seed: int = 1234):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.padded_vocab_size = padded_vocab_size
        self.bert = BertModel(cfg, padded_vocab_size, group, seed, add_lm_head=False, add_binary_head=False,
                              add_pooler=True)
        self.choice_head = nn.Linear(cfg.hidden_size, 1)
        normal_init(seed, "choice_head", cfg.init_method_std)(self.choice_head.weight)
        nn.init.zeros_(self.choice_head.bias)

    def forward(self, text: torch.Tensor, types: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """int64 [n, 4, L] each -> logits [n, 4]."""
        n, c, L = text.shape
        hidden = self.bert.encode(text.reshape(n * c, L), types.reshape(n * c, L), padding_mask.reshape(n * c, L))
        pooled = dropout(self.bert.pool(hidden), self.cfg.hidden_dropout, self.training)
        return self.choice_head(pooled).view(n, c)

    def num_parameters(self, exclude_padding: bool = False) -> int:
        return self.bert.num_parameters(exclude_padding) + sum(p.numel() for p in self.choice_head.parameters())


def load_pretrained_encoder(mc: BertMultipleChoice, pretrained: dict[str, torch.Tensor]) -> list[str]:
    """Copy a pretrained :class:`BertModel` state (this rank's shards) into ``mc.bert``.

    MLM/SOP head weights are dropped; a missing pooler (pretrained without SOP) stays at its fresh
    initialisation. Returns the names of ``mc`` parameters that were not in the checkpoint.
    Raises ValueError on a shape mismatch (a checkpoint of another size).
    """
    own = mc.bert.state_dict()
    take = {k: v for k, v in pretrained.items() if k in own}
    for k, v in take.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"pretrained {k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}")
    missing = [f"bert.{k}" for k in own if k not in take]
    mc.bert.load_state_dict({**own, **take}, strict=True)
    return missing + ["choice_head.weight", "choice_head.bias"]


def build_bert_for_eval(cfg: ModelConfig, padded_vocab_size: int, group: dist.ProcessGroup | None, seed: int,
                        multiple_choice: bool) -> nn.Module:
    """The module a BERT checkpoint's state dict fits: the multiple-choice model or the pretraining model."""
    if multiple_choice:
        return BertMultipleChoice(cfg, padded_vocab_size, group, seed)
    return BertModel(cfg, padded_vocab_size, group, seed)
