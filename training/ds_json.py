"""The DeepSpeed JSON, *derived* from the run config (:func:`deepspeed_config`), never kept by hand; options the
config does not model go in its ``deepspeed:`` section, merged in (keys the config owns are refused:
:mod:`training.tracking`). Saved as RUN_DIR/ds_config.json.
"""
from __future__ import annotations

import copy
from typing import Any

from training.config import Config, grad_accumulation
from training.ds_schema import DS_FIXED
from training.parallel_config import check_micro_batches
from training.tracking import merge_passthrough, monitor_config


def zero_optimization(cfg: Config) -> dict[str, Any]:
    """DeepSpeed's ``zero_optimization`` section: the stage, ZeRO-3's whole-weight gather at a checkpoint save (the
    model file evaluation, export and reshard read holds every parameter whole) and ZeRO-Offload."""
    p = cfg.parallel
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage == 3:
        # save_checkpoint writes the gathered weights into the model file (module) instead of empty partitions
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": p.offload_optimizer}
    return zero


def offload_keys(cfg: Config) -> dict[str, Any]:
    """With ZeRO-Offload: the client torch AdamW (fused, on the host's fp32 partitions) is DeepSpeed's optimizer, no
    DeepSpeedCPUAdam swapped in (DeepSpeed refuses a client optimizer with offload unless told; its CPU Adam is a
    JIT-compiled extension, the same update)."""
    return {"zero_force_ds_cpu_optimizer": False} if cfg.parallel.offload_optimizer != "none" else {}


def deepspeed_config(cfg: Config, dp: int, dtype: str, from_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON, derived from the run config (saved as RUN_DIR/ds_config.json). ``from_universal``: the
    engine starts from ``train.load_universal`` (``checkpoint.load_universal``: DeepSpeed reads the universal layout;
    once the run has a checkpoint of its own it resumes from that, in its own layout: ``training.universal``)."""
    t, pr = cfg.train, cfg.precision
    gas = grad_accumulation(t.global_batch_size, t.micro_batch_size, dp)
    check_micro_batches(cfg.parallel, gas)
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.optimizer.clip_grad,
        "zero_optimization": zero_optimization(cfg),
        "fp16": {"enabled": dtype == "fp16"},
        "bf16": {"enabled": dtype == "bf16"},
        **copy.deepcopy(DS_FIXED),
        **offload_keys(cfg),
    }
    if cfg.parallel.pipeline > 1 and (cfg.parallel.sequence_parallel or cfg.parallel.pipeline_schedule != "1f1b"):
        # DeepSpeed's pipeline sends 1/tensor of each activation per TP rank and all-gathers it on arrival,
        # which assumes activations alike on every TP rank; with sequence parallelism each rank sends its own
        # sequence chunk whole (already 1/tensor of the activation). The interleaved engine scatters and gathers
        # by itself (training.parallel.pipe_scatter); DualPipeV sends whole tensors (it refuses partitioned sends)
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if from_universal:
        ds["checkpoint"] = {"load_universal": True}
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
