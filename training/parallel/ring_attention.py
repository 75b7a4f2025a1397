"""Ring attention (``parallel.context_impl: ring``) over Megatron's load-balanced causal chunks.

The sequence of s tokens is cut into 2c chunks of L = s / 2c; context-parallel rank i holds chunks i and 2c-1-i
(:func:`ring_chunks`), so every rank has the same share of the causal triangle's work (Megatron-Core's CP,
``get_batch_on_this_cp_rank``). Its queries stay; the key/value blocks travel round the CP ring: at step t
(t = 0 .. c-1) rank i holds the keys and values of rank (i - t) mod c, computes each (query chunk, key chunk) pair
that causality keeps (key chunk before the query chunk: all of it; the same chunk: the causal triangle; after:
nothing) and folds it into its running result by the online softmax (:func:`merge`): a block's normalised output
and the log-sum-exp of its scores, combined exactly as one softmax over all the keys would be.

Backward: autograd through the blocks and the ring (:class:`RingShift` sends a block to the next rank in forward
and the block's gradient back to the previous one in backward). This is the straightforward version memory-wise:
every block's probabilities are kept for backward (about s^2 / c scores per head and rank, as the whole local
attention would keep), not recomputed block by block from the log-sum-exp as a fused kernel's backward would.
Key/value heads travel unrepeated (grouped-query attention: g/n of the traffic) and are repeated per block.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def ring_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2 cp sequence chunks that context-parallel rank ``rank`` holds: (rank, 2 cp - 1 - rank)."""
    return rank, 2 * cp - 1 - rank


def ring_positions(seq: int, rank: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global token positions [s / cp] rank ``rank`` holds, in its order (its two chunks one after the other)."""
    length = seq // (2 * cp)
    return torch.cat([torch.arange(c * length, (c + 1) * length, device=device) for c in ring_chunks(rank, cp)])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(hn)) V of one block pair, q [b, n, l, hn], k and v [b, n, lk, hn] -> (out [b, n, l, hn]
    normalised within the block, lse [b, n, l] the log-sum-exp of the block's scaled scores). ``causal``: the
    two are the same chunk, query j sees keys 0 .. j."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))  # [b, n, l, lk]
    if causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril_()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                # [b, n, l]
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two partial attentions over disjoint key sets (each normalised over its keys, with its
    log-sum-exp) -> the attention over their union. ``out`` None: the first block."""
    if out is None or lse is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


class RingShift(torch.autograd.Function):
    """x to the next rank of the CP ring, the previous rank's x back (point-to-point; gloo and NCCL both run
    isend/irecv); backward passes the gradient the other way round."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return shift(grad.contiguous(), ctx.group, -1), None


def shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send ``x`` to the rank ``step`` places further round ``group``'s ring, receive the one ``step`` places back."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    dst = dist.get_global_rank(group, (rank + step) % size)
    src = dist.get_global_rank(group, (rank - step) % size)
    out = torch.empty_like(x)
    send = dist.isend(x.contiguous(), dst, group=group)
    dist.recv(out, src, group=group)
    send.wait()
    return out


def fold_block(results: list[tuple[torch.Tensor | None, torch.Tensor | None]], q: torch.Tensor, mine: tuple[int, int],
               k: torch.Tensor, v: torch.Tensor, theirs: tuple[int, int]) -> None:
    """One ring step: this rank's queries q [b, n, 2L, hn] (its chunks ``mine``) against one rank's keys and values
    k, v [b, g, 2L, hn] (chunks ``theirs``), every pair causality keeps folded into ``results`` (per query chunk the
    running (output, log-sum-exp), in place)."""
    rep = q.size(1) // k.size(1)                                         # each key/value head for its n/g query heads
    k_chunks = k.repeat_interleave(rep, dim=1).chunk(2, dim=2)
    v_chunks = v.repeat_interleave(rep, dim=1).chunk(2, dim=2)
    for a, qa in enumerate(q.chunk(2, dim=2)):
        for b, (kb, vb) in enumerate(zip(k_chunks, v_chunks)):
            if theirs[b] > mine[a]:                                      # a later chunk: masked out entirely
                continue
            results[a] = merge(*results[a], *block_attention(qa, kb, vb, causal=theirs[b] == mine[a]))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence. q [b, n, s/c, hn], k and v [b, g, s/c, hn]
    (g divides n: grouped-query attention), each the rank's two chunks (:func:`ring_chunks`) one after the other
    -> [b, n, s/c, hn], the rank's rows of softmax(Q K^T / sqrt(hn) + causal) V."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    results: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None), (None, None)]
    kv = torch.stack([k, v])                                             # [2, b, g, s/c, hn]: one message per step
    for step in range(cp):
        fold_block(results, q, ring_chunks(rank, cp), kv[0], kv[1], ring_chunks((rank - step) % cp, cp))
        if step + 1 < cp:
            kv = RingShift.apply(kv, group)
    return torch.cat([out for out, _ in results], dim=2)
