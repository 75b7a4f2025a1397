"""Documents inside packed samples: Megatron's ``--reset-position-ids``, ``--reset-attention-mask`` and
``--eod-mask-loss``.

A GPT sample is ``seq_length + 1`` tokens cut from a stream of documents, each ended by the end-of-document token
(EOD), so one sample holds the end of one document, the start of another and whatever lies between. By default
(Megatron's too) every token attends to every earlier token of the sample. With the options (``data.*`` of the run
config), as Megatron's ``_get_ltor_masks_and_position_ids`` defines them:

- ``reset_position_ids``: positions restart at 0 after each EOD (the EOD itself ends its own document);
- ``reset_attention_mask``: a token attends only to earlier tokens of its own document (a block-diagonal causal
  mask: the tokens after an EOD do not see it or anything before it);
- ``eod_mask_loss``: the loss is not taken where the *input* token is the EOD (the prediction of the next
  document's first token from the previous document), and the micro-batch's loss is the mean over the rest.

:class:`DocumentMasks` computes the three from the token ids on the tokens' device (cumulative sums and maxima: no
host read, no Python loop over documents). The attention mask is bool [b, 1, s, s], True = attend, causality
included (what the attention cores take with a mask); it costs b s^2 bytes per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def document_index(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """tokens [b, s] -> [b, s]: the number of EODs strictly before each token (an EOD belongs to the document it
    ends)."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """tokens [b, s] -> [b, s]: each token's position inside its document (0 after every EOD)."""
    s = tokens.size(-1)
    index = torch.arange(s, device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 1:] = tokens[..., :-1] == eod  # a document starts after an EOD
    start_of = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=-1).values
    return index - start_of


def document_attention_mask(tokens: torch.Tensor, eod: int, queries: torch.Tensor | None = None) -> torch.Tensor:
    """tokens [b, s] -> bool [b, 1, s, s]: query i may attend key j iff j <= i and both are of one document.
    ``queries`` [q]: only the rows of these global positions, in their order -> [b, 1, q, s] (a context-parallel
    core's queries, :meth:`training.parallel.context.ContextParallel.core_queries`)."""
    doc = document_index(tokens, eod)
    s = tokens.size(-1)
    keys = torch.arange(s, device=tokens.device)
    rows = keys if queries is None else queries
    causal = keys[None, :] <= rows[:, None]                                # [q, s]
    return (doc.index_select(1, rows)[:, :, None] == doc[:, None, :]).logical_and_(causal).unsqueeze(1)


@dataclass(frozen=True)
class DocumentMasks:
    """The run's document options with its tokenizer's EOD id; :meth:`of` gives what the model and loss take."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def from_options(cls, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                     eod_mask_loss: bool) -> DocumentMasks | None:
        """None when every option is off (the model then runs its plain causal path)."""
        if not (reset_position_ids or reset_attention_mask or eod_mask_loss):
            return None
        return cls(eod, reset_position_ids, reset_attention_mask, eod_mask_loss)

    def of(self, tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """tokens [b, s] -> (positions [b, s], attention mask [b, 1, s, s], loss mask [b, s] float), each None
        where its option is off."""
        positions = document_positions(tokens, self.eod) if self.reset_position_ids else None
        mask = document_attention_mask(tokens, self.eod) if self.reset_attention_mask else None
        loss_mask = (tokens != self.eod).float() if self.eod_mask_loss else None
        return positions, mask, loss_mask


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Megatron's loss over a micro-batch: the mean of the per-token losses where the mask is 1 (all of them
    without a mask)."""
    if loss_mask is None:
        return losses.mean()
    return (losses.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
