"""Context parallelism (``parallel.context: c``, docs/context_parallel.md): every sample's tokens split over the c
ranks of a context-parallel (CP) group, which hold the same weights.

:class:`ContextParallel` owns what CP changes, nowhere else:

* which tokens a rank holds (:meth:`ContextParallel.positions`): with Ulysses the contiguous c-th
  ``rank * s/c .. (rank + 1) * s/c - 1``; with ring attention Megatron's load-balanced chunks i and 2c-1-i
  (:func:`training.parallel.ring_attention.ring_chunks`). :meth:`ContextParallel.split` cuts a loaded batch
  (tokens, labels) to them and gives their global positions (the learned position table and RoPE read them);
* the attention core around the model's own (:meth:`ContextParallel.wrap`): :class:`UlyssesCore` feeds DeepSpeed's
  ``DistributedAttention`` (all-to-all from sequence-split to head-split, the model's core on s tokens and n/c
  heads, all-to-all back); :class:`RingCore` runs :func:`training.parallel.ring_attention.ring_attention`;
* the loss (:meth:`ContextParallel.loss`): the mean over the whole sequence, the sum of token losses and the token
  counts all-reduced over CP in the value, while each rank's gradient is its own tokens' share.

The gradients of the weights are then summed over the CP group by the data-parallel reduction (DeepSpeed's
sequence-data-parallel group, :class:`training.parallel.state.ParallelState`): the full-sequence gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention
from torch import nn

from training.parallel.ring_attention import ring_attention, ring_positions


class HeadsCore(nn.Module):
    """The model's core in DeepSpeed's [b, s, heads, hn] layout: q [b, s, n/c, hn], k and v [b, s, g', hn] ->
    [b, s, n/c, hn] (the core itself takes [b, heads, s, hn])."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask).transpose(1, 2)


class UlyssesCore(nn.Module):
    """DeepSpeed-Ulysses around the model's core: q [b, n/p, s/c, hn], k and v [b, g/p, s/c, hn] -> [b, n/p, s/c, hn].

    ``DistributedAttention`` (batch first: scatter the heads, dim 2, gather the sequence, dim 1) turns each of q, k
    and v into [b, s, heads/c, hn] by one all-to-all, the core attends causally over the whole sequence on its
    n/(pc) heads, and one all-to-all brings the output back to the rank's tokens and all its heads. Query heads are
    grouped by key/value group (training/models/qkv.py), so contiguous c-ths of both stay together; with fewer
    key/value heads than c (or not divisible by it) they are repeated for their query heads first. ``attn_mask``
    (packed documents): bool [b, 1, s, s] over the whole sequence, True = attend, causality included, what the core
    takes without CP (every rank builds it from the whole sample, :meth:`ContextParallel.core_queries`)."""

    def __init__(self, core: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.cp = dist.get_world_size(group)
        self.attention = DistributedAttention(HeadsCore(core), group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if k.size(1) % self.cp:  # each key/value head for its query heads (training/models/qkv.py's repeat_kv)
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None,
                             attn_mask)                                  # [b, s/c, n/p, hn]
        return out.transpose(1, 2)


class RingCore(nn.Module):
    """Ring attention over the CP group in place of the model's core (which it replaces: the ring computes the
    blocks itself, without dropout): q [b, n/p, s/c, hn], k and v [b, g/p, s/c, hn] -> [b, n/p, s/c, hn];
    ``attn_mask`` (packed documents): bool [b, 1, s/c, s], this rank's query rows against every key
    (:func:`training.parallel.ring_attention.ring_attention`)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, attn_mask)


@dataclass(frozen=True)
class ContextParallel:
    """One rank's place in its context-parallel group and the implementation (``ulysses`` or ``ring``)."""

    group: dist.ProcessGroup
    impl: str = "ulysses"

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def positions(self, seq: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions [s/c] of the tokens this rank holds, in its order."""
        if self.impl == "ring":
            return ring_positions(seq, self.rank, self.size, device)
        part = seq // self.size
        return torch.arange(self.rank * part, (self.rank + 1) * part, device=device)

    def core_queries(self, seq: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of the queries this rank's attention core computes, in its order: the whole
        sequence with Ulysses (after its all-to-all), the rank's own tokens with ring attention. An attention mask
        for the core (packed documents) holds these rows against all s keys in global order."""
        if self.impl == "ring":
            return self.positions(seq, device)
        return torch.arange(seq, device=device)

    def split(self, tokens: torch.Tensor, labels: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A loaded batch (tokens and labels [b, s]) -> this rank's tokens, labels [b, s/c] and their positions [s/c]."""
        pos = self.positions(tokens.size(1), tokens.device)
        return tokens.index_select(1, pos), labels.index_select(1, pos), pos

    def wrap(self, core: nn.Module) -> nn.Module:
        """The CP attention core around (Ulysses) or instead of (ring) the model's ``core``."""
        if self.impl == "ring":
            return RingCore(self.group)
        return UlyssesCore(core, self.group)

    def loss(self, token_losses: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's token losses [b, s/c] -> the mean over every token of the whole sequences (the CP sums and
        counts all-reduced: the value every CP rank reports), whose gradient is this rank's share only
        (sum of its losses over all the tokens' count): summed over CP by the gradient reduction, the whole
        sequence's. ``loss_mask`` [b, s/c] (``data.eod_mask_loss``): only the tokens where it is 1, counted as
        :func:`training.data.documents.masked_mean` counts them over the whole sequences."""
        losses = token_losses.float()
        if loss_mask is None:
            local, count = losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)
        else:
            local, count = (losses * loss_mask).sum(), loss_mask.float().sum()
        totals = torch.stack([local.detach(), count.detach()])
        dist.all_reduce(totals, group=self.group)
        totals[1].clamp_(min=1.0)
        share = local / totals[1]
        return share + (totals[0] / totals[1] - share).detach()
