"""Convert a training checkpoint to another tensor/pipeline-parallel layout.

    python -m training.tools.reshard --checkpoint RUN_DIR --tp K --pp M [--dp D] [--schedule S --virtual-pipeline V]
        --out NEW_RUN_DIR

Shards are merged by their saved partition tags (column-parallel weights on output rows,
row-parallel on input columns, the fused QKV head-aligned through its stride, the vocabulary by
rows with the source's padding kept where the new TP divides it, else padded for it: ``--repad-vocab``), then re-split by K x M x D processes that
each build the target model (in the checkpoint's dtype and ZeRO stage) and save through DeepSpeed's
``save_checkpoint``. So the output is an ordinary run directory: ``deepspeed --num_gpus K*M*DP --module
training.pretrain --config ... run.dir=NEW_RUN_DIR parallel.tensor=K parallel.pipeline=M`` resumes
from it (a ZeRO-1 checkpoint partitions the optimizer over DP ranks: resume it with DP = D).

Moved along: weights, Adam moments, the LR schedule, iteration and data position. fp32 runs without
ZeRO keep Adam's state per model parameter, read from the files; fp16 runs (fp32 master weights in
DeepSpeed's fp16 optimizer) and ZeRO-1 runs (flat partitions) are loaded by DeepSpeed in their source
layout and their fp32 masters and moments read per parameter (``training/tools/reshard_optim.py``). The
dropout RNG streams of a
new layout cannot be mapped from the old ranks: they are re-seeded with seed + iteration (as
Megatron-DeepSpeed does for universal checkpoints).
"""
from __future__ import annotations

if __name__ == "__main__":  # run as `python -m`: process settings before torch loads
    from training.runtime.process_env import configure

    configure()

import argparse
import dataclasses
import json
import logging
import math
import shutil
import sys
from pathlib import Path

import torch

from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.program import prog as program
from training import checkpoint as ckpt
from training import safe_load
from training.checkpoint_reader import checkpoint_dir, load_merged_state_dict, model_files
from training.config import config_from_dict, grad_accumulation, validate_static
from training.models.config import padded_vocab_size
from training.parallel.sharding import is_vocab_sized, merge_tagged, resize_vocab_rows, shard_tagged
from training.parallel_config import check_micro_batches
from training.runtime.run_lock import lock_existing_output, overlapping_input
from training.runtime.spawn import run_distributed
from training.tools import reshard_optim

logger = logging.getLogger("training.tools.reshard")


def merge_optimizer_state(run_dir: Path, tag: str | None, meta: dict) -> dict[str, dict] | None:
    """{parameter name: {"exp_avg", "exp_avg_sq", "step"}} at TP=1, or None if the checkpoint's
    optimizer state is not per model parameter (fp16 master copies, ZeRO partitions)."""
    names_key = "optimizer_param_names"
    _, files = model_files(run_dir, tag)
    shards: dict[str, list] = {}
    for f in files:
        d = safe_load.load(f)
        opt = d.get("optimizer")
        if not isinstance(opt, dict) or "state" not in opt or d.get(names_key) is None:
            return None
        tp_rank = d["tp_rank"]
        flat = [i for g in opt["param_groups"] for i in g["params"]]
        for idx, name in zip(flat, d[names_key]):
            if name is None or idx not in opt["state"]:
                continue
            shards.setdefault(name, [None] * meta["parallel"]["tp"])[tp_rank] = opt["state"][idx]
    merged = {}
    for name, parts in shards.items():
        tags = meta["partition"].get(name)
        out = {"step": parts[0]["step"]}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = merge_tagged([p[key].float() for p in parts if p is not None], tags)
        merged[name] = out
    return merged


def _worker(rank, world, payload_path: str, out_dir: str):  # noqa: C901
    """Runs in each of the K x M target processes (gloo initialised by the spawner)."""
    from training.parallel import random as tp_random
    from training.resolve import resolve_run
    from training.trainer import Trainer

    payload = safe_load.load(payload_path)
    cfg = config_from_dict(payload["config"])
    precision = dataclasses.replace(cfg.precision)
    reshard_optim.force_precision(cfg, payload["dtype"])  # the source's engine layout, even on CPU
    trainer = Trainer(resolve_run(cfg))
    # from here on the explicit parts: model, engine, train state, parallel state, model description
    model, engine, state, ps, desc = trainer.model, trainer.engine, trainer.state, trainer.ps, trainer.desc
    names = ckpt.canonical_names(model, desc.pipeline_layers)
    params = dict(model.named_parameters())
    opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
    tp_rank, tp = ps.tp_rank, ps.dims.tp

    def local(t: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's shard of a merged (TP=1) tensor, its vocabulary rows re-cut for the new padding."""
        if is_vocab_sized(name):
            t = resize_vocab_rows(t, desc.padded_vocab)
        return shard_tagged(t, payload["partition"].get(name), tp_rank, tp)

    with torch.no_grad(), ckpt.gathered_for_write(list(params.values())):  # ZeRO-3: whole while written
        for pname, p in params.items():
            name = names[pname]
            p.copy_(local(payload["weights"][name], name).to(p.dtype))
            moments = (payload["moments"] or {}).get(name)
            if moments is not None:
                # Adam's state lives with its parameter (on the GPU under CUDA); a fused/capturable
                # AdamW keeps its step counter there too, the plain one on the host
                on_dev = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
                st = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key] = local(moments[key], name).to(device=p.device, dtype=p.dtype, copy=True)
                step = moments["step"].clone() if torch.is_tensor(moments["step"]) else torch.tensor(
                    float(moments["step"]))
                st["step"] = step.to(p.device) if on_dev else step
                opt.state[p] = st
    if payload["engine_state"] is not None:  # fp16 masters / ZeRO: through the engine's optimizer
        opt_state = {}
        for name, st in payload["engine_state"].items():
            opt_state[name] = {"step": st["step"]}
            for key in ("master", *reshard_optim.KEYS):
                opt_state[name][key] = local(st[key], name).clone()
        reshard_optim.write_state(engine, model, desc.pipeline_layers, opt_state)
    state.iteration = payload["iteration"]
    state.consumed_samples = payload["consumed_samples"]
    if payload["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(payload["lr_scheduler"])  # and the rate of the next step in every group
    tp_random.set_seed(cfg.train.seed + payload["iteration"])
    saved = {**cfg.to_dict(), "precision": dataclasses.asdict(precision)}  # the source's ('auto' stays 'auto')
    if ps.rank == 0:
        ckpt.atomic_write_text(desc.run_dir / "config.json", json.dumps(saved, indent=2))
    ckpt.save(engine, model, state, ps, desc, config=saved)
    return ps.rank


def keep_vocab_padding(cfg, source_padded: int, tp: int) -> None:
    """Keep the source's padded vocabulary at TP=``tp`` where ``tp`` divides it, through
    ``model.make_vocab_size_divisible_by`` = padded / tp (the padding columns take part in the softmax: another
    padding would shift the training loss by about ln(new/old padded size)); where it does not divide, the
    target's own padding, with a warning."""
    m = cfg.model
    natural = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    if natural == source_padded:
        return
    if source_padded % tp == 0 and source_padded >= m.vocab_size:
        logger.info("keeping the source's padded vocabulary of %d rows at TP=%d: the new run's config records "
                    "model.make_vocab_size_divisible_by=%d (was %d): resume with it (--repad-vocab pads to %d "
                    "instead)", source_padded, tp, source_padded // tp, m.make_vocab_size_divisible_by, natural)
        m.make_vocab_size_divisible_by = source_padded // tp
        return
    logger.warning("the source's padded vocabulary of %d rows does not split over TP=%d: padded to %d instead; the "
                   "padding columns are in the softmax, so the training loss moves by about ln(%d/%d) = %.4f unless "
                   "model.mask_vocab_padding is set", source_padded, tp, natural, natural, source_padded,
                   math.log(natural / source_padded))


def reshard(run_dir: str | Path, tp: int, pp: int, out: str | Path, tag: str | None = None, dp: int = 1,
            schedule: str | None = None, virtual_pipeline: int | None = None, repad_vocab: bool = False) -> Path:
    """The checkpoint ``tag`` of ``run_dir`` in the layout TP x PP x DP, under the pipeline ``schedule`` with
    ``virtual_pipeline`` chunks per rank (None: the source's; at PP=1 '1f1b'). Layers are merged by their global
    index, so any schedule's checkpoint converts to any other's. The padded vocabulary is the source's where TP
    divides it (:func:`keep_vocab_padding`), the target config's own with ``repad_vocab``."""
    run_dir, out = Path(run_dir), Path(out)
    overlap = overlapping_input(out, {"--checkpoint": run_dir})
    if overlap:  # --out inside the source run would write a second run into it
        raise ConfigError(f"--out {out} {overlap}: choose a new directory outside it")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty: choose a new directory")
    tag = tag or model_files(run_dir, tag)[0]
    weights, cfg, meta = load_merged_state_dict(run_dir, tag)
    cfg.parallel.tensor, cfg.parallel.pipeline = tp, pp
    par = cfg.parallel
    if schedule is not None or pp == 1:
        par.pipeline_schedule = schedule or "1f1b"
        par.virtual_pipeline = virtual_pipeline or (2 if par.pipeline_schedule == "interleaved" else 1)
    elif virtual_pipeline is not None:
        par.virtual_pipeline = virtual_pipeline
    cfg.run.dir = str(out)
    cfg.train.exit_at = None
    if not repad_vocab:
        keep_vocab_padding(cfg, meta["padded_vocab_size"], tp)
    cfg.eval.tasks = []  # lm-eval during training (PP=1 only) is the resharded run's own choice, in its config
    validate_static(cfg)  # TP must divide heads, PP <= layers, ...
    if dp < 1:
        raise ConfigError(f"--dp must be >= 1, got {dp}")
    try:
        check_micro_batches(cfg.parallel, grad_accumulation(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp))
    except ConfigError as e:
        raise ConfigError(f"--dp {dp}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_existing_output(out)  # no training run starts in --out while it is written
    try:
        return _convert(run_dir, out, tag, weights, cfg, meta, tp, pp, dp)
    finally:
        lock.release()


def _convert(run_dir: Path, out: Path, tag: str, weights: dict, cfg, meta: dict, tp: int, pp: int, dp: int) -> Path:
    moments = engine_state = None
    if reshard_optim.needs_engine(meta):
        logger.info("%s holds %s / ZeRO-%d optimizer state: loading it with DeepSpeed (TP=%d PP=%d DP=%d)", run_dir,
                    meta["dtype"], meta["config"]["parallel"]["zero_stage"],
                    *(meta["parallel"][k] for k in ("tp", "pp", "dp")))
        engine_state = reshard_optim.extract(run_dir, tag, meta, out / ".reshard_source")
        weights.update({name: st["master"] for name, st in engine_state.items()})  # fp32 masters, not fp16 copies
    else:
        moments = merge_optimizer_state(run_dir, tag, meta)
        if moments is None:
            logger.warning("optimizer state of %s is not per parameter: only weights, schedule and data position "
                           "are converted; Adam moments restart from zero", run_dir)
    src = model_files(run_dir, tag)[1][0]
    source_state = safe_load.load(src)
    payload_path = out / ".reshard_payload.pt"
    torch.save({"config": cfg.to_dict(), "weights": weights, "moments": moments, "engine_state": engine_state,
                "dtype": meta.get("dtype", "fp32"), "partition": meta["partition"],
                "iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                "lr_scheduler": source_state.get("lr_scheduler")}, payload_path)
    try:
        _spawn(tp * pp * dp, str(payload_path), str(out))
    finally:
        payload_path.unlink(missing_ok=True)
    for name in ("metrics.jsonl",):
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    logger.info("wrote %s (TP=%d PP=%d) from %s", checkpoint_dir(out), tp, pp, run_dir)
    return out


def _spawn(world: int, payload_path: str, out_dir: str) -> None:
    run_distributed(_worker, world, payload_path, out_dir, timeout=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("python -m training.tools.reshard"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run directory with checkpoints/latest")
    parser.add_argument("--tp", type=int, required=True, help="target tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="target pipeline-parallel degree")
    parser.add_argument("--dp", type=int, default=1, help="target data-parallel degree (matters for ZeRO-1)")
    parser.add_argument("--schedule", choices=["1f1b", "interleaved", "dualpipev"], default=None,
                        help="target parallel.pipeline_schedule (default: the source's; 1f1b at --pp 1)")
    parser.add_argument("--virtual-pipeline", type=int, default=None,
                        help="target parallel.virtual_pipeline (chunks per rank of --schedule interleaved)")
    parser.add_argument("--repad-vocab", action="store_true",
                        help="pad the vocabulary for the target TP as a new run would (default: keep the source's "
                             "padding where the target TP divides it, so the training loss does not move)")
    parser.add_argument("--out", required=True, help="new run directory (must not exist or be empty)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(name)s] %(message)s", datefmt="%H:%M:%S")
    try:
        reshard(args.checkpoint, args.tp, args.pp, args.out, args.tag, dp=args.dp, schedule=args.schedule,
                virtual_pipeline=args.virtual_pipeline, repad_vocab=args.repad_vocab)
    except (ConfigError, FileNotFoundError) as e:
        print(f"reshard error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
