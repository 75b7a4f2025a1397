"""RACE fine-tuning as a trainer task: a pretrained BERT with a multiple-choice head (Megatron ``tasks/race``).

Each question = 4 sequences ``[CLS] question+option [SEP] article [SEP]`` (``megatron_ds_suite.core.race``,
the same encoding the RACE scorer uses); head: pooler -> dropout -> Linear(h, 1) -> 4 logits ->
cross-entropy. Batches count questions (``train.micro_batch_size`` 4 questions = 16 sequences).

Schedule: ``finetune.epochs`` passes over the training questions, shuffled per epoch with
``RandomState(seed + epoch)`` (incomplete last batch dropped); within an epoch, Megatron's sample order
(:mod:`training.data.sample_order`) over the shuffled questions, so the step that starts at
``consumed_samples`` is known without any other state. End-of-epoch hook: dev (and test) accuracy; the
checkpoint is saved only when dev accuracy improves (``keep_last`` 1), so RUN_DIR/checkpoints/latest is
the best epoch. Per-epoch results: RUN_DIR/race_results.json.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.race import collate, encode_questions, read_race_split
from megatron_ds_suite.core.tokenizer import load_tokenizer
from training import checkpoint as ckpt
from training.checkpoint_reader import load_merged_state_dict
from training.config import Config
from training.data.sample_order import micro_batch_positions
from training.init_from import local_weights
from training.parallel.mappings import group_rank, group_size
from training.runtime import device as tdev
from training.runtime.distributed import agreed
from training.tasks.protocol import Task, batch_to_device

if TYPE_CHECKING:
    from training.checkpoint import TrainState
    from training.layout import Layout
    from training.metrics import MetricsWriter
    from training.parallel.state import ParallelState

logger = logging.getLogger("training")


def schedule(cfg: Config, n_train: int) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warmup steps) of ``finetune.epochs`` over ``n_train`` questions: the
    task's ``train.iters`` and ``optimizer.warmup_iters`` (:meth:`RaceTask.config_changes`)."""
    t = cfg.train
    steps = n_train // t.global_batch_size
    if steps < 1:
        raise ConfigError(f"{n_train} training questions do not fill one batch of train.global_batch_size="
                          f"{t.global_batch_size}")
    total = steps * cfg.finetune.epochs
    return steps, total, int(round(cfg.finetune.warmup_fraction * total))


def read_data(cfg: Config, meta: dict, seq: int) -> tuple[Any, dict[str, list[dict]], dict[str, Any]]:
    """(tokenizer, encoded questions per split, read report per split) of ``finetune.race_dir``, with the
    pretrained checkpoint's tokenizer (``meta``); raises RaceDataError / ConfigError in one line."""
    f = cfg.finetune
    tokenizer = load_tokenizer(meta["tokenizer"], base_dir=Path(f.pretrained))
    missing = [k for k in ("cls", "sep", "pad") if getattr(tokenizer, k, None) is None]
    if missing:
        raise ConfigError(f"the tokenizer of {Path(f.pretrained)} lacks {missing}: RACE needs a BERT vocabulary")
    data: dict[str, list[dict]] = {}
    reports: dict[str, Any] = {}
    for split in filter(None, (f.train_split, f.valid_split, f.test_split)):
        qs, reports[split] = read_race_split(f.race_dir, split, f.levels)
        data[split] = encode_questions(qs, tokenizer, seq, f.max_qa_length)
    return tokenizer, data, reports


def build_model(cfg: Config, pretrained: str, padded: int, group):
    """BertMultipleChoice at this TP degree with the pretrained encoder loaded into this rank's shards."""
    from training.models.bert import BertMultipleChoice, load_pretrained_encoder
    world, rank = group_size(group), group_rank(group)
    model = BertMultipleChoice(cfg.model, padded, group, seed=cfg.train.seed)
    state, _, _ = load_merged_state_dict(pretrained)
    local = local_weights(model.bert.named_parameters(), state, padded, rank, world)  # shared with train.init_from
    fresh = load_pretrained_encoder(model, local)
    return model, fresh


def choice_logits(engine: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Choice logits [n, 4] of a host batch (moved to the engine's device)."""
    b = batch_to_device(batch, engine)
    return engine(b["text"], b["types"], b["padding_mask"])


def choice_loss(engine: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy of the 4 choices of a host batch (logits and labels on the engine's device)."""
    b = batch_to_device(batch, engine)
    return F.cross_entropy(engine(b["text"], b["types"], b["padding_mask"]).float(), b["label"])


def dp_accuracy(engine: torch.nn.Module, samples: list[dict], dp: int, dp_rank: int, dp_group,
                batch_size: int) -> dict:
    """Accuracy overall and per level; each question scored on exactly one DP replica."""
    levels = sorted({s["level"] for s in samples})
    mine = [s for i, s in enumerate(samples) if i % dp == dp_rank]
    # counted on the host per question, summed over DP as one device tensor (NCCL takes no host tensor)
    correct = [0.0] * (len(levels) + 1)
    count = [0.0] * (len(levels) + 1)
    engine.eval()
    with torch.no_grad():
        for b in range(0, len(mine), batch_size):
            chunk = mine[b:b + batch_size]
            pred = choice_logits(engine, collate(chunk)).float().argmax(-1).cpu()
            for s, p in zip(chunk, pred.tolist()):
                k = levels.index(s["level"])
                ok = float(p == int(s["label"]))
                correct[k] += ok
                count[k] += 1
                correct[-1] += ok
                count[-1] += 1
    engine.train()
    totals = tdev.host_to([correct, count], tdev.module_device(engine), torch.float64)  # [2, levels + 1]
    dist.all_reduce(totals, group=dp_group)
    correct, count = totals.cpu()
    out = {"accuracy": (correct[-1] / count[-1]).item() if count[-1] else float("nan"), "count": int(count[-1])}
    for k, lv in enumerate(levels):
        out[f"{lv}/accuracy"] = (correct[k] / count[k]).item() if count[k] else float("nan")
    return out


class RaceTask(Task):
    """RACE multiple choice over ``finetune.race_dir``, starting from ``finetune.pretrained``'s encoder."""

    periodic_checkpoints = False  # the end-of-epoch hook saves the best epoch only
    reads_every_step = True  # the epoch's mean training loss is over every step's DP-averaged loss

    def __init__(self, cfg: Config, meta: dict, ps: ParallelState, dp: int):
        self.cfg, self.meta, self.ps, self._dp = cfg, meta, ps, dp
        f = cfg.finetune
        self.is_rank0 = ps.rank == 0
        self.pretrained = Path(f.pretrained)
        self.seq = f.seq_length or cfg.model.seq_length
        self.tokens_per_sample = 4 * self.seq  # one question = 4 sequences
        # every rank reads the same files; a bad RACE folder or tokenizer stops every rank with one line from
        # rank 0, as pretraining's data errors do (training.runtime.distributed.agreed)
        self.tokenizer, self.data, self.read_reports = agreed(lambda: read_data(cfg, meta, self.seq))
        if self.is_rank0:
            for split, report in self.read_reports.items():
                logger.info("RACE %s: %d questions from %d files (%d skipped)", split, len(self.data[split]),
                            report.files, report.skipped)
        self.steps_per_epoch, total, warmup = agreed(lambda: schedule(cfg, len(self.data[f.train_split])))
        self.schedule = {"train": {"iters": total}, "optimizer": {"warmup_iters": warmup}}
        if self.is_rank0:
            logger.info("RACE: %d steps/epoch x %d epochs | warmup %d", self.steps_per_epoch, f.epochs, warmup)
        self._orders: dict[int, np.ndarray] = {}
        self.results: dict[str, Any] = {}
        self._losses: list[float] = []
        self._best = -1.0

    def config_changes(self) -> dict[str, dict[str, Any]]:
        """The schedule from the data: ``train.iters`` (epochs x steps per epoch) and the warmup."""
        return self.schedule

    # ---- data and model ----------------------------------------------------------------------------
    def build_data(self) -> None:
        pass  # read and encoded in __init__: the schedule (train.iters) depends on the number of questions

    def padded_vocab(self, layout: Layout) -> int:
        """The pretrained checkpoint's padding when it splits over this TP degree (its rows load as they are)."""
        padded = int(self.meta["padded_vocab_size"])
        return padded if padded % layout.tp == 0 else layout.padded_vocab

    def build_model(self, padded_vocab: int):
        model, fresh = build_model(self.cfg, str(self.pretrained), padded_vocab, self.ps.tp_group)
        if self.is_rank0:
            logger.info("loaded pretrained encoder from %s; freshly initialised: %s", self.pretrained, ", ".join(fresh))
        return model

    def epoch_of(self, consumed_samples: int) -> tuple[int, int]:
        """(epoch from 1, step within the epoch) of the step that starts at ``consumed_samples``."""
        step = consumed_samples // self.cfg.train.global_batch_size
        return step // self.steps_per_epoch + 1, step % self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.data[self.cfg.finetune.train_split])
            self._orders = {epoch: np.random.RandomState(self.cfg.train.seed + epoch).permutation(n)}
        return self._orders[epoch]

    def micro_batches(self, consumed_samples: int):
        t = self.cfg.train
        epoch, step = self.epoch_of(consumed_samples)
        order = self.order(epoch)
        samples = self.data[self.cfg.finetune.train_split]
        for positions in micro_batch_positions(step * t.global_batch_size, t.micro_batch_size, self._dp,
                                               self.ps.dp_rank, t.global_batch_size):
            yield collate([samples[int(order[p])] for p in positions])

    def valid_micro_batches(self, i: int):
        return None  # RACE is evaluated by accuracy at the end of each epoch, not by a validation loss

    def loss(self, engine: torch.nn.Module, batch) -> tuple[torch.Tensor, dict]:
        return choice_loss(engine, batch), {}

    # ---- hooks ------------------------------------------------------------------------------------
    def accuracy(self, engine: torch.nn.Module, split: str) -> dict:
        return dp_accuracy(engine, self.data[split], self._dp, self.ps.dp_rank, self.ps.dp_group,
                           self.cfg.finetune.eval_batch_size)

    def _eval_splits(self) -> list[str]:
        f = self.cfg.finetune
        return [s for s in (f.valid_split, f.test_split) if s]

    def step_metrics(self, consumed_samples: int) -> dict:
        return {"epoch": self.epoch_of(consumed_samples)[0]}

    def on_train_start(self, engine: torch.nn.Module, writer: MetricsWriter) -> None:
        self.results = {"pretrained": str(self.cfg.finetune.pretrained), "epochs": [], "best_epoch": None,
                        "skipped_questions": {s: r.skipped for s, r in self.read_reports.items()},
                        "problems": {s: r.problems for s, r in self.read_reports.items()},
                        "before_finetuning": {s: self.accuracy(engine, s) for s in self._eval_splits()}}

    def on_step_end(self, engine: torch.nn.Module, state: TrainState, metrics: dict, writer: MetricsWriter,
                    save_checkpoint: Callable[[], Path]) -> None:
        self._losses.append(metrics["loss"])
        epoch, step = self.epoch_of(state.consumed_samples)
        if step != 0:
            return  # not the end of an epoch
        epoch -= 1  # the epoch that just ended
        f = self.cfg.finetune
        row = {"epoch": epoch, "train_loss": float(np.mean(self._losses)), "iteration": state.iteration}
        self._losses = []
        for s in self._eval_splits():
            row[s] = self.accuracy(engine, s)
        improved = row[f.valid_split]["accuracy"] > self._best
        if improved:
            self._best = row[f.valid_split]["accuracy"]
            self.results["best_epoch"] = epoch
            save_checkpoint()  # keep_last = 1: only the best epoch's checkpoint stays
        row["saved"] = improved
        self.results["epochs"].append(row)
        writer.event("race", {"epoch": epoch, "train_loss": row["train_loss"],
                              **{f"{s}_accuracy": row[s]["accuracy"] for s in self._eval_splits()}},
                     state.iteration)
        if self.is_rank0:
            accs = " | ".join(f"{s} acc {row[s]['accuracy']:.4f}" for s in self._eval_splits())
            logger.info("epoch %d/%d | train loss %.4f | %s%s", epoch, f.epochs, row["train_loss"], accs,
                        " | saved (best)" if improved else "")

    def on_train_end(self, state: TrainState) -> dict:
        res = self.results
        best_row = res["epochs"][res["best_epoch"] - 1]
        res["best"] = {s: best_row[s] for s in self._eval_splits()}
        if self.is_rank0:
            ckpt.atomic_write_text(Path(self.cfg.run.dir) / "race_results.json", json.dumps(res, indent=2))
        return res
