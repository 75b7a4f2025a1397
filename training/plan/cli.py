"""Command line of the planner (``python -m training.plan``): run config and/or preset, layout and device
in, the report of :mod:`training.plan.report` out; every impossible input is one ``error: ...`` line
and exit code 2."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from megatron_ds_suite.core.config import build_dataclass
from megatron_ds_suite.core.config_yaml import merge_dicts, read_yaml
from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.program import prog as program
from training.config import Config, with_overrides
from training.layout import Layout
from training.parallel_config import validate_context
from training.plan.accounting import ModelShape
from training.plan.layout import validate
from training.plan.presets import PRESETS
from training.plan.report import render_paper_comparison, render_plan
from training.plan.timing import TimeModel
from training.runtime.hardware import canonical_kind, get_hardware, host_memory_gib

DESCRIPTION = "Memory and speed planner for TP x PP x DP runs of our GPT-2 / BERT (``python -m training.plan``)."


def load_plan_config(path: str | None, model: str | None, overrides: list[str]) -> Config:
    """Run config for planning: YAML file and/or preset, then ``a.b=value`` overrides.

    Only model/train/precision keys matter here, so the run-only checks of load_config (data source,
    pipeline not implemented yet) are not applied; key and type checks are the same.
    """
    data: dict[str, Any] = {}
    if path is not None:
        from megatron_ds_suite.configs_lookup import find_config

        p = find_config(path)  # an existing file, else a bundled config of that name
        data = read_yaml(p, "config file", " (see configs/ for examples)")
    if model is not None:
        if model not in PRESETS:
            raise ConfigError(f"unknown --model {model!r}; choose one of: {', '.join(PRESETS)}")
        data = merge_dicts(data, {"model": PRESETS[model]})
    return build_dataclass(Config, with_overrides(data, overrides))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=program("python -m training.plan"), description=DESCRIPTION)
    ap.add_argument("--config", help="run config YAML (model/train/precision sections are used)")
    ap.add_argument("--model", help=f"preset instead of / on top of --config: {', '.join(PRESETS)}")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: parallel.tensor)")
    ap.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (default: parallel.pipeline)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    ap.add_argument("--gpu", default="v100", help="device kind from training/runtime/hardware.py (v100, a100, h100, h200, cpu)")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="override the table's GPUs per node")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                    help="training dtype (default: precision.dtype, 'auto' = fp16)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: train.micro_batch_size")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="default: train.global_batch_size, raised to micro x DP when smaller")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="Megatron's sequence parallelism, TP > 1 (default: parallel.sequence_parallel)")
    ap.add_argument("--flash-attention", action="store_true",
                    help="do not count the s^2 attention-score activations (fused attention kernels)")
    ap.add_argument("--dp-overlap", type=float, default=TimeModel.dp_overlap,
                    help="fraction of the DP all-reduce hidden behind backward (0..1)")
    ap.add_argument("--compute-fraction", type=float, default=None,
                    help="achieved fraction of peak (default: calibrated/table value)")
    ap.add_argument("--overhead-step-ms", type=float, default=0.0,
                    help="host time per optimizer step that does not scale with FLOPs, in ms (default 0; measure it "
                         "with benchmarks.bench_plan_fidelity: 7.1 ms on one H200 with this project's fp16 stack)")
    ap.add_argument("--overhead-layer-ms", type=float, default=0.0,
                    help="host time per layer per micro-batch, in ms (default 0; measured 3.3 ms on one H200, see "
                         "docs/plan.md)")
    ap.add_argument("--paper-comparison", action="store_true",
                    help="print the Megatron-LM weak-scaling prediction vs the paper and exit")
    ap.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    return ap


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if not 0.0 <= args.dp_overlap <= 1.0:
            raise ConfigError(f"--dp-overlap must be in [0, 1], got {args.dp_overlap}")
        if args.compute_fraction is not None and not 0.0 < args.compute_fraction <= 1.0:
            raise ConfigError(f"--compute-fraction must be in (0, 1], got {args.compute_fraction}")
        for flag in ("overhead_step_ms", "overhead_layer_ms"):
            if getattr(args, flag) < 0:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
        tm = TimeModel(compute_fraction=args.compute_fraction, dp_overlap=args.dp_overlap,
                       overhead_step_s=args.overhead_step_ms / 1e3, overhead_layer_s=args.overhead_layer_ms / 1e3)
        if args.paper_comparison:
            print(render_paper_comparison("v100-32gb", tm))
            return 0
        if args.config is None and args.model is None:
            raise ConfigError("give --config PATH and/or --model PRESET "
                              f"(presets: {', '.join(PRESETS)})")
        if canonical_kind(args.gpu) is None:
            raise ConfigError(f"unknown --gpu {args.gpu!r}; see training/runtime/hardware.py (v100, a100, h100, h200, cpu)")
        hw = get_hardware(args.gpu)
        cfg = load_plan_config(args.config, args.model, args.overrides)
        tp = args.tp if args.tp is not None else cfg.parallel.tensor
        pp = args.pp if args.pp is not None else cfg.parallel.pipeline
        micro = args.micro_batch if args.micro_batch is not None else cfg.train.micro_batch_size
        glob = args.global_batch if args.global_batch is not None else max(cfg.train.global_batch_size,
                                                                               micro * args.dp)
        dtype = args.dtype or ("fp16" if cfg.precision.dtype == "auto" else cfg.precision.dtype)
        sp = args.sequence_parallel if args.sequence_parallel is not None else cfg.parallel.sequence_parallel
        schedule = cfg.parallel.pipeline_schedule if pp > 1 else "1f1b"  # parallel.pipeline_schedule=... overrides
        lay = Layout(tp=tp, pp=pp, dp=args.dp, micro_batch=micro, global_batch=glob,
                     gpus_per_node=args.gpus_per_node or hw.gpus_per_node, sequence_parallel=sp,
                     virtual_pipeline=cfg.parallel.virtual_pipeline if schedule == "interleaved" else 1,
                     dualpipev=schedule == "dualpipev", context=cfg.parallel.context,
                     context_impl=cfg.parallel.context_impl)
        if lay.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {lay.tp}")
        shape = ModelShape.from_config(cfg.model, tp, cfg.bert)
        validate(shape, lay)
        validate_context(dataclasses.replace(cfg.parallel, tensor=tp, pipeline=pp, sequence_parallel=sp), cfg.model)
        if hw.name != "cpu" and hw.peak_tflops.get(dtype) is None:
            raise ConfigError(f"{hw.name} has no {dtype} peak in training/runtime/hardware.py: choose another --dtype")
        if hw.name == "cpu":
            from training.runtime.hardware import peak_tflops
            measured = peak_tflops("cpu", dtype)
            # every rank of a CPU run is a process on this host: each gets its share of the host's memory
            hw = dataclasses.replace(hw, peak_tflops={dtype: measured}, memory_gb=host_memory_gib() / lay.world)
        print(render_plan(shape, lay, hw, tm, dtype, scores_stored=not args.flash_attention))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
