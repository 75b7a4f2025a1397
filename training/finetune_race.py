"""Fine-tune a pretrained BERT on RACE with a multiple-choice head (Megatron ``tasks/race/finetune.py``).

    deepspeed --num_gpus N --module training.finetune_race --config configs/race.yaml [key=value ...]

The model sizes, vocabulary and tokenizer come from the pretrained checkpoint (``finetune.pretrained``,
any TP degree: the shards are merged and re-split for ``parallel.tensor``); ``configs/race.yaml`` sets
the fine-tuning run (TP, batch, optimizer, dropout, ``finetune.*``, ``run.dir``). Keys of the
checkpoint's model shape cannot be overridden.

Each question = 4 sequences ``[CLS] question+option [SEP] article [SEP]`` (``megatron_ds_suite.core.race``,
the same encoding the RACE scorer uses); head: pooler -> dropout -> Linear(h, 1) -> 4 logits ->
cross-entropy. Batches count questions (``train.micro_batch_size`` 4 questions = 16 sequences).
Schedule: ``finetune.epochs`` passes over the shuffled training questions (incomplete last batch
dropped), linear warmup over ``finetune.warmup_fraction`` of the steps then linear decay.
After every epoch: dev (and test) accuracy; the checkpoint is saved only when dev accuracy improves
(``keep_last`` 1), so RUN_DIR/checkpoints/latest is the best epoch, ready for
``python -m evaluation race --checkpoint RUN_DIR``. Per-epoch results: RUN_DIR/race_results.json.
"""
from __future__ import annotations

if __name__ == "__main__":  # run as `python -m`: process settings before torch loads
    from training.runtime.process_env import configure

    configure()

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from training.runtime import device as tdev
from training.cli import launcher_parser, setup_rank_logging
from training.config import Config, ConfigError, _merge, check_world, config_from_dict, parse_overrides

logger = logging.getLogger("training")

# model keys that may differ from the pretrained checkpoint (everything else is the checkpoint's shape)
TUNABLE_MODEL_KEYS = {"hidden_dropout", "attention_dropout", "activation_checkpointing"}


# --------------------------------------------------------------------------------------------------
# Config: pretrained checkpoint's config <- race.yaml <- overrides
# --------------------------------------------------------------------------------------------------
def load_finetune_config(path: str | Path, overrides: list[str] | None = None) -> tuple[Config, dict]:
    """The fine-tuning Config and the pretrained checkpoint's metadata. Raises ConfigError."""
    import yaml

    from training.checkpoint import read_client_state

    from megatron_ds_suite.configs_lookup import find_config

    p = find_config(path)  # an existing file, else a bundled config of that name
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist (see configs/race.yaml)")
    try:
        own = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(own, dict):
        raise ConfigError(f"config file {p} must be a mapping of sections")
    own = _merge(own, parse_overrides(overrides or []))
    ft = own.get("finetune") or {}
    pretrained = ft.get("pretrained") if isinstance(ft, dict) else None
    if not pretrained:
        raise ConfigError("finetune.pretrained must name the run directory of a pretrained BERT "
                          "(e.g. finetune.pretrained=runs/bert-tiny)")
    if not isinstance(ft.get("race_dir"), str):
        raise ConfigError("finetune.race_dir must name the RACE folder (with train/, dev/, test/)")
    bad = sorted(set(own.get("model") or {}) - TUNABLE_MODEL_KEYS)
    if bad:
        raise ConfigError(f"model.{bad[0]} comes from the pretrained checkpoint and cannot be set for fine-tuning "
                          f"(settable: {', '.join(sorted(TUNABLE_MODEL_KEYS))})")
    try:
        meta = read_client_state(pretrained)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"finetune.pretrained={pretrained}: {e}") from None
    base = dict(meta["config"])
    if base.get("model", {}).get("arch") != "bert":
        raise ConfigError(f"finetune.pretrained={pretrained} holds a {base.get('model', {}).get('arch')!r} model; "
                          "RACE fine-tuning needs a pretrained BERT")
    if base.get("model", {}).get("head", "pretrain") != "pretrain":
        logger.warning("finetune.pretrained=%s is already fine-tuned (%s head); its encoder is reused",
                       pretrained, base["model"]["head"])
    for sec in ("finetune", "bert"):  # sections of the pretraining run that do not carry over
        base.pop(sec, None)
    base["train"] = {k: v for k, v in base.get("train", {}).items() if k == "seed"}  # seed carries over
    base["optimizer"] = {}
    merged = _merge(base, own)
    merged["model"]["head"] = "multiple_choice"
    merged["train"]["keep_last"] = 1
    merged["train"].setdefault("iters", 1)  # placeholder: set from the data in main()
    merged["optimizer"]["warmup_iters"] = 0
    merged["optimizer"]["decay_iters"] = None
    cfg = config_from_dict(merged)
    f = cfg.finetune
    if Path(cfg.run.dir).resolve() == Path(pretrained).resolve():
        raise ConfigError(f"run.dir={cfg.run.dir} is the pretrained run: fine-tune into a new directory")
    if (Path(cfg.run.dir) / "checkpoints" / "latest").is_file():
        raise ConfigError(f"run.dir={cfg.run.dir} already holds a fine-tuned checkpoint: fine-tuning starts from "
                          "the pretrained model each time, so choose a new run.dir or delete the old one")
    if f.epochs < 1:
        raise ConfigError(f"finetune.epochs must be >= 1, got {f.epochs}")
    if not 0.0 <= f.warmup_fraction <= 1.0:
        raise ConfigError(f"finetune.warmup_fraction must be in [0, 1], got {f.warmup_fraction}")
    seq = f.seq_length or cfg.model.seq_length
    if seq > cfg.model.positions:
        raise ConfigError(f"finetune.seq_length={seq} exceeds the checkpoint's max_position_embeddings "
                          f"{cfg.model.positions}")
    if f.max_qa_length < 1:
        raise ConfigError(f"finetune.max_qa_length must be >= 1, got {f.max_qa_length}")
    if f.eval_batch_size < 1:
        raise ConfigError(f"finetune.eval_batch_size must be >= 1, got {f.eval_batch_size}")
    return cfg, meta


def schedule(cfg: Config, n_train: int, dp: int) -> tuple[int, int]:
    """(steps per epoch, total steps); sets train.iters and optimizer.warmup_iters in ``cfg``."""
    t = cfg.train
    steps = n_train // t.global_batch_size
    if steps < 1:
        raise ConfigError(f"{n_train} training questions do not fill one batch of train.global_batch_size="
                          f"{t.global_batch_size}")
    total = steps * cfg.finetune.epochs
    t.iters = total
    cfg.optimizer.warmup_iters = int(round(cfg.finetune.warmup_fraction * total))
    return steps, total


# --------------------------------------------------------------------------------------------------
# Model: pretrained encoder (merged, re-split) + multiple-choice head
# --------------------------------------------------------------------------------------------------
def build_model(cfg: Config, pretrained: str, padded: int, group):
    """BertMultipleChoice at this TP degree with the pretrained encoder loaded into this rank's shards."""
    from training.checkpoint import load_merged_state_dict
    from training.init_from import local_weights
    from training.models.bert import BertMultipleChoice, load_pretrained_encoder
    from training.parallel.mappings import group_rank, group_size

    world, rank = group_size(group), group_rank(group)
    model = BertMultipleChoice(cfg.model, padded, group, seed=cfg.train.seed)
    state, _, _ = load_merged_state_dict(pretrained)
    local = local_weights(model.bert.named_parameters(), state, padded, rank, world)  # shared with train.init_from
    fresh = load_pretrained_encoder(model, local)
    return model, fresh


# --------------------------------------------------------------------------------------------------
# Fine-tuning run
# --------------------------------------------------------------------------------------------------
class RaceFinetuner:
    """Attributes mirror :class:`training.trainer.Trainer` where :mod:`training.checkpoint` reads them."""

    def __init__(self, cfg: Config, meta: dict):
        import deepspeed

        from megatron_ds_suite.core.tokenizer import load_tokenizer
        from megatron_ds_suite.core.race import encode_questions, read_race_split
        from training import tracking
        from training.config import deepspeed_config, padded_vocab_size
        from training.optim import build_optimizer
        from training.trainer import start_process

        self.cfg, self.meta = cfg, meta
        f = cfg.finetune
        self.run_dir = Path(cfg.run.dir)
        self.world, self.dp, self.dtype, self.ps, self.is_rank0 = start_process(cfg)

        pretrained = Path(f.pretrained)
        self.tokenizer = load_tokenizer(meta["tokenizer"], base_dir=pretrained)
        missing = [k for k in ("cls", "sep", "pad") if getattr(self.tokenizer, k, None) is None]
        if missing:
            raise ConfigError(f"the tokenizer of {pretrained} lacks {missing}: RACE needs a BERT vocabulary")
        self.task = self  # checkpoint.save reads trainer.task.tokenizer
        seq = f.seq_length or cfg.model.seq_length
        self.seq = seq
        self.data: dict[str, list[dict]] = {}
        self.read_reports: dict[str, Any] = {}
        for split in filter(None, (f.train_split, f.valid_split, f.test_split)):
            qs, report = read_race_split(f.race_dir, split, f.levels)
            self.read_reports[split] = report
            self.data[split] = encode_questions(qs, self.tokenizer, seq, f.max_qa_length)
            if self.is_rank0:
                logger.info("RACE %s: %d questions from %d files (%d skipped)", split, len(qs), report.files,
                            report.skipped)
        self.steps_per_epoch, total = schedule(cfg, len(self.data[f.train_split]), self.dp)
        self.gas = cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.dp)

        padded = int(meta["padded_vocab_size"])
        if padded % cfg.parallel.tensor:
            padded = padded_vocab_size(cfg.model.vocab_size or self.tokenizer.vocab_size,
                                       cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor)
        self.padded_vocab = padded
        self.model, fresh = build_model(cfg, str(pretrained), padded, self.ps.tp_group)
        if self.is_rank0:
            logger.info("loaded pretrained encoder from %s; freshly initialised: %s", pretrained, ", ".join(fresh))
        optimizer, scheduler = build_optimizer(self.model, cfg.optimizer, total, tdev.local_device().type, self.dtype)
        self.ds_config = deepspeed_config(cfg, self.dp, self.dtype)
        tracking.start(cfg)  # W&B mode/dir before DeepSpeed's monitor calls wandb.init
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, lr_scheduler=scheduler,
                                                    mpu=self.ps, config=self.ds_config, dist_init_required=False)
        self.pipe = False  # tensor parallelism only (checkpoint.save reads it)
        self.device = tdev.module_device(self.engine)  # where DeepSpeed put the model: batches follow it
        # as the Trainer: fp32 without ZeRO clips with our TP-aware norm (DeepSpeed's discards it)
        self._fp32_norm: float | None = None
        if self.dtype == "fp32" and cfg.parallel.zero_stage == 0:
            self.engine.clip_fp32_gradients = self._clip_fp32_gradients
        self.iteration = 0
        self.consumed_samples = 0
        if self.is_rank0:
            logger.info("%r | dtype %s | %d steps/epoch x %d epochs | warmup %d | gas %d", self.ps, self.dtype,
                        self.steps_per_epoch, f.epochs, cfg.optimizer.warmup_iters, self.gas)

    def _clip_fp32_gradients(self) -> None:
        from training.parallel.grad_norm import clip_grad_norm

        self._fp32_norm = clip_grad_norm(self.engine.module.parameters(), self.cfg.optimizer.clip_grad,
                                         self.ps.tp_rank, self.ps.tp_group)

    # ---- batches ---------------------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        return tdev.to_device(batch, self.device)

    def _logits(self, batch: dict):
        """Choice logits [n, 4] of a host batch (moved to the engine's device here)."""
        b = self._to_device(batch)
        return self.engine(b["text"], b["types"], b["padding_mask"])

    def _loss(self, batch: dict):
        """Cross-entropy of the 4 choices for a host batch (logits and labels on the engine's device)."""
        import torch.nn.functional as F

        return F.cross_entropy(self._logits(batch).float(), self._to_device(batch["label"]))

    def step_batches(self, order: np.ndarray, step: int):
        """This DP rank's micro-batches of step ``step`` within an epoch's question order."""
        from megatron_ds_suite.core.race import collate

        t = self.cfg.train
        mb, dp, r = t.micro_batch_size, self.dp, self.ps.dp_rank
        base = step * t.global_batch_size
        samples = self.data[self.cfg.finetune.train_split]
        for m in range(self.gas):
            start = base + m * mb * dp + r * mb
            yield collate([samples[int(i)] for i in order[start:start + mb]])

    # ---- training --------------------------------------------------------------------------------
    def train_step(self, order: np.ndarray, step: int) -> dict:
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        lr = self.engine.get_lr()[0]
        losses, norm = [], None
        self._fp32_norm = None
        for batch in self.step_batches(order, step):
            loss = self._loss(batch)
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())
        norm = self._fp32_norm
        self.iteration += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss, group=self.ps.dp_group)
        if norm is None and self.engine.was_step_applied():
            g = self.engine.get_global_grad_norm()
            norm = float(g) if g is not None else None
        return {"iteration": self.iteration, "lr": lr, "loss": loss.item() / self.dp, "grad_norm": norm,
                "step_applied": bool(self.engine.was_step_applied()), "step_time_s": time.perf_counter() - t0}

    def accuracy(self, split: str) -> dict:
        """Accuracy overall and per level; each question scored on exactly one DP replica."""
        import torch
        import torch.distributed as dist

        from megatron_ds_suite.core.race import collate

        samples = self.data[split]
        levels = sorted({s["level"] for s in samples})
        mine = [s for i, s in enumerate(samples) if i % self.dp == self.ps.dp_rank]
        # counted on the host per question, summed over DP as one device tensor (NCCL takes no host tensor)
        correct = [0.0] * (len(levels) + 1)
        count = [0.0] * (len(levels) + 1)
        self.engine.eval()
        bs = self.cfg.finetune.eval_batch_size
        with torch.no_grad():
            for b in range(0, len(mine), bs):
                chunk = mine[b:b + bs]
                pred = self._logits(collate(chunk)).float().argmax(-1).cpu()
                for s, p in zip(chunk, pred.tolist()):
                    k = levels.index(s["level"])
                    ok = float(p == int(s["label"]))
                    correct[k] += ok
                    count[k] += 1
                    correct[-1] += ok
                    count[-1] += 1
        self.engine.train()
        totals = tdev.host_to([correct, count], self.device, torch.float64)   # [2, levels + 1]
        dist.all_reduce(totals, group=self.ps.dp_group)
        correct, count = totals.cpu()
        out = {"accuracy": (correct[-1] / count[-1]).item() if count[-1] else float("nan"), "count": int(count[-1])}
        for k, lv in enumerate(levels):
            out[f"{lv}/accuracy"] = (correct[k] / count[k]).item() if count[k] else float("nan")
        return out

    def train(self) -> dict:
        from tqdm import tqdm

        from training import checkpoint as ckpt
        from training import tracking
        from training.metrics import MetricsWriter, progress_enabled

        cfg, f = self.cfg, self.cfg.finetune
        if self.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_write_text(self.run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
            ckpt.atomic_write_text(self.run_dir / "ds_config.json", json.dumps(self.ds_config, indent=2))
        writer = MetricsWriter(self.run_dir, cfg.train.iters, self.is_rank0)
        results: dict[str, Any] = {"pretrained": str(f.pretrained), "epochs": [], "best_epoch": None,
                                   "skipped_questions": {s: r.skipped for s, r in self.read_reports.items()},
                                   "problems": {s: r.problems for s, r in self.read_reports.items()}}
        best = -1.0
        initial = {s: self.accuracy(s) for s in (f.valid_split, f.test_split) if s}
        results["before_finetuning"] = initial
        bar = tqdm(total=cfg.train.iters, desc="race", unit="it", leave=False,
                   disable=not (self.is_rank0 and progress_enabled(cfg.train.progress_bar)))
        try:
            for epoch in range(1, f.epochs + 1):
                order = np.random.RandomState(cfg.train.seed + epoch).permutation(len(self.data[f.train_split]))
                losses = []
                for step in range(self.steps_per_epoch):
                    m = self.train_step(order, step)
                    losses.append(m["loss"])
                    if self.is_rank0:
                        writer.file.write(json.dumps({**m, "epoch": epoch}) + "\n")
                        writer.file.flush()
                    bar.update(1)
                row = {"epoch": epoch, "train_loss": float(np.mean(losses)), "iteration": self.iteration}
                for s in (f.valid_split, f.test_split):
                    if s:
                        row[s] = self.accuracy(s)
                improved = row[f.valid_split]["accuracy"] > best
                if improved:
                    best = row[f.valid_split]["accuracy"]
                    results["best_epoch"] = epoch
                    ckpt.save(self)  # keep_last = 1: only the best epoch's checkpoint stays
                row["saved"] = improved
                results["epochs"].append(row)
                writer.event("race", {"epoch": epoch, "train_loss": row["train_loss"],
                                      **{f"{s}_accuracy": row[s]["accuracy"] for s in (f.valid_split, f.test_split)
                                         if s}}, self.iteration)
                if self.is_rank0:
                    accs = " | ".join(f"{s} acc {row[s]['accuracy']:.4f}" for s in (f.valid_split, f.test_split) if s)
                    logger.info("epoch %d/%d | train loss %.4f | %s%s", epoch, f.epochs, row["train_loss"], accs,
                                " | saved (best)" if improved else "")
        finally:
            bar.close()
            writer.close()
            tracking.finish(cfg, self.is_rank0)
        best_row = results["epochs"][results["best_epoch"] - 1]
        results["best"] = {s: best_row[s] for s in (f.valid_split, f.test_split) if s}
        if self.is_rank0:
            ckpt.atomic_write_text(self.run_dir / "race_results.json", json.dumps(results, indent=2))
        return results


def main(argv: list[str] | None = None) -> int:
    args = launcher_parser("python -m training.finetune_race", __doc__, "fine-tuning config YAML (see configs/race.yaml)").parse_args(argv)
    rank = setup_rank_logging()
    from megatron_ds_suite.core.errors import RaceDataError

    try:
        cfg, meta = load_finetune_config(args.config, args.overrides)
        check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, RaceDataError) as e:
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from training.runtime.distributed import init_distributed

    init_distributed()
    try:
        res = RaceFinetuner(cfg, meta).train()
        if rank == 0:
            b = res["best"]
            print(f"\nRACE fine-tuning: best epoch {res['best_epoch']} | " +
                  " | ".join(f"{s} accuracy {v['accuracy']:.4f} ({v['count']} questions)" for s, v in b.items()))
    except (ConfigError, RaceDataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
