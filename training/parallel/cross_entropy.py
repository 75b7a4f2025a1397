"""Cross-entropy and per-token scores over vocabulary-parallel logits, without ever gathering the logits.

Each rank holds logits [b, s, V/p] for its vocabulary rows. Three all-reduces of b*s values each
(max, target logit, sum of exponentials) give the exact loss; the backward is analytic
(softmax - one_hot) and communicates nothing. Computed in fp32.

The caller's tensor is not modified unless it passes ``inplace=True``: then fp32 logits are overwritten
(shifted, exponentiated, finally turned into their gradient), which saves allocating and first-touching
one more logits-sized buffer (b*s*V/p floats: 206 MB for the CPU benchmark model, where that fresh
allocation cost more than the subtraction itself). Only for a caller that owns the logits and never reads
them again, e.g. ``GPTModel.forward`` (the output layer's backward needs its input and weight, not its
output).

:func:`vocab_parallel_token_scores` is the evaluation form (no autograd): per-token negative
log-likelihood and greedy correctness over the *real* vocabulary, padding columns excluded.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from training.parallel.mappings import all_reduce, group_rank, group_size
from training.parallel.utils import vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None,
                inplace: bool, vocab_size: int | None) -> torch.Tensor:
        # logits [b, s, V/p] any float dtype; target [b, s] global ids
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()  # fp16/bf16 logits: the loss is computed in fp32, on our own copy
            inplace = True
        v_local = logits.size(-1)
        start, end = vocab_range(v_local * group_size(group), group_rank(group), group_size(group))
        if vocab_size is not None and end > vocab_size:  # padding columns held here: out of the softmax
            logits = logits if inplace else logits.clone()
            inplace = True
            logits[..., max(0, vocab_size - start):] = float("-inf")
        logits_max = logits.amax(dim=-1)                                    # [b, s]
        all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        # a new tensor [b, s, V/p] unless the logits are ours to overwrite
        shifted = logits.sub_(logits_max.unsqueeze(-1)) if inplace else logits - logits_max.unsqueeze(-1)

        foreign = (target < start) | (target >= end)                        # [b, s]
        local_target = (target - start).masked_fill(foreign, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(foreign, 0.0)
        all_reduce(target_logit, group)                                     # exactly one rank contributes

        exp = shifted.exp_()                                                # in place: `shifted` is ours
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = torch.log(sum_exp) - target_logit                            # [b, s]

        # softmax = exp / sum_exp is never formed here: backward folds 1/sum_exp into its one pass
        ctx.save_for_backward(exp, sum_exp, foreign, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        exp, sum_exp, foreign, local_target = ctx.saved_tensors
        # d loss / d logit = (exp / sum_exp - 1[target]) * grad_loss, the 1[target] only on the rank
        # owning the target; one pass over the saved buffer (backward runs once, so it is reused)
        grad = exp.mul_((grad_loss / sum_exp).unsqueeze(-1))
        own = (~foreign).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(own * grad_loss).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None = None,
                                 inplace: bool = False, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [b, s] from vocab-parallel logits [b, s, V/p] and global targets [b, s].

    ``inplace=True``: the logits' memory is reused (their values are destroyed); see the module docstring.
    ``vocab_size``: the real vocabulary; the padding columns (global id >= ``vocab_size``) are left out of the
    softmax (``model.mask_vocab_padding``: the loss then does not depend on how much padding the TP degree adds;
    Megatron keeps them in, the default here too)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, inplace, vocab_size)


def vocab_parallel_token_scores(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, vocab_start: int = 0,
                                group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nll [b, s] fp32, correct [b, s] bool)`` from (vocab-parallel) ``logits [b, s, V_local]``.

    For global target ids ``y [b, s]``, in fp32 over the columns ``v < vocab_size``:

        nll[b, t]     = logsumexp_v z[b, t, v] - z[b, t, y]          (natural log, = cross-entropy)
        correct[b, t] = (argmax_v z[b, t, v] == y)                   (first index on ties, like torch.argmax)

    This rank holds the columns ``[vocab_start, vocab_start + V_local)``; ``group`` is the tensor-parallel
    group holding the others (None at TP = 1). Columns with global id >= ``vocab_size`` (Megatron's
    vocabulary padding) are ignored; pass the padded size to include them, as
    :func:`vocab_parallel_cross_entropy` does. Four all-reduces of b*s values (max, argmax, sum of
    exponentials, target logit).
    """
    z = logits.float()
    v_local = z.size(-1)
    n_real = max(0, min(v_local, vocab_size - vocab_start))  # real columns held here
    z = z[..., :n_real]
    big = torch.finfo(torch.float32).max
    if n_real > 0:
        local_max, local_arg = z.max(dim=-1)  # first maximal index on ties
    else:
        local_max = torch.full(labels.shape, -big, device=z.device)
        local_arg = torch.zeros(labels.shape, dtype=torch.long, device=z.device)
    gmax = local_max.clone()
    all_reduce(gmax, group, dist.ReduceOp.MAX)

    # global argmax = smallest global index among ranks whose local max equals the global max
    cand = torch.where(local_max == gmax, local_arg + vocab_start, torch.full_like(local_arg, 2**62))
    all_reduce(cand, group, dist.ReduceOp.MIN)

    sum_exp = (z - gmax.unsqueeze(-1)).exp().sum(dim=-1) if n_real > 0 else torch.zeros_like(gmax)
    all_reduce(sum_exp, group)

    local_idx = labels - vocab_start
    mine = (local_idx >= 0) & (local_idx < n_real)
    tgt = torch.zeros_like(gmax)
    if n_real > 0:
        tgt = z.gather(-1, local_idx.clamp(0, n_real - 1).unsqueeze(-1)).squeeze(-1)
        tgt = torch.where(mine, tgt, torch.zeros_like(tgt))
    all_reduce(tgt, group)
    nll = torch.log(sum_exp) + gmax - tgt
    return nll, cand == labels
