"""lm-evaluation-harness on our own checkpoints, at any TP degree, without exporting them.

:class:`SuiteLM` is an lm-eval model (``lm_eval.api.model.TemplateLM``) over the project's TP-aware scorer
(:mod:`evaluation.scoring`) and generator (:mod:`evaluation.generate`), so lm-eval's own tasks, prompts and
metrics run on a training run directory, as GPT-NeoX's ``eval.py`` and Megatron-DeepSpeed's
``tasks/eval_harness`` offer. A checkpoint saved at any TP/PP degree loads (the shards are merged and re-split
for this run's ``tp``).

Conventions are lm-eval's, as its ``HFLM`` applies them to the exported model, so the two agree example by
example (``tests/parallel/test_eval_lmeval.py``):

* ``loglikelihood``: lm-eval's own context/continuation encoding (``TemplateLM``: trailing context spaces move
  to the continuation; an empty context is the end-of-document token); the input is the last ``max_length + 1``
  tokens of context + continuation, shifted; the score is the summed log-probability of the continuation's
  tokens over the **real** vocabulary (Megatron's padding columns excluded, as in the export) and whether each
  of them is the argmax.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, the first one
  conditioned on the end-of-document token.
* ``generate_until``: greedy unless the task asks for sampling; the context keeps its last
  ``max_length - max_gen_toks`` tokens; the text is cut at the first stop string.

Tensor parallelism: every rank of the TP group runs the same requests in the same order (lm-eval sees one
process, ``rank`` 0 of ``world_size`` 1), and the vocabulary-parallel scores need no gather; only the main
process prints and writes. Data parallelism over several replicas is not offered: launch exactly ``tp``
processes.
"""
from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from evaluation.generate import GenerationOptions, generate_ids
from evaluation.model import Runtime, load_scorer
from evaluation.scoring import LMScorer


class SuiteLM(TemplateLM):
    """An lm-eval model over a scorer of this project's GPT (every rank of its TP group builds one): a checkpoint
    (:meth:`from_checkpoint`) or the model being trained (:mod:`evaluation.lm_eval_train`); ``name`` says which."""

    def __init__(self, scorer: LMScorer, tok, name: str, batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        self.scorer, self.tok = scorer, tok
        self.model = self.scorer.logits_fn
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.run_dir = str(name)

    @classmethod
    def from_checkpoint(cls, run_dir: str, runtime: Runtime, batch_size: int = 8, max_gen_toks: int = 256) -> SuiteLM:
        """Over the newest checkpoint in ``run_dir`` (any training TP/PP, re-split for ``runtime``'s TP)."""
        scorer, _, tok = load_scorer(run_dir, runtime)
        return cls(scorer, tok, str(run_dir), batch_size, max_gen_toks)

    # -- what TemplateLM needs --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        return f"megatron_ds_suite:{self.run_dir}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tok.encode(string))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ``(key, context ids, continuation ids)`` -> ``(log-likelihood, is greedy)`` each, in order.

        Longest first (fewest padded positions), answers put back in request order."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            rows, spans = [], []
            for i in idx:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
                whole = (list(context) + list(continuation))[-(self.max_length + 1):]
                rows.append(whole)
                spans.append(min(len(continuation), len(whole) - 1))
            width = max(len(r) for r in rows) - 1
            inputs = torch.full((len(rows), width), self.tok.eod, dtype=torch.long)
            labels = torch.full((len(rows), width), self.tok.eod, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.bool)
            for r, (row, n) in enumerate(zip(rows, spans)):                 # right padding: causal, so harmless
                t = torch.tensor(row, dtype=torch.long)
                inputs[r, :len(row) - 1], labels[r, :len(row) - 1] = t[:-1], t[1:]
                mask[r, len(row) - 1 - n:len(row) - 1] = True
            nll, correct = self.scorer.score(inputs, labels, mask)
            for r, i in enumerate(idx):
                m = mask[r]
                out[i] = (-float(nll[r][m].double().sum()), bool(correct[r][m].all()))
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, scored in lm-eval's disjoint windows of ``max_length`` tokens."""
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string or ``max_gen_toks`` tokens (greedy unless ``do_sample``)."""
        results = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            max_new = max(1, min(max_new, self.max_length - 1))
            sample = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature", 1.0) or 0.0) > 0.0
            opts = GenerationOptions(max_new_tokens=max_new, greedy=not sample,
                                     temperature=float(kwargs.get("temperature", 1.0) or 1.0),
                                     top_k=int(kwargs.get("top_k", 0) or 0), top_p=float(kwargs.get("top_p", 1.0) or 1.0))
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
            (new, _), = generate_ids(self.model, [ids], opts, self.tok.eod, self.tok.vocab_size)
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            results.append(text)
        return results
