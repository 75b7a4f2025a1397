"""Packed documents (``data.reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``:
:mod:`training.data.documents`) under context parallelism (:mod:`training.parallel.context`).

Every CP rank loads the whole sample, so each computes the document of every token itself (cumulative sums over
the EOD positions: no communication) and keeps what its own part needs:

* the positions of its tokens: reset per document, as without CP (:func:`training.data.documents.document_positions`
  over the whole sample, then the rank's tokens), or the global positions;
* the attention mask of its core's queries (:meth:`ContextParallel.core_queries`): with Ulysses the core attends
  over the whole sequence on n/c heads after its all-to-all, so it takes the block-diagonal causal mask [b, 1, s, s]
  of the non-CP path; the ring takes this rank's query rows [b, 1, s/c, s] (keys in global order), from which each
  ring step reads the block of the key chunk it holds;
* the loss mask of its tokens (the EOD inputs out), summed and counted over CP by :meth:`ContextParallel.loss`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from training.data.documents import DocumentMasks, document_attention_mask, document_positions
from training.parallel.context import ContextParallel


@dataclass(frozen=True)
class ContextPart:
    """One CP rank's part of a micro-batch: what the model and :meth:`ContextParallel.loss` take."""

    tokens: torch.Tensor
    """[b, s/c] this rank's tokens (:meth:`ContextParallel.positions` order)."""
    labels: torch.Tensor
    """[b, s/c] their labels."""
    positions: torch.Tensor
    """[s/c] their global positions, or [b, s/c] their positions inside their documents (``reset_position_ids``)."""
    attn_mask: torch.Tensor | None = None
    """bool [b, 1, queries, s] for the CP core (module docstring), None = causal (no ``reset_attention_mask``)."""
    loss_mask: torch.Tensor | None = None
    """[b, s/c] float, 1 where the loss is taken (``eod_mask_loss``), None = everywhere."""


def context_part(context: ContextParallel, documents: DocumentMasks | None, tokens: torch.Tensor,
                 labels: torch.Tensor) -> ContextPart:
    """The whole micro-batch (tokens, labels [b, s], on every CP rank alike) -> this rank's :class:`ContextPart`,
    with the packed-document options of ``documents`` (None: all off)."""
    mine, their_labels, pos = context.split(tokens, labels)
    if documents is None:
        return ContextPart(mine, their_labels, pos)
    positions = document_positions(tokens, documents.eod).index_select(1, pos) if documents.reset_position_ids else pos
    mask = None
    if documents.reset_attention_mask:
        mask = document_attention_mask(tokens, documents.eod, context.core_queries(tokens.size(1), tokens.device))
    loss_mask = (mine != documents.eod).float() if documents.eod_mask_loss else None
    return ContextPart(mine, their_labels, positions, mask, loss_mask)
