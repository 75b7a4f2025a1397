"""Experiment tracking through DeepSpeed's monitor, and the ``deepspeed:`` pass-through section.

DeepSpeed's ``MonitorMaster`` writes every ``engine.metrics_monitor.write_events`` call (our per-step metrics and
validation on log steps, ``training.metrics.MetricsWriter``) to each enabled sink; DeepSpeed's own per-step writes
(``Train/Samples/lr``, ``loss_scale``, the pipeline loss) are stopped (``training.optim.engine.Engine``: a host read
every step). The run config maps onto its config keys, next to TensorBoard:

* ``run.tensorboard``   -> ``tensorboard``  (RUN_DIR/tensorboard/train)
* ``run.csv``           -> ``csv_monitor``  (RUN_DIR/csv/train/<metric>.csv, one ``step,value`` file per metric)
* ``run.wandb.*``       -> ``wandb``        (project, entity = DeepSpeed's ``team``, group); DeepSpeed calls
  ``wandb.init`` without a mode or directory, so those travel as WANDB_MODE / WANDB_DIR (:func:`wandb_env`):
  ``mode: offline`` writes the run under RUN_DIR/wandb with no network (``wandb sync`` uploads it later).
  The W&B run id is kept in RUN_DIR/wandb_run_id (:func:`wandb_run_id`, passed as WANDB_RUN_ID with
  WANDB_RESUME=allow), so a resumed run continues the same W&B run; the run config is recorded once the monitor
  has started it (:func:`record_config`).

The ``deepspeed:`` section of the YAML is merged into the derived JSON (``training.ds_json.deepspeed_config``)
for options the run config does not model (``zero_optimization.overlap_comm``, ``communication_data_type``,
``flops_profiler``, ``wall_clock_breakdown``, ...). A key the run config owns is refused in one line naming
the config field to set instead (:func:`check_passthrough`), so the YAML stays the single source of truth; a key the
installed DeepSpeed does not read (a typo) is refused naming the closest one (``training.ds_schema``).
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.config_yaml import merge_dicts
from megatron_ds_suite.core.errors import ConfigError
from training.ds_schema import check_schema

logger = logging.getLogger("training")

# DeepSpeed keys (dotted; a prefix owns everything below it) derived from a run-config field.
OWNERS: dict[str, str] = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (= micro x grad-accum x DP)",
    "gradient_clipping": "optimizer.clip_grad",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "parallel.zero_stage (on at stage 3: the model "
                                                                   "file of a checkpoint holds whole weights)",
    "zero_optimization.offload_optimizer": "parallel.offload_optimizer",
    "zero_force_ds_cpu_optimizer": "parallel.offload_optimizer (the client AdamW runs the offloaded step)",
    "zero_allow_untested_optimizer": "optimizer (the client AdamW is always used)",
    "optimizer": "optimizer (the client AdamW is always used)",
    "scheduler": "optimizer (warmup/decay: the client LR schedule)",
    "fp16.enabled": "precision.dtype",
    "bf16.enabled": "precision.dtype",
    "bfloat16": "precision.dtype",
    "fp16.loss_scale": "precision.loss_scale",
    "fp16.initial_scale_power": "precision.initial_scale_power",
    "fp16.loss_scale_window": "precision.loss_scale_window",
    "fp16.hysteresis": "precision.hysteresis",
    "fp16.min_loss_scale": "precision.min_loss_scale",
    "checkpoint.load_universal": "train.load_universal (on while the run starts from a universal checkpoint)",
    "tensorboard": "run.tensorboard",
    "csv_monitor": "run.csv",
    "wandb": "run.wandb",
    "pipeline.pipe_partitioned": "parallel.sequence_parallel (off with it under PP, DeepSpeed's default otherwise)",
    "pipeline.grad_partitioned": "parallel.sequence_parallel (off with it under PP, DeepSpeed's default otherwise)",
}


def _leaves(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        out += _leaves(v, path + ".") if isinstance(v, dict) and v else [path]
    return out


def owner_of(key: str) -> str | None:
    """The run-config field that owns DeepSpeed key ``key`` (dotted), or None."""
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        owner = OWNERS.get(".".join(parts[:i]))
        if owner:
            return owner
    return None


def check_passthrough(section: dict[str, Any], reference: dict[str, Any] | None = None) -> None:
    """Refuse a ``deepspeed:`` key the run config owns (one line naming the field that owns it), or one the
    installed DeepSpeed does not know (one line naming the closest key it reads: ``training.ds_schema``)."""
    for key in _leaves(section):
        owner = owner_of(key)
        if owner:
            raise ConfigError(f"deepspeed.{key} is derived from {owner}: set that instead (the deepspeed: section "
                              f"may only add DeepSpeed options the run config does not own)")
    check_schema(section, reference)


def merge_passthrough(derived: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """``derived`` with ``section`` merged in (nested dicts merged key by key; checked first)."""
    check_passthrough(section, derived)
    return merge_dicts(derived, section)


def monitor_config(cfg) -> dict[str, Any]:
    """DeepSpeed monitor sections for ``cfg.run`` (a ``training.config.RunConfig`` inside ``cfg``)."""
    run, out = cfg.run, {}
    if run.tensorboard:
        out["tensorboard"] = {"enabled": True, "output_path": str(Path(run.dir) / "tensorboard"), "job_name": "train"}
    if run.csv:
        out["csv_monitor"] = {"enabled": True, "output_path": str(Path(run.dir) / "csv"), "job_name": "train"}
    if run.wandb.enabled:
        out["wandb"] = {"enabled": True, "project": run.wandb.project, "team": run.wandb.entity,
                        "group": run.wandb.group}
    return out


def wandb_env(cfg) -> dict[str, str]:
    """Environment for ``wandb.init`` inside DeepSpeed: mode and directory (the run's own folder)."""
    w = cfg.run.wandb
    if not w.enabled:
        return {}
    env = {"WANDB_MODE": w.mode, "WANDB_DIR": str(Path(cfg.run.dir).resolve())}
    if w.name:
        env["WANDB_NAME"] = w.name
    return env


def wandb_server() -> str:
    """The W&B server ``wandb.init`` would contact: ``WANDB_BASE_URL``, else W&B's public API."""
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def reachable(url: str, timeout: float = 5.0) -> str | None:
    """None when a TCP connection to ``url``'s host and port opens within ``timeout`` s, else why not."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return f"{url!r} names no host"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"


def start(cfg) -> None:
    """Per-process preparation before ``deepspeed.initialize`` builds the monitor.

    An online W&B run whose server cannot be reached within a few seconds (no network, a firewall, a
    self-hosted server down) is logged offline under RUN_DIR/wandb instead, with one warning, rather than
    stalling ``wandb.init`` for ~100 s and then failing the run: ``wandb sync`` uploads it later."""
    env = wandb_env(cfg)
    if env:
        if env["WANDB_MODE"] == "online":
            why = reachable(wandb_server())
            if why is not None:
                logger.warning("W&B server %s is unreachable (%s): logging this run offline under %s/wandb; upload it "
                               "later with `wandb sync`", wandb_server(), why, env["WANDB_DIR"])
                env["WANDB_MODE"] = "offline"
        Path(env["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:  # DeepSpeed's monitor starts W&B on global rank 0 only
            env.update(WANDB_RUN_ID=wandb_run_id(Path(cfg.run.dir)), WANDB_RESUME="allow")
        os.environ.update(env)


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir``: the one kept in RUN_DIR/wandb_run_id (so a resumed run continues the same W&B
    run), or a new one written there."""
    path = run_dir / WANDB_ID_FILE
    try:
        kept = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        kept = ""
    if kept.isalnum() and len(kept) <= 64:
        return kept
    new = uuid.uuid4().hex[:12]
    atomic.write_text(path, new + "\n")
    return new


def record_config(cfg, is_rank0: bool) -> None:
    """The run's configuration into the W&B run DeepSpeed's monitor started (``wandb.init`` there takes none)."""
    if cfg.run.wandb.enabled and is_rank0:
        import wandb

        if wandb.run is not None:
            wandb.run.config.update(cfg.to_dict(), allow_val_change=True)


def finish(cfg, is_rank0: bool) -> None:
    """Close the W&B run (DeepSpeed never does), so offline files are complete when training returns."""
    if cfg.run.wandb.enabled and is_rank0:
        import wandb

        if wandb.run is not None:
            wandb.finish()
