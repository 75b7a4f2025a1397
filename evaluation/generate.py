"""Text generation from a GPT checkpoint: greedy or sampled (temperature, top-k, top-p), KV cache, batches.

    python -m evaluation generate --checkpoint RUN_DIR --prompt "Once upon a time" [--max-new-tokens 64]
        [--greedy | --temperature T --top-k K --top-p P --seed S] [--no-stop-at-eod] [--prompts FILE]
    deepspeed --num_gpus 2 --module evaluation generate --tp 2 --checkpoint RUN_DIR --prompt ...

From Python::

    from evaluation.generate import GenerationOptions, generate, load_generator
    model, tokenizer = load_generator("runs/gpt2")            # any training TP/PP, one process
    out = generate(model, tokenizer, ["Hello"], GenerationOptions(max_new_tokens=20, greedy=True))
    out[0].text

How: prompts are left-padded into one batch (pad keys masked, positions counted from each prompt's
first real token, as transformers does), one forward over the prompts fills a key/value cache
pre-allocated for ``prompt + max_new_tokens`` positions, then each step feeds only the new token.
Both are the model's own forward with a :class:`~training.models.kv_cache.KVCache` (``GPT2Model.hidden_states``
then its output layer, on the last position only); this module is the loop around it. At TP = k every rank
holds n/k heads and the all-gathered full-vocabulary logits, and the token chosen on TP rank 0 is broadcast
so the ranks can never drift apart.

Choosing the next token: over the real vocabulary only (padding columns cut off, so the padded width of a
checkpoint changes nothing); greedy = argmax; otherwise
logits / temperature, then top-k (keep the k largest, ties with the k-th included), then top-p
(keep the smallest most-probable prefix whose probability reaches p), then one draw from a CPU
``torch.Generator`` seeded with ``seed`` (the same draws on CPU and GPU). A row stops at the end-of-
document id (not included in the output) unless ``stop_at_eod`` is off.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from evaluation.errors import EvalError
from megatron_ds_suite.core.textfile import BadJsonLine, json_line, read_utf8
from training.models.kv_cache import KVCache
from training.parallel.mappings import gather_from_parallel_region

logger = logging.getLogger(__name__)


@dataclass
class GenerationOptions:
    max_new_tokens: int = 64
    """New tokens per prompt at most (fewer when the end-of-document id is drawn)."""
    greedy: bool = False
    """Argmax decoding; temperature/top-k/top-p/seed are then ignored."""
    temperature: float = 1.0
    top_k: int = 0
    """Keep only the k most probable tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most probable tokens with probability >= p (1.0 = off)."""
    seed: int = 1234
    stop_at_eod: bool = True
    batch_size: int = 8
    """Prompts per forward."""

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise EvalError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise EvalError(f"temperature must be a finite number > 0 (use greedy decoding for argmax), got "
                            f"{self.temperature}")
        if self.top_k < 0:
            raise EvalError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise EvalError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise EvalError(f"batch_size must be >= 1, got {self.batch_size}")


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    """Generated ids (the end-of-document id that stopped the row is not included)."""
    text: str
    stopped_at_eod: bool


# --------------------------------------------------------------------------------------------------
# Next-token choice
# --------------------------------------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[b, V] logits -> temperature-scaled logits with -inf outside the top-k / top-p set."""
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]          # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs                               # mass of the more probable tokens
        drop_sorted = before >= top_p                                       # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose_next(logits: torch.Tensor, opts: GenerationOptions, generator: torch.Generator) -> torch.Tensor:
    """[b, V] full-vocabulary logits -> [b] next ids (on the logits' device).

    Logits that are not all finite (a NaN or infinite weight: a damaged or diverged checkpoint) or that overflow
    once divided by the temperature raise :class:`EvalError`: argmax would pick a NaN's position and
    ``torch.multinomial`` fails on a NaN probability."""
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise EvalError(f"the model's next-token logits hold {bad} non-finite value(s) (NaN or infinity): the "
                        f"checkpoint's weights are damaged or its training diverged; evaluate an earlier checkpoint")
    if opts.greedy:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits, opts.temperature, opts.top_k, opts.top_p)
    if not bool(torch.isfinite(scaled.max(dim=-1).values).all()) or bool(torch.isnan(scaled).any()):
        raise EvalError(f"temperature {opts.temperature} is too small for these logits (divided by it they overflow "
                        f"float32): use greedy decoding or a larger temperature")
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)


# --------------------------------------------------------------------------------------------------
# The model's cached forward
# --------------------------------------------------------------------------------------------------
def forward_cached(model, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
    """Feed t new tokens [b, t] (positions [b, t]; ``valid`` [b, T_max] marks real tokens) through the model's
    own forward with ``cache`` and return the full-vocabulary logits of the last one [b, V_padded]."""
    cache.valid = valid
    hidden = model.hidden_states(tokens, positions, cache)[:, -1]          # [b, h]
    return gather_from_parallel_region(model.output_logits(hidden), model.group)  # [b, V/p] -> [b, V]


def _broadcast(ids: torch.Tensor, group) -> torch.Tensor:
    """TP rank 0's choice to every rank of the group (identical logits make it a no-op in value)."""
    if group is None or dist.get_world_size(group) == 1:
        return ids
    dist.broadcast(ids, src=dist.get_global_rank(group, 0), group=group)
    return ids


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], opts: GenerationOptions, eod: int | None,
                 vocab_size: int) -> list[tuple[list[int], bool]]:
    """Token-level generation for one batch: (new ids, stopped at EOD) per prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise EvalError("every prompt needs at least one token (an empty prompt has nothing to continue)")
    device = model.embedding.word_embeddings.weight.device
    dtype = model.embedding.word_embeddings.weight.dtype
    positions_max = model.cfg.positions
    longest = max(len(p) for p in prompts)
    total = longest + opts.max_new_tokens
    if total > positions_max:
        raise EvalError(f"a prompt of {longest} tokens + max_new_tokens {opts.max_new_tokens} exceeds the model's "
                        f"{positions_max} positions: shorten the prompt or lower --max-new-tokens")
    b = len(prompts)
    tokens = torch.full((b, longest), eod if eod is not None else 0, dtype=torch.long)
    valid = torch.ones((b, total), dtype=torch.bool)                        # False: a pad key, never attended
    for i, p in enumerate(prompts):                                         # left padding
        tokens[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, :longest - len(p)] = False
    pad = (longest - torch.tensor([len(p) for p in prompts]))[:, None]     # [b, 1]
    positions = (torch.arange(longest)[None, :] - pad).clamp(min=0)
    tokens, valid, positions, pad = tokens.to(device), valid.to(device), positions.to(device), pad.to(device)
    cache = KVCache(model, b, total, device, dtype)
    generator = torch.Generator().manual_seed(opts.seed)
    logits = forward_cached(model, tokens, positions, valid, cache)
    out = torch.empty((b, 0), dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(opts.max_new_tokens):
        # the real vocabulary only: with the padding rows merely masked, multinomial (and top-k/top-p) would see
        # the padded width, and the same weights saved at another padding would sample other tokens
        nxt = _broadcast(choose_next(logits[:, :vocab_size], opts, generator), model.group)
        if eod is not None and opts.stop_at_eod:
            nxt = torch.where(done, torch.full_like(nxt, eod), nxt)
            done |= nxt == eod
        out = torch.cat([out, nxt[:, None]], dim=1)
        if bool(done.all()) or step == opts.max_new_tokens - 1:
            break
        pos = torch.full((b, 1), longest + step, device=device) - pad
        logits = forward_cached(model, nxt[:, None], pos, valid, cache)
    result = []
    for row in out.tolist():
        stopped = eod is not None and opts.stop_at_eod and eod in row
        result.append((row[:row.index(eod)] if stopped else row, stopped))
    return result


def generate(model, tokenizer, prompts: list[str] | list[list[int]], opts: GenerationOptions | None = None,
             progress: bool = False) -> list[Completion]:
    """Continue each prompt (text, or token ids) with ``model`` (a GPT2Model at any TP degree, every
    rank of its TP group calling this with the same arguments)."""
    from tqdm import tqdm

    opts = opts or GenerationOptions()
    opts.check()
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if any(len(p) == 0 for p in ids):
        raise EvalError("an empty prompt has nothing to continue: give every prompt some text")
    was_training = model.training
    model.eval()
    completions = []
    try:
        for s in tqdm(range(0, len(ids), opts.batch_size), desc="generate", unit="batch", disable=not progress,
                      leave=False):
            batch = ids[s:s + opts.batch_size]
            for p, (new, stopped) in zip(batch, generate_ids(model, batch, opts, tokenizer.eod, tokenizer.vocab_size)):
                completions.append(Completion(p, new, tokenizer.decode(new), stopped))
    finally:
        model.train(was_training)
    return completions


def load_generator(run_dir: str | Path, group=None, device: str = "cpu"):
    """(GPT2Model, tokenizer) of a checkpoint, split for ``group``'s TP degree (None = one process)."""
    from training.checkpoint_reader import load_model_for_eval

    p = Path(run_dir)
    if not p.is_dir():
        raise EvalError(f"checkpoint directory {p} does not exist")
    model, cfg, tokenizer = load_model_for_eval(p, group=group, device=device)
    if cfg.model.arch == "bert":
        raise EvalError(f"{p} holds a {cfg.model.arch!r} model; generation needs a GPT (causal LM) checkpoint")
    return model, tokenizer


def utf8_prompts(prompts: list[str], what: str = "--prompt") -> list[str]:
    """Prompts given on the command line, refused in one line when one is not UTF-8 text: Python reads such
    argument bytes as lone surrogates (``\\udcff`` for byte 0xff), which no tokenizer encodes and no UTF-8 output
    can print."""
    for n, text in enumerate(prompts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
            which = f" (byte 0x{byte:02x} at character {e.start})" if byte is not None else f" (at character {e.start})"
            raise EvalError(f"{what} number {n} is not UTF-8 text{which}: pass prompts as UTF-8 (check the "
                            f"terminal's encoding), or write them to a UTF-8 file for --prompts") from None
    return prompts


def read_prompts(path: str | Path) -> list[str]:
    """``.jsonl``: one ``{"prompt": ...}`` (or ``{"text": ...}``) per line; otherwise one prompt per
    non-blank line."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"--prompts {p} does not exist")
    lines = read_utf8(p, "--prompts", EvalError).splitlines()
    if p.suffix != ".jsonl":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json_line(line)
            except BadJsonLine as e:
                raise EvalError(f"{p}:{n}: not JSON ({e})") from None
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise EvalError(f'{p}:{n}: expected {{"prompt": "..."}}')
            prompts.append(text)
    if not prompts:
        raise EvalError(f"--prompts {p} holds no prompts")
    return prompts
