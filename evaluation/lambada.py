"""LAMBADA last-word prediction the way Megatron scores it (evaluation.md §3).

* **strict** (default; Megatron ``--strict-lambada``, the README's choice): ``last_word =
  text.split()[-1]``; ``start = text.rfind(last_word)``; context = ``encode(text[:start].strip())``;
  target = ``encode(" " + last_word)`` -- every BPE piece of the word. Correct only if *every* target
  token is the argmax under teacher forcing (= greedy decoding of the whole word; the same criterion as
  lm-evaluation-harness ``lambada_openai`` ``acc``).
* **last-token** (Megatron's default, easier): context = all tokens of ``encode(text)`` but the last,
  target = the last token only.

No BOS/EOD prefix. Examples are scored in batches of similar length, right-padded with EOD (padding is
after the targets, so a causal model's scores are unaffected). A context longer than the model's
positions is cut from the left (counted in ``truncated``; Megatron assumes it fits).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from evaluation.errors import EvalError
from evaluation.scoring import LMScorer
from megatron_ds_suite.core.hf_datasets import check_no_script, load_hf_dataset
from megatron_ds_suite.core.textfile import BadJsonLine, json_line

logger = logging.getLogger(__name__)


def read_lambada_jsonl(path: str | Path, key: str = "text") -> list[str]:
    """Texts of a ``{"text": ...}`` JSON-lines file; errors name the offending line number."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"LAMBADA file {p} does not exist or is not a file")
    texts: list[str] = []
    try:
        with open(p, encoding="utf-8-sig") as f:  # -sig: a UTF-8 byte-order mark is not part of line 1
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    raise EvalError(f"{p}:{lineno}: empty line (expected one JSON object per line)")
                try:
                    obj = json_line(line)
                except BadJsonLine as e:
                    raise EvalError(f"{p}:{lineno}: malformed JSON ({e})") from None
                if not isinstance(obj, dict) or key not in obj:
                    raise EvalError(f"{p}:{lineno}: missing key {key!r} (expected {{\"{key}\": \"...\"}})")
                if not isinstance(obj[key], str) or not obj[key].split():
                    raise EvalError(f"{p}:{lineno}: {key!r} must be a non-empty string")
                texts.append(obj[key])
    except UnicodeDecodeError as e:
        raise EvalError(f"LAMBADA file {p} is not UTF-8 text (byte {e.start})") from None
    if not texts:
        raise EvalError(f"LAMBADA file {p} is empty")
    return texts


def read_hf_lambada(name: str, split: str = "test", column: str = "text") -> list[str]:
    """``NAME[:CONFIG]`` via ``datasets.load_dataset`` (e.g. ``EleutherAI/lambada_openai:en``)."""
    ds_name, _, config = name.partition(":")
    check_no_script(ds_name)  # a loading script is refused (one line), never run
    try:
        ds = load_hf_dataset(ds_name, config or None, split=split)
    except Exception as e:  # noqa: BLE001
        raise EvalError(f"cannot load dataset {name!r} split {split!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if column not in ds.column_names:
        raise EvalError(f"dataset {name!r} has no {column!r} column (columns: {', '.join(ds.column_names)})")
    texts = list(ds[column])
    if not texts:
        raise EvalError(f"dataset {name!r} split {split!r} is empty")
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.split():
            raise EvalError(f"dataset {name!r} row {i}: {column!r} must be a non-empty string")
    return texts


@dataclass
class LambadaExample:
    context: list[int]
    target: list[int]


def strict_split(text: str) -> tuple[str, str]:
    """``(context_text, target_text)`` of the strict formulation (Megatron ``get_tokens``)."""
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return text[:start].strip(), " " + last_word


def build_examples(texts: list[str], tokenizer, strict: bool = True) -> list[LambadaExample]:
    """Token ids of context and target for every text (batched tokenization)."""
    if strict:
        pairs = [strict_split(t) for t in texts]
        ctx = tokenizer.encode_batch([c for c, _ in pairs])
        tgt = tokenizer.encode_batch([w for _, w in pairs])
        out = [LambadaExample(list(c), list(w)) for c, w in zip(ctx, tgt)]
    else:
        out = []
        for ids in tokenizer.encode_batch(texts):
            out.append(LambadaExample(list(ids[:-1]), list(ids[-1:])))
    for i, ex in enumerate(out):
        if not ex.target:
            raise EvalError(f"LAMBADA example {i}: the target word tokenizes to nothing")
        if not ex.context:
            raise EvalError(f"LAMBADA example {i}: empty context (text has a single token/word)")
    return out


@dataclass
class LambadaScores:
    correct: np.ndarray  # [n] int64, 1 = all target tokens greedy
    target_logprob: np.ndarray  # [n] float64, Σ log p(target tokens)
    target_tokens: np.ndarray  # [n] int64
    truncated: int


def score_lambada(
    scorer: LMScorer,
    examples: list[LambadaExample],
    pad_id: int,
    batch_size: int = 16,
    dp_rank: int = 0,
    dp_world: int = 1,
    dp_group: dist.ProcessGroup | None = None,
    progress: bool = True,
) -> LambadaScores:
    """Teacher-forced scores of every example; each index scored once over data parallel.

    Sequence = context + target; the scored positions are the last ``len(target)`` labels.
    """
    n = len(examples)
    correct = torch.zeros(n, dtype=torch.float64)
    logprob = torch.zeros(n, dtype=torch.float64)
    ntok = torch.zeros(n, dtype=torch.float64)
    truncated = torch.zeros(1, dtype=torch.float64)
    limit = scorer.max_length + 1  # tokens (inputs + 1 label)
    order = sorted(range(n), key=lambda i: len(examples[i].context) + len(examples[i].target))
    mine = order[dp_rank::dp_world]
    bar = tqdm(total=len(mine), desc="lambada", unit="ex", disable=not progress)
    for b in range(0, len(mine), batch_size):
        idx = mine[b : b + batch_size]
        seqs, tlens = [], []
        for i in idx:
            ex = examples[i]
            if len(ex.target) >= limit:
                raise EvalError(f"LAMBADA example {i}: target of {len(ex.target)} tokens does not fit {scorer.max_length} positions")
            seq = ex.context + ex.target
            if len(seq) > limit:
                seq = seq[len(seq) - limit :]
                truncated += 1
            seqs.append(seq)
            tlens.append(len(ex.target))
        width = max(len(s) for s in seqs)
        toks = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
        for r, (s, t) in enumerate(zip(seqs, tlens)):
            toks[r, : len(s)] = torch.tensor(s)
            mask[r, len(s) - 1 - t : len(s) - 1] = True
        nll, ok = scorer.score(toks[:, :-1], toks[:, 1:], mask)
        for r, i in enumerate(idx):
            m = mask[r]
            correct[i] = float(bool(ok[r][m].all()))
            logprob[i] = -nll[r][m].double().sum()
            ntok[i] = float(m.sum())
        bar.update(len(idx))
    bar.close()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        # each index is filled on exactly one rank; summed as one tensor on the model's device (NCCL)
        packed = torch.cat([correct, logprob, ntok, truncated]).to(scorer.device)
        dist.all_reduce(packed, group=dp_group)
        correct, logprob, ntok, truncated = packed.cpu().split([n, n, n, 1])
    return LambadaScores(correct.long().numpy(), logprob.numpy(), ntok.long().numpy(), int(truncated.item()))
