"""Per-token scores (NLL and greedy-correctness) from a language model's logits, TP-aware.

A model is seen through :data:`LogitsFn`: ``tokens [b, s] (int64) -> logits [b, s, V_local]``. At
TP = 1 ``V_local`` is the whole (possibly padded) vocabulary; under tensor parallelism each rank holds
the columns ``[vocab_start, vocab_start + V_local)`` of the padded vocabulary, and the scores below
are computed *without gathering the logits* (three all-reduces of ``b*s`` numbers + one for argmax) by
:func:`training.parallel.cross_entropy.vocab_parallel_token_scores` (imported here as ``token_scores``).

For targets ``y [b, s]`` (global ids) the scores are, in fp32,

    nll[b, t]     = logsumexp_v z[b, t, v] - z[b, t, y]          (natural log, = cross-entropy)
    correct[b, t] = (argmax_v z[b, t, v] == y)                   (first index on ties, like torch.argmax)

where v runs over the **real** vocabulary ``v < vocab_size``: Megatron's padding columns (ids that no
tokenizer produces) are excluded, so the numbers equal those of the exported Hugging Face model and of
lm-evaluation-harness. Pass ``vocab_size = padded size`` to include them, as Megatron's vocab-parallel
cross-entropy does (the difference is the probability mass a trained model leaves on padding rows).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.parallel.cross_entropy import vocab_parallel_token_scores as token_scores
from training.runtime import device as tdev

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""tokens [b, s] int64 -> logits [b, s, V_local] (any float dtype; this rank's vocabulary columns)."""


@dataclass
class LMScorer:
    """A language model plus what is needed to score tokens with it.

    ``vocab_size``: real vocabulary (columns beyond it are padding and excluded, see module doc);
    ``vocab_start``/``tp_group``: this rank's first vocabulary column and TP group (TP > 1 only).
    """

    logits_fn: LogitsFn
    vocab_size: int
    max_length: int
    """Longest input the model accepts (its position table)."""
    device: torch.device = torch.device("cpu")
    vocab_start: int = 0
    tp_group: dist.ProcessGroup | None = None
    hidden_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Optional split of ``logits_fn`` = ``head_fn(hidden_fn(tokens))``: tokens [b, s] -> hidden [b, s, h]."""
    head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    """hidden [n, h] -> logits [n, V_local]; applied only to the scored positions (see :meth:`score`)."""

    @torch.no_grad()
    def score(self, inputs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs``, ``labels`` [b, s] (labels = inputs shifted by one) -> (nll, correct) [b, s] on CPU.

        With ``mask`` and a ``hidden_fn``/``head_fn`` split, the output layer and the scores are computed
        only where ``mask`` is set (elsewhere nll = 0, correct = False): with stride-32 windows of 1,024
        tokens this skips 31/32 of the ``[b, s, V]`` logits, the dominant cost of a small model.
        """
        if inputs.size(1) > self.max_length:
            raise ValueError(f"input length {inputs.size(1)} exceeds the model's {self.max_length} positions")
        inputs, labels, mask = tdev.to_device((inputs, labels, mask), self.device)
        if mask is not None and self.hidden_fn is not None and self.head_fn is not None:
            sel = mask.bool()
            h = self.hidden_fn(inputs)                                      # [b, s, h]
            nll_sel, ok_sel = token_scores(self.head_fn(h[sel]), labels[sel], self.vocab_size, self.vocab_start,
                                           self.tp_group)                   # [n]
            nll = torch.zeros(labels.shape, dtype=torch.float32, device=self.device)
            ok = torch.zeros(labels.shape, dtype=torch.bool, device=self.device)
            nll[sel], ok[sel] = nll_sel, ok_sel
            return nll.cpu(), ok.cpu()
        logits = self.logits_fn(inputs)
        nll, correct = token_scores(logits, labels, self.vocab_size, self.vocab_start, self.tp_group)
        return nll.cpu(), correct.cpu()


def gpt2_scorer(model, vocab_size: int, max_length: int, device: torch.device = torch.device("cpu"),
                vocab_start: int = 0, tp_group: dist.ProcessGroup | None = None) -> LMScorer:
    """Scorer for ``training.models.gpt2.GPT2Model``: hidden states, then the model's tied (vocab-parallel)
    output layer (``output_logits``) on the scored positions only."""
    return LMScorer(model, vocab_size, max_length, device, vocab_start, tp_group,
                    hidden_fn=model.hidden_states, head_fn=model.output_logits)
