"""Checkpoints through DeepSpeed's ``save_checkpoint``/``load_checkpoint``, our state in ``client_state``.

Layout: RUN_DIR/checkpoints/iter_0000020/mp_rank_XX_model_states.pt (DeepSpeed's files) and
RUN_DIR/checkpoints/latest (the newest complete tag). ``latest`` is written by us, atomically, only
after every rank has finished saving, so a process killed mid-save leaves the previous checkpoint
loadable. Client state: config, iteration, consumed samples, tokenizer spec, partition tags (how TP
shards merge), DeepSpeed's ``universal_checkpoint_info`` (the same, for ``ds_to_universal``: training.universal_info;
PP=1) and every RNG state (DP replicas share RNG streams, so DP rank 0's copy is exact).

What a resume restores is one object, :class:`TrainState` (counters and RNG streams); the rest of the
client state describes the model (config, padded vocabulary, tokenizer, partition tags, layout) so that
:mod:`training.checkpoint_reader` (evaluation, export; import its names from there) can read it without
an engine.

:func:`save` and :func:`load` take their parts explicitly (as torchtitan's checkpointer does): the
DeepSpeed engine, the model, the :class:`TrainState`, the :class:`~training.parallel.state.ParallelState`
and a :class:`ModelDescription` (the frozen config, dtype, padded vocabulary and tokenizer); never the
trainer, so the tools (``training.tools.reshard``) and the tasks' hooks save with the same call.

ZeRO-3 (parameters partitioned over the DP ranks, DeepSpeed's files ``zero_pp_rank_D_mp_rank_XX_*``): the weights
are gathered layer by layer (:func:`gathered_state_dict`, over the DP ranks) and DP rank 0 of each TP rank writes its
TP shard whole, with the client state, as ``mp_rank_XX_gathered_weights.pt`` beside DeepSpeed's files, the files
evaluation, export, reshard and ``init_from`` read (DeepSpeed's resume and its ``ds_to_universal`` read only its own ``zero_pp_rank_*`` files).

Every file is read with ``weights_only=True`` (``training.safe_load``): the client state holds only
tensors and plain data, so the numpy RNG state is stored as a list rather than an ndarray.
``latest`` must name a tag directory inside the run's checkpoints/ folder.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import ConfigError
from training import checkpoint_catalog as catalog
from training import safe_load
from training.checkpoint_reader import GATHERED_WEIGHTS, PipeNames, canonical_name, checkpoint_dir, read_client_state
from training.config import Config
from training.data.split_convention import refuse_other_convention
from training.safe_load import CheckpointError
from training.universal_info import UNIVERSAL_INFO_KEY, universal_checkpoint_info

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from megatron_ds_suite.core.tokenizer_base import Tokenizer
    from training.parallel.state import ParallelState

logger = logging.getLogger("training")

atomic_write_text = atomic.write_text  # the name callers and tests use


def _encode_rng(state: dict) -> dict:
    """RNG states with numpy's (name, uint32 array, pos, has_gauss, cached) as plain data (weights_only)."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _decode_rng(state: dict) -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)}


@dataclass
class TrainState:
    """What training has done so far: saved with every checkpoint and restored on resume. The RNG streams
    (torch, CUDA, numpy, Python and the TP tracker's) are read when saving and set when resuming."""

    iteration: int = 0
    consumed_samples: int = 0
    consecutive_skipped: int = 0  # fp16 overflow-skipped steps in a row (not saved: a resume starts afresh)

    def to_client(self) -> dict:
        from training.parallel import random as tp_random

        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "rng": _encode_rng(tp_random.get_rng_state())}

    def restore(self, client: dict) -> None:
        from training.parallel import random as tp_random

        self.iteration = client["iteration"]
        self.consumed_samples = client["consumed_samples"]
        tp_random.set_rng_state(_decode_rng(client["rng"]))


@dataclass(frozen=True)
class ModelDescription:
    """What a checkpoint records about the model besides its tensors: the resolved (frozen) config, the
    training dtype, the padded vocabulary and the tokenizer (its files are copied into the run directory)."""

    cfg: Config
    dtype: str
    padded_vocab: int
    tokenizer: Tokenizer

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)

    @property
    def pipeline_layers(self) -> PipeNames | None:
        """How pipeline-stage names map back to the PP=1 model's names (architecture, layer count); None without PP."""
        return PipeNames.of(self.cfg.model) if self.cfg.parallel.pipeline > 1 else None


def _tag(p) -> tuple[int, int] | None:
    return (p.partition_dim, getattr(p, "partition_stride", 1)) if getattr(p, "tensor_model_parallel", False) else None


def canonical_names(model: torch.nn.Module, pipeline_layers: PipeNames | None = None) -> dict[str, str | None]:
    """This rank's parameter names -> the PP=1 model's names (both tied embedding copies -> embedding.*);
    ``pipeline_layers`` maps a pipeline model's names (:class:`~training.checkpoint_reader.PipeNames`; None: the
    names are kept)."""
    if pipeline_layers is None:
        return {n: n for n, _ in model.named_parameters()}
    return {n: canonical_name(n, pipeline_layers) for n, _ in model.named_parameters()}


def optimizer_param_names(engine: DeepSpeedEngine, model: torch.nn.Module,
                          desc: ModelDescription) -> list[str | None] | None:
    """Model-parameter names in the order of the torch optimizer's state (None for pipeline-tied
    copies); None when the optimizer does not hold model parameters (fp16 masters, ZeRO)."""
    opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
    if not isinstance(opt, torch.optim.Optimizer) or desc.dtype == "fp16" or desc.cfg.parallel.zero_stage:
        return None
    names = canonical_names(model, desc.pipeline_layers)
    by_id = {id(p): (None if getattr(p, "ds_pipe_replicated", False) else names[n])
             for n, p in model.named_parameters()}
    return [by_id.get(id(p)) for g in opt.param_groups for p in g["params"]]


def partition_tags(model: torch.nn.Module, pipe_names: PipeNames | None = None, pp_group=None) -> dict:
    """{PP=1 model parameter name: (partition_dim, stride) or None}; for a pipeline model the names
    are mapped back (``pipe_names``) and the stages' tags are gathered (collective over ``pp_group``)."""
    if pipe_names is None:
        return {n: _tag(p) for n, p in model.named_parameters()}
    mine = {}
    for n, p in model.named_parameters():
        name = canonical_name(n, pipe_names)
        if name is not None:
            mine[name] = _tag(p)
    parts = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, mine, group=pp_group)
    return {k: v for part in parts for k, v in part.items()}


def partitions_weights(engine) -> bool:
    """Whether ``engine`` runs ZeRO-3 (each parameter a 1/DP partition on this rank, shape 0 outside a gather)."""
    return bool(getattr(engine, "zero_optimization_partition_weights", lambda: False)())


def gathered_state_dict(model: torch.nn.Module, to_rank0_only: bool = True,
                        keep: bool | None = None) -> dict[str, torch.Tensor] | None:
    """Collective over the ZeRO-3 partition group (every rank calls it): ``model.state_dict()`` with every
    partitioned parameter gathered whole (this rank's TP shard), one module's own parameters at a time (at most one
    layer whole at once), as CPU copies in the parameters' dtype. A module that is not partitioned gives its own
    state dict. With ``to_rank0_only`` the other ranks get None; ``keep`` (if given) says instead whether this rank
    gets it."""
    import deepspeed

    if keep is None:
        keep = dist.get_rank() == 0 or not to_rank0_only if dist.is_initialized() else True
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(own, modifier_rank=None):
            if keep:
                dot = f"{prefix}." if prefix else ""
                for name, p in module.named_parameters(recurse=False):
                    out[dot + name] = p.detach().cpu().clone()
                for name, b in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        out[dot + name] = b.detach().cpu().clone()
    if not keep:
        return None
    # model.state_dict()'s keys and order (a tied parameter under each of its names)
    return {k: out[k] for k in model.state_dict()}


def gathered_for_write(params: list[torch.nn.Parameter]):
    """A context in which ZeRO-3 ``params`` are whole on every rank and may be written (every rank writes the same
    values; rank 0's are partitioned again on exit: ``GatheredParameters(modifier_rank=0)``); for parameters that
    are not partitioned, a context that does nothing. Collective under ZeRO-3."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _write_gathered_weights(engine, model: torch.nn.Module, client: dict, folder: Path, ps: ParallelState) -> None:
    """ZeRO-3: each TP rank's shard whole (collective gather over the DP ranks) and the client state, written by DP
    rank 0 of each TP rank as :data:`~training.checkpoint_reader.GATHERED_WEIGHTS`, the files the offline readers
    take (as one ``mp_rank_XX_model_states.pt`` per TP rank of the other stages)."""
    weights = gathered_state_dict(model, keep=ps.dp_rank == 0 and ps.cp_rank == 0)
    if weights is not None:
        sched = engine.lr_scheduler  # DeepSpeed's own files hold it too; the offline tools (reshard) read it here
        state = {"module": weights, **client, "zero3_gathered": True, "global_steps": engine.global_steps,
                 "dp_world_size": engine.dp_world_size,
                 "lr_scheduler": sched.state_dict() if sched is not None else None}
        torch.save(state, folder / GATHERED_WEIGHTS.format(ps.tp_rank))


def _tokenizer_spec(tokenizer: Tokenizer, run_dir: Path, is_rank0: bool) -> dict:
    """Tokenizer files copied into RUN_DIR/tokenizer so a run directory is self-contained; the
    returned spec names them relative to RUN_DIR."""
    from megatron_ds_suite.core.corpus import copy_tokenizer_files

    spec = tokenizer.spec()
    if is_rank0:
        copy_tokenizer_files(spec, run_dir)
    if dist.is_initialized():
        dist.barrier()
    return {k: (f"tokenizer/{Path(v).name}" if k.endswith("_file") else v) for k, v in spec.items()}


def save(engine: DeepSpeedEngine, model: torch.nn.Module, state: TrainState, ps: ParallelState,
         desc: ModelDescription, config: dict | None = None) -> Path:
    """Collective: every rank calls it. ``state`` and the model's description (``desc``) into RUN_DIR
    (``desc.cfg.run.dir``); ``config`` is the config to record (default ``desc.cfg``; reshard records the
    source's precision)."""
    tag = f"iter_{state.iteration:07d}"
    run_dir, is_rank0 = desc.run_dir, ps.rank == 0
    root = checkpoint_dir(run_dir)
    layers = desc.pipeline_layers
    client = {
        "config": desc.cfg.to_dict() if config is None else config,
        **state.to_client(),
        "padded_vocab_size": desc.padded_vocab,
        "tokenizer": _tokenizer_spec(desc.tokenizer, run_dir, is_rank0),
        "partition": (partition_tags(model, layers, ps.pp_group) if layers is not None else partition_tags(model)),
        "parallel": {"tp": ps.dims.tp, "pp": ps.dims.pp, "dp": ps.dims.dp, **pipeline_schedule(desc.cfg)},
        "tp_rank": ps.tp_rank,
        "pp_rank": ps.pp_rank,
        "optimizer_param_names": optimizer_param_names(engine, model, desc),
        "dtype": desc.dtype,
    }
    if layers is None:  # how DeepSpeed's ds_to_universal merges the TP shards (no universal conversion under PP)
        client[UNIVERSAL_INFO_KEY] = universal_checkpoint_info(model, desc.padded_vocab, ps.dims.tp)
    if (root / tag).is_dir() and catalog.tag_state(root / tag) == "complete":
        # the same iteration is saved already (a run resumed at its last iteration ends here): a complete
        # checkpoint is never written into
        if is_rank0:
            logger.info("checkpoint %s is complete already; not saving it again", root / tag)
        return root / tag
    try:
        if is_rank0:
            catalog.begin_save(run_dir, tag)  # the .saving marker, before any rank writes a byte
        dist.barrier()
        engine.save_checkpoint(str(root), tag=tag, client_state=client, save_latest=False)
        if partitions_weights(engine):
            _write_gathered_weights(engine, model, client, root / tag, ps)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per host: its page cache holds what its ranks wrote
            catalog.sync_folder(root / tag)
        dist.barrier()  # every rank's files are written and durable
    except BaseException as e:  # a full disk (OSError, or RuntimeError from torch.save's zip writer), Ctrl-C, ...
        # the save's own partial folder, removed by the process that wrote it: `latest` still names a whole one
        shutil.rmtree(root / tag, ignore_errors=True)
        if not isinstance(e, (OSError, RuntimeError)):
            raise
        cause = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip().splitlines()[-1]
        raise OSError(getattr(e, "errno", None), f"could not write checkpoint {tag} ({cause})", str(root / tag)) from e
    if is_rank0:
        catalog.finish_save(run_dir, tag, state.iteration)  # the completion record, then `latest`
        catalog.prune(run_dir, desc.cfg.train.keep_last)
        logger.info("saved checkpoint %s", root / tag)
    dist.barrier()
    return root / tag


def pipeline_schedule(cfg) -> dict:
    """The pipeline schedule a checkpoint records (its optimizer files hold each rank's chunks' state)."""
    p = cfg.parallel
    return {"schedule": p.pipeline_schedule if p.pipeline > 1 else "1f1b",
            "virtual_pipeline": p.virtual_pipeline if p.pipeline > 1 else 1}


def refuse_other_schedule(saved: dict, cfg, where: str) -> None:
    """One line when a checkpoint's pipeline schedule or chunk count is not this run's: each rank's optimizer file
    holds the state of the layers that rank held, so another layout goes through the reshard tool."""
    was = (saved.get("schedule", "1f1b"), saved.get("virtual_pipeline", 1))
    now = tuple(pipeline_schedule(cfg).values())
    if was != now:
        raise ConfigError(f"checkpoint {where} was saved with parallel.pipeline_schedule={was[0]} virtual_pipeline="
                          f"{was[1]} but this run uses {now[0]} virtual_pipeline={now[1]}: resume with the saved "
                          f"schedule, or convert it with python -m training.tools.reshard --checkpoint RUN_DIR --tp "
                          f"{saved['tp']} --pp {saved['pp']} --schedule {now[0]} --virtual-pipeline {now[1]} --out "
                          f"NEW_RUN_DIR")


def refuse_other_dp(engine: DeepSpeedEngine, meta: dict, ps: ParallelState, where: str, run_dir: Path) -> None:
    """One line when the checkpoint's optimizer state is partitioned over another number of data-parallel ranks
    than this run's (DeepSpeed would stop every rank with its own exception); a ZeRO-0 state loads at any DP."""
    from training.optim.engine import dp_partitioned_state  # DeepSpeed's classes: imported where an engine exists

    dp = meta["parallel"].get("dp")  # absent in a checkpoint written by an import tool: nothing partitioned
    saved = (dp or 0) * (meta.get("config") or {}).get("parallel", {}).get("context", 1)
    now = ps.dims.dp * ps.dims.cp
    kind = dp_partitioned_state(engine)
    if dp is not None and saved != now and kind is not None:
        raise ConfigError(f"checkpoint {where} was saved with {saved} data-parallel ranks and this run has {now}: its "
                          f"optimizer state is partitioned over them ({kind}); resume with {saved}, or convert it "
                          f"with python -m training.tools.reshard --checkpoint {run_dir} --tp {ps.dims.tp} --pp "
                          f"{ps.dims.pp} --dp {now} --out NEW_RUN_DIR")


def load(engine: DeepSpeedEngine, state: TrainState, ps: ParallelState, desc: ModelDescription) -> bool:  # noqa: C901
    """Resume ``state`` (and the engine) from the checkpoint :func:`training.checkpoint_catalog.plan_resume` picks
    (``latest``, or ``train.resume_tag``), if any; folders of saves that never finished (and, with an older
    ``train.resume_tag``, the newer checkpoints) are moved aside by rank 0, never deleted. Returns True when it
    resumed."""
    run_dir, is_rank0 = desc.run_dir, ps.rank == 0
    plan = catalog.plan_resume(run_dir, desc.cfg.train.resume_tag)  # every rank reads; all refuse alike
    tag = plan.tag
    if tag is not None:  # every refusal before anything is moved
        meta = read_client_state(run_dir, tag)
        if meta.get("weights_only"):  # written by training.tools.import_hf: no optimizer, schedule or RNG to resume
            raise ConfigError(f"{run_dir} holds imported weights only ({meta.get('imported_from')}), not a run "
                              f"to resume: start a new run from it with train.init_from={run_dir} and another run.dir")
        saved_sha = (meta.get("tokenizer") or {}).get("sha256")
        if saved_sha and saved_sha != desc.tokenizer.file_sha256():
            raise CheckpointError(f"checkpoint {run_dir}/checkpoints/{tag} was trained with another tokenizer "
                                  f"(file sha256 {saved_sha} vs now {desc.tokenizer.file_sha256()}): resume with "
                                  f"the original tokenizer files or start a new run.dir")
        saved = meta["parallel"]
        if (saved["tp"], saved["pp"]) != (ps.dims.tp, ps.dims.pp):
            raise ConfigError(f"checkpoint {run_dir}/checkpoints/{tag} was saved with TP={saved['tp']} "
                              f"PP={saved['pp']} but this run uses TP={ps.dims.tp} PP={ps.dims.pp}: "
                              f"convert it with python -m training.tools.reshard --checkpoint {run_dir} "
                              f"--tp {ps.dims.tp} --pp {ps.dims.pp} --out NEW_RUN_DIR, or resume with "
                              f"parallel.tensor={saved['tp']} parallel.pipeline={saved['pp']}")
        refuse_other_schedule(saved, desc.cfg, f"{run_dir}/checkpoints/{tag}")
        refuse_other_dp(engine, meta, ps, f"{run_dir}/checkpoints/{tag}", run_dir)
        rows = meta.get("padded_vocab_size")
        if rows is not None and desc.padded_vocab is not None and rows != desc.padded_vocab:
            raise ConfigError(f"checkpoint {run_dir}/checkpoints/{tag} has a padded vocabulary of {rows} rows but this "
                              f"run pads to {desc.padded_vocab} (model.make_vocab_size_divisible_by="
                              f"{desc.cfg.model.make_vocab_size_divisible_by} at TP={ps.dims.tp}): resume with "
                              f"model.make_vocab_size_divisible_by={rows // ps.dims.tp}, the value its config records")
        refuse_other_convention(meta.get("config"), desc.cfg.data.split_convention, f"{run_dir}/checkpoints/{tag}")
    if dist.is_initialized():
        dist.barrier()  # every rank has read the folder before rank 0 moves anything in it
    if is_rank0:
        catalog.carry_out(run_dir, plan)
    if dist.is_initialized():
        dist.barrier()
    if tag is None:
        return False
    safe_load.install()  # DeepSpeed's own reads with weights_only=True as well
    _, client = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {checkpoint_dir(run_dir)}")
    state.restore(client)
    if is_rank0:
        logger.info("resumed from %s at iteration %d", tag, state.iteration)
    return True
