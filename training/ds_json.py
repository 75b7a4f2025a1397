"""The DeepSpeed JSON, *derived* from the run config (:func:`deepspeed_config`), never kept by hand; options the
config does not model go in its ``deepspeed:`` section, merged in (keys the config owns are refused:
:mod:`training.tracking`). Saved as RUN_DIR/ds_config.json.
"""
from __future__ import annotations

import copy
from typing import Any

from training.config import Config, check_micro_batches, grad_accumulation
from training.ds_schema import DS_FIXED
from training.tracking import merge_passthrough, monitor_config


def deepspeed_config(cfg: Config, dp: int, dtype: str) -> dict[str, Any]:
    """The DeepSpeed JSON, derived from the run config (saved as RUN_DIR/ds_config.json)."""
    t, pr = cfg.train, cfg.precision
    gas = grad_accumulation(t.global_batch_size, t.micro_batch_size, dp)
    check_micro_batches(cfg, gas)
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.optimizer.clip_grad,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "fp16": {"enabled": dtype == "fp16"},
        "bf16": {"enabled": dtype == "bf16"},
        **copy.deepcopy(DS_FIXED),
    }
    if cfg.parallel.pipeline > 1 and (cfg.parallel.sequence_parallel or cfg.parallel.pipeline_schedule != "1f1b"):
        # DeepSpeed's pipeline sends 1/tensor of each activation per TP rank and all-gathers it on arrival,
        # which assumes activations alike on every TP rank; with sequence parallelism each rank sends its own
        # sequence chunk whole (already 1/tensor of the activation). The interleaved and DualPipeV engines send
        # whole tensors (DualPipeV refuses the partitioned sends)
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if dtype == "fp16":
        ds["fp16"].update({
            "loss_scale": pr.loss_scale,
            "initial_scale_power": pr.initial_scale_power,
            "loss_scale_window": pr.loss_scale_window,
            "hysteresis": pr.hysteresis,
            "min_loss_scale": pr.min_loss_scale,
        })
    ds.update(monitor_config(cfg))  # TensorBoard, CSV, W&B
    return merge_passthrough(ds, cfg.deepspeed)  # the deepspeed: section (owned keys refused)
