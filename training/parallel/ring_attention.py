"""Ring attention (``parallel.context_impl: ring``) over Megatron's load-balanced causal chunks.

The sequence of s tokens is cut into 2c chunks of L = s / 2c; context-parallel rank i holds chunks i and 2c-1-i
(:func:`ring_chunks`), so every rank has the same share of the causal triangle's work (Megatron-Core's CP,
``get_batch_on_this_cp_rank``). Its queries stay; the key/value blocks travel round the CP ring: at step t
(t = 0 .. c-1) rank i holds the keys and values of rank (i - t) mod c, computes each (query chunk, key chunk) pair
that causality keeps (key chunk before the query chunk: all of it; the same chunk: the causal triangle; after:
nothing) and folds it into its running result by the online softmax (:func:`merge`): a block's normalised output
and the log-sum-exp of its scores, combined exactly as one softmax over all the keys would be.

Backward (:class:`RingAttention`, its own autograd function): forward keeps only q, k, v, the output and the
final log-sum-exp (not the blocks' probabilities: O(s/c) per head and rank besides the inputs, instead of
s^2/c); backward passes the keys and values round the ring a second time, recomputes each kept block's
probabilities from the log-sum-exp (:func:`block_grads`, the flash-attention backward) and adds its queries'
gradient here and its keys' and values' gradients to an accumulator that travels with them and, after one more
pass, reaches the rank that owns them. Key/value heads travel unrepeated (grouped-query attention: g/n of the
traffic) and are repeated per block; so are their gradients, summed back over the repeats.

Packed documents (``data.reset_attention_mask``): a mask of the rank's query rows against every key (global
order) replaces the causal rule; each block pair reads its part (:func:`block_mask`).
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


def masked_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, keep: torch.Tensor | None) -> torch.Tensor:
    """Q K^T / sqrt(hn) [b, n, l, lk] of one block pair, -inf where a query may not see a key: ``keep`` (bool
    [b, 1, l, lk], True = attend, causality included: packed documents) or, without it, ``causal`` (the two are the
    same chunk: query j sees keys 0 .. j)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    if keep is None and causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril_()
    return scores if keep is None else scores.masked_fill(keep.logical_not(), float("-inf"))


def finite(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with the rows that see no key (-inf: every key masked) at 0, so exp(-inf - it) is 0, not nan."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(hn)) V of one block pair, q [b, n, l, hn], k and v [b, n, lk, hn] -> (out [b, n, l, hn]
    normalised within the block, lse [b, n, l] the log-sum-exp of the block's scaled scores), masked as
    :func:`masked_scores`; a row that sees none of the block's keys gives out 0 and lse -inf."""
    scores = masked_scores(q, k, causal, keep)                           # [b, n, l, lk]
    lse = torch.logsumexp(scores, dim=-1)                                # [b, n, l]
    return torch.matmul(torch.exp(scores - finite(lse).unsqueeze(-1)), v), lse


def block_mask(mask: torch.Tensor | None, a: int, chunk: int, length: int) -> torch.Tensor | None:
    """The (query chunk ``a`` of this rank's two, global key chunk ``chunk``) block [b, 1, L, L] of a rank's mask
    [b, 1, 2L, s] (its query rows, keys in global order); None without one."""
    if mask is None:
        return None
    return mask[:, :, a * length:(a + 1) * length, chunk * length:(chunk + 1) * length]


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two partial attentions over disjoint key sets (each normalised over its keys, with its
    log-sum-exp) -> the attention over their union. ``out`` None: the first block."""
    if out is None or lse is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    scale = finite(new_lse)                                              # rows neither part sees stay 0
    out = out * torch.exp(lse - scale).unsqueeze(-1) + block_out * torch.exp(block_lse - scale).unsqueeze(-1)
    return out, new_lse


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
               k: torch.Tensor, v: torch.Tensor, theirs: tuple[int, int], mask: torch.Tensor | None = None) -> None:
    """One ring step: this rank's queries q [b, n, 2L, hn] (its chunks ``mine``) against one rank's keys and values
    k, v [b, g, 2L, hn] (chunks ``theirs``), every pair causality keeps folded into ``results`` (per query chunk the
    running (output, log-sum-exp), in place); ``mask`` as :func:`ring_attention`'s."""
    rep = q.size(1) // k.size(1)                                         # each key/value head for its n/g query heads
    k_chunks = k.repeat_interleave(rep, dim=1).chunk(2, dim=2)
    v_chunks = v.repeat_interleave(rep, dim=1).chunk(2, dim=2)
    q_chunks = q.chunk(2, dim=2)
    length = q_chunks[0].size(2)
    for a, b, causal in pairs(mine, theirs):
        keep = block_mask(mask, a, theirs[b], length)
        results[a] = merge(*results[a], *block_attention(q_chunks[a], k_chunks[b], v_chunks[b], causal, keep))


def block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, causal: bool, keep: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) one block pair contributes, its probabilities recomputed from the final
    log-sum-exp ``lse`` [b, n, l] of the query rows: P = exp(Q K^T / sqrt(hn) - lse), dV = P^T dO,
    dS = P (dO V^T - delta), dQ = dS K / sqrt(hn), dK = dS^T Q / sqrt(hn); ``delta`` [b, n, l] = rowsum(dO O);
    masked as :func:`masked_scores` (every query row sees at least itself: ``lse`` is finite)."""
    scale = 1.0 / math.sqrt(q.size(-1))
    scores = masked_scores(q, k, causal, keep)
    probs = torch.exp(scores - lse.unsqueeze(-1))                        # [b, n, l, lk]
    ds = probs * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, \
        torch.matmul(probs.transpose(-1, -2), dout)


def pairs(mine: tuple[int, int], theirs: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, causal) pairs of one ring step that causality keeps: a key chunk before the
    query chunk entirely, the same chunk as a causal triangle, a later one not at all."""
    return [(a, b, theirs[b] == mine[a]) for a in range(2) for b in range(2) if theirs[b] <= mine[a]]


class RingAttention(torch.autograd.Function):
    """Ring attention with its own backward: forward keeps only q, k, v, the output and the log-sum-exp; backward
    passes the keys and values round the ring again with their gradient accumulators (each rank adds its queries'
    share to the block it holds), and one more pass brings every accumulator home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        results: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None), (None, None)]
        kv = torch.stack([k, v])                                         # [2, b, g, s/c, hn]: one message per step
        for step in range(cp):
            fold_block(results, q, ring_chunks(rank, cp), kv[0], kv[1], ring_chunks((rank - step) % cp, cp), mask)
            if step + 1 < cp:
                kv = shift(kv, group, 1)
        out = torch.cat([o for o, _ in results], dim=2)
        lse = torch.cat([lse for _, lse in results], dim=2)              # [b, n, s/c]
        ctx.group, ctx.mask = group, mask
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, mask = ctx.group, ctx.mask
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        n, g = q.size(1), k.size(1)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)                                     # [b, n, s/c]
        dq = torch.zeros_like(q)
        q_ch, do_ch, lse_ch, delta_ch, dq_ch = (t.chunk(2, dim=2) for t in (q, dout, lse, delta, dq))
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(cp):
            kr, vr = (t.repeat_interleave(n // g, dim=1) for t in (kv[0], kv[1]))
            dk, dv = torch.zeros_like(kr), torch.zeros_like(vr)
            k_ch, v_ch, dk_ch, dv_ch = (t.chunk(2, dim=2) for t in (kr, vr, dk, dv))
            theirs = ring_chunks((rank - step) % cp, cp)
            for a, b, causal in pairs(ring_chunks(rank, cp), theirs):
                keep = block_mask(mask, a, theirs[b], q_ch[0].size(2))
                dqa, dkb, dvb = block_grads(q_ch[a], k_ch[b], v_ch[b], do_ch[a], lse_ch[a], delta_ch[a], causal, keep)
                dq_ch[a].add_(dqa)
                dk_ch[b].add_(dkb)
                dv_ch[b].add_(dvb)
            for i, d in enumerate((dk, dv)):                             # the repeated heads' gradients summed
                dkv[i] += d.unflatten(1, (g, n // g)).sum(2)
            if cp > 1:  # the accumulator travels with its keys; after the last step it goes home
                if step + 1 < cp:
                    kv = shift(kv, group, 1)
                dkv = shift(dkv, group, 1)
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence. q [b, n, s/c, hn], k and v [b, g, s/c, hn]
    (g divides n: grouped-query attention), each the rank's two chunks (:func:`ring_chunks`) one after the other
    -> [b, n, s/c, hn], the rank's rows of softmax(Q K^T / sqrt(hn) + causal) V (:class:`RingAttention`).
    ``mask``: bool [b, 1, s/c, s], True = attend, causality included (packed documents): this rank's query rows
    (in its order) against every key in global order, which every rank holds whole (the keys' document ids need
    not travel round the ring); each block pair reads its [L, L] part (:func:`block_mask`)."""
    return RingAttention.apply(q, k, v, group, mask)
