"""Per-step metrics: one rank-0 log line with a fixed key order, RUN_DIR/metrics.jsonl, TensorBoard.

FLOPs per iteration follow Narayanan et al. 2021 (eq. 3): model FLOPs (what MFU counts, no
recomputation) = 72 B s l h^2 (1 + s/(6h)) + 6 B s h V; activation checkpointing adds one more
forward of the transformer layers (hardware FLOPs, 96 instead of 72), which MFU does not credit.
BERT (:func:`bert_flops_per_iteration`) has the same transformer layers but projects to the
vocabulary only at its masked positions, plus a pooler and the sentence-order head;
:func:`flops_per_iteration` picks the count for ``cfg.model.arch``.
"""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

logger = logging.getLogger("training")

KEYS = ("iteration", "lr", "loss", "loss_scale", "grad_norm", "skipped", "tokens_per_s", "tflops_per_device", "mfu")


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                              ffn: int | None = None) -> float:
    """Forward + backward model FLOPs of one iteration over ``batch`` sequences (no recomputation)."""
    ffn = ffn or 4 * hidden
    # per layer forward: QKV 6bsh^2 + proj 2bsh^2 + MLP 4bsh*ffn + attention 4bs^2h ; x3 for fwd+bwd
    per_layer = 2 * batch * seq * hidden * (4 * hidden + 2 * ffn) + 4 * batch * seq * seq * hidden
    logits = 2 * batch * seq * hidden * vocab
    return 3.0 * (layers * per_layer + logits)


def bert_expected_masked_positions(masked_lm_prob: float, short_seq_prob: float, seq: int) -> float:
    """Expected number of masked (predicted) positions of one BERT pretraining sequence of length ``seq``.

    ``training.data.bert_data.mask_tokens`` masks ``max(1, round(masked_lm_prob * n))`` tokens, capped at
    ``masked_lm_prob`` x the sample's target length (Megatron's float cap), of a sample of ``n`` real
    tokens (whole-word spans may stop short of it; none when ``masked_lm_prob`` is 0). ``n`` is
    random per sample (``build_samples_mapping``): ``seq`` with probability ``1 - short_seq_prob``, else a
    target uniform in [2, seq - 3] plus [CLS]/[SEP]/[SEP], mean ``(seq + 5) / 2``. So

        E[m] = masked_lm_prob * ((1 - short_seq_prob) * seq + short_seq_prob * (seq + 5) / 2)

    (rounding and the floor of 1 ignored). It is an upper bound in practice: a document that ends before
    the target gives a shorter sample, and spans may not fill the budget exactly.
    """
    if masked_lm_prob <= 0:
        return 0.0
    return masked_lm_prob * ((1.0 - short_seq_prob) * seq + short_seq_prob * (seq + 5) / 2.0)


def bert_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int, masked: float,
                             ffn: int | None = None, binary_head: bool = True) -> float:
    """Forward + backward model FLOPs of one BERT pretraining iteration (``training.models.bert``).

    A matmul of [n, k] x [k, j] costs 2 n k j FLOPs; the backward computes the gradients of both
    operands (two matmuls of the same size), so forward + backward = 3 x forward. Per sequence of
    ``s = seq`` positions (padding included: the encoder runs on all of them), forward:

    * each of the ``l`` layers: QKV 2 s h 3h + output projection 2 s h h + MLP 2 * 2 s h f
      + attention scores Q K^T 2 s^2 h + probabilities x V 2 s^2 h
      = 2 s h (4h + 2f) + 4 s^2 h  (with f = 4h: 24 s h^2 + 4 s^2 h, as in Narayanan et al.);
    * the MLM head only at the ``m = masked`` positions (``x[loss_mask]``): dense 2 m h^2 and the tied
      vocabulary projection 2 m h V (GeLU, LayerNorm, bias and cross-entropy are not matmuls);
    * with the sentence-order head (``binary_head``): pooler dense at [CLS] 2 h^2, SOP Linear(h, 2) 4 h.

    Total: 3 B [ l (2 s h (4h + 2f) + 4 s^2 h) + 2 m h (h + V) + (2 h^2 + 4 h) ]. Against the GPT
    formula this replaces the 2 s h V logits (every position) by 2 m h (h + V); with m ~ 0.15 s the
    GPT count overstates BERT's FLOPs by the difference (~8 % for the 336M model).
    ``masked``: masked positions per sequence, :func:`bert_expected_masked_positions` for pretraining.
    Not counted (not matmuls): softmax, LayerNorm, GeLU, dropout, embedding lookups.
    """
    ffn = ffn or 4 * hidden
    per_layer = 2 * seq * hidden * (4 * hidden + 2 * ffn) + 4 * seq * seq * hidden
    mlm_head = 2 * masked * hidden * (hidden + vocab)
    sop_head = (2 * hidden * hidden + 4 * hidden) if binary_head else 0
    return 3.0 * batch * (layers * per_layer + mlm_head + sop_head)


def flops_per_iteration(cfg, padded_vocab: int) -> float:
    """Model FLOPs of one iteration of ``cfg`` (a ``training.config.Config``) for its ``model.arch``."""
    m, t = cfg.model, cfg.train
    if m.arch == "bert":
        masked = bert_expected_masked_positions(cfg.bert.masked_lm_prob, cfg.bert.short_seq_prob, m.seq_length)
        return bert_flops_per_iteration(t.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, padded_vocab,
                                        masked, m.ffn_size, m.binary_head)
    return model_flops_per_iteration(t.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, padded_vocab,
                                     m.ffn_size)


def progress_enabled(setting: bool | None, stream=None) -> bool:
    """Whether to draw a progress bar: ``train.progress_bar`` when set, else only when ``stream`` (stderr)
    is a terminal (a bar redrawn with carriage returns is noise in a Slurm or CI log file)."""
    if setting is not None:
        return setting
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def format_line(m: dict, total_iters: int) -> str:
    def f(v, spec):
        return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    # consumed samples and ms/iteration: the fields Megatron users grep for (optional for other callers)
    samples = f" | consumed samples {m['consumed_samples']:,}" if m.get("consumed_samples") is not None else ""
    ms = f" | ms/iter {f(1000 * m['step_time_s'], '.1f')}" if m.get("step_time_s") is not None else ""
    return (f"iter {m['iteration']:>6d}/{total_iters}{samples}{ms} | lr {f(m['lr'], '.3e')} | loss {f(m['loss'], '.4f')} | "
            f"loss scale {f(m['loss_scale'], '.0f')} | grad norm {f(m['grad_norm'], '.3f')} | "
            f"skipped {m['skipped']} | tokens/s {f(m['tokens_per_s'], ',.0f')} | "
            f"TFLOP/s/device {f(m['tflops_per_device'], '.3f')} | MFU {f(100 * m['mfu'] if m['mfu'] is not None else None, '.2f')}%")


def kept_metric_lines(path: Path, resume_iteration: int) -> list[str]:
    """The rows of ``path`` up to ``resume_iteration``. A line that is not a complete JSON row (a write
    cut short by a kill or a full disk, typically the last one) is dropped with a warning instead of
    making every resume crash."""
    keep, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                it = int(row["iteration"])
            except (ValueError, TypeError, KeyError):
                bad.append(lineno)
                continue
            if it <= resume_iteration:
                keep.append(line.rstrip("\n"))
    if bad:
        logger.warning("%s: dropped %d damaged line(s) (line %s%s: an interrupted write) while resuming", path,
                       len(bad), bad[0], " ..." if len(bad) > 1 else "")
    return keep


class MetricsWriter:
    """Rank-0 sink: log line, JSON lines (flushed each step), optional DeepSpeed monitor."""

    def __init__(self, run_dir: Path, total_iters: int, enabled: bool, monitor=None, resume_iteration: int | None = None):
        """``resume_iteration``: continuing a run from a checkpoint at that iteration; rows logged
        after it by the interrupted run are dropped so the file reads as one uninterrupted run."""
        self.enabled, self.total, self.monitor = enabled, total_iters, monitor
        self.file = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        if resume_iteration is not None and path.is_file():
            keep = kept_metric_lines(path, resume_iteration)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(path)
            self.file = open(path, "a")
        else:
            self.file = open(path, "w")

    def step(self, m: dict) -> None:
        if not self.enabled:
            return
        logger.info(format_line(m, self.total))
        self.file.write(json.dumps({k: m[k] for k in KEYS} | {k: v for k, v in m.items() if k not in KEYS}) + "\n")
        self.file.flush()
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([(f"train/{k}", m[k], m["iteration"]) for k in KEYS[1:]
                                       if isinstance(m[k], (int, float))])

    def event(self, tag: str, values: dict, iteration: int) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"event": tag, "iteration": iteration, **values}) + "\n")
        self.file.flush()
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events([(f"{tag}/{k}", v, iteration) for k, v in values.items()
                                       if isinstance(v, (int, float))])

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
