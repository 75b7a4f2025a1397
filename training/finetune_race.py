"""Fine-tune a pretrained BERT on RACE with a multiple-choice head (Megatron ``tasks/race/finetune.py``).

    deepspeed --num_gpus N --module training.finetune_race --config configs/race.yaml [key=value ...]

The model sizes, vocabulary and tokenizer come from the pretrained checkpoint (``finetune.pretrained``,
any TP degree: the shards are merged and re-split for ``parallel.tensor``); ``configs/race.yaml`` sets
the fine-tuning run (TP, batch, optimizer, dropout, ``finetune.*``, ``run.dir``). Keys of the
checkpoint's model shape cannot be overridden.

A thin driver: the config (pretrained checkpoint's config <- race.yaml <- overrides) and the CLI; the
training is :class:`training.trainer.Trainer` with the RACE task (:mod:`training.tasks.race`: data, model,
loss, sample order, the end-of-epoch accuracy hook that saves the best epoch).
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

import logging
from pathlib import Path

from megatron_ds_suite.core.errors import ConfigError, SuiteError
from training.cli import exit_process, launcher_parser, report_error, setup_rank_logging
from training.config import Config, config_from_dict
from training.layout import launch_layout
from training.runtime.launch import run_locked

logger = logging.getLogger("training")

# model keys that may differ from the pretrained checkpoint (everything else is the checkpoint's shape)
TUNABLE_MODEL_KEYS = {"hidden_dropout", "attention_dropout", "recompute", "activation_checkpointing"}


# --------------------------------------------------------------------------------------------------
# Config: pretrained checkpoint's config <- race.yaml <- overrides
# --------------------------------------------------------------------------------------------------
def load_finetune_config(path: str | Path, overrides: list[str] | None = None) -> tuple[Config, dict]:  # noqa: C901
    """The fine-tuning Config and the pretrained checkpoint's metadata. Raises ConfigError."""
    from megatron_ds_suite.configs_lookup import find_config
    from megatron_ds_suite.core.config_yaml import apply_overrides, merge_dicts, read_yaml
    from training.checkpoint_reader import read_client_state
    from training.init_from import apart_from_source

    own = read_yaml(find_config(path), hint=" (see configs/race.yaml)")  # a file, else a bundled config
    own = apply_overrides(own, overrides, example="finetune.epochs=3")
    ft = own.get("finetune") or {}
    pretrained = ft.get("pretrained") if isinstance(ft, dict) else None
    if not pretrained:
        raise ConfigError("finetune.pretrained must name the run directory of a pretrained BERT "
                          "(e.g. finetune.pretrained=runs/bert-tiny)")
    if not isinstance(ft.get("race_dir"), str):
        raise ConfigError("finetune.race_dir must name the RACE folder (with train/, dev/, test/)")
    run_dir = (own.get("run") or {}).get("dir") if isinstance(own.get("run"), dict) else None
    if isinstance(run_dir, str) and isinstance(pretrained, str):  # before the pretrained checkpoint is read
        if Path(run_dir).resolve() == Path(pretrained).resolve():
            raise ConfigError(f"run.dir={run_dir} is the pretrained run: fine-tune into a new directory")
        apart_from_source(run_dir, "finetune.pretrained", pretrained)
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
    if {"recompute", "activation_checkpointing"} & set(own.get("model") or {}):  # the run's choice replaces the
        base["model"] = {k: v for k, v in base["model"].items()       # checkpoint's, in either spelling
                         if k not in ("recompute", "activation_checkpointing")}
    merged = merge_dicts(base, own)
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
    if cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is for pretraining (GPT-2, Llama, BERT); RACE fine-tuning "
                          "runs without it: set parallel.sequence_parallel=false (the weights are the same)")
    return cfg, meta


# --------------------------------------------------------------------------------------------------
# Fine-tuning run: the trainer with the RACE task
# --------------------------------------------------------------------------------------------------
def train_race(cfg: Config, meta: dict, run_dir_locked: bool = False) -> dict:
    """Fine-tune: :func:`training.resolve.resolve_run` with the RACE task, then the trainer. Returns the RACE
    results (also in RUN_DIR/race_results.json); ``run_dir_locked`` as in :meth:`Trainer.train`."""
    from training.resolve import resolve_run
    from training.tasks.race import RaceTask
    from training.trainer import Trainer

    run = resolve_run(cfg, lambda c, ps, dp: RaceTask(c, meta, ps, dp))
    return Trainer(run).train(run_dir_locked=run_dir_locked)["task"]


def main(argv: list[str] | None = None) -> int:
    args = launcher_parser("python -m training.finetune_race", __doc__, "fine-tuning config YAML (see configs/race.yaml)").parse_args(argv)
    rank = setup_rank_logging()
    try:
        cfg, meta = load_finetune_config(args.config, args.overrides)
        launch_layout(cfg)  # before any process group exists
    except SuiteError as e:
        return report_error(e, rank)  # every rank checks; one says it
    return run_locked(cfg.run.dir, lambda: finetune(cfg, meta, rank))


def finetune(cfg: Config, meta: dict, rank: int) -> int:
    """The fine-tuning run on every rank, inside the launch skeleton (process group up, run directory claimed),
    whose one table maps what it raises to an exit code as for pretraining (:func:`training.runtime.launch.run_locked`):
    a bad RACE folder or tokenizer is one line from rank 0 and exit 2, an aborted run (``TrainingAborted``) exit 3."""
    res = train_race(cfg, meta, run_dir_locked=True)
    if rank == 0:
        b = res["best"]
        print(f"\nRACE fine-tuning: best epoch {res['best_epoch']} | " +
              " | ".join(f"{s} accuracy {v['accuracy']:.4f} ({v['count']} questions)" for s, v in b.items()))
    return 0


if __name__ == "__main__":
    exit_process(main())
