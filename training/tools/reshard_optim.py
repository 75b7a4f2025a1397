"""fp32 master weights and Adam moments of fp16 and ZeRO-1/2/3 checkpoints, for ``training.tools.reshard``.

An fp32 run without ZeRO keeps Adam's state per model parameter, which ``training.tools.reshard`` reads straight
from the checkpoint files. fp16 runs keep fp32 *master* copies inside DeepSpeed's ``FP16_UnfusedOptimizer``
(the fp16 weights are only their rounding) and ZeRO-1 keeps masters and moments as flat buffers
partitioned over the data-parallel ranks. Rather than parse those private layouts, the checkpoint is
loaded by DeepSpeed itself: the source layout (TP x PP x DP processes) is started, every rank builds the
source engine and ``load_checkpoint``s, and each parameter's fp32 master, ``exp_avg``, ``exp_avg_sq`` and
step are read through DeepSpeed's public accessors (``deepspeed.utils.safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` for ZeRO, which gather a parameter's DP fragments; the unfused fp16
optimizer's ``fp32_groups`` and its torch optimizer's state otherwise). The TP shards are merged by their
partition tags like the weights. On the target side :func:`write_state` puts them back the same way
(``safe_set_full_*`` for ZeRO). DeepSpeed's universal checkpoint (``ds_to_universal``) was not used: it
expects Megatron-DeepSpeed's ``UNIVERSAL_CHECKPOINT_INFO`` parameter patterns and pipeline ``layer_*``
files, and does not cover the non-ZeRO fp16 optimizer, the paper's default.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_ds_suite.core import atomic
from training import checkpoint as ckpt
from training.checkpoint_reader import PipeNames, checkpoint_dir, read_client_state
from training.config import Config, config_from_dict
from training.parallel.sharding import merge_tagged
from training.runtime.spawn import run_distributed

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

logger = logging.getLogger("training.tools.reshard")
KEYS = ("exp_avg", "exp_avg_sq")


def needs_engine(meta: dict) -> bool:
    """Whether the checkpoint's optimizer state is not per model parameter (fp16/bf16 masters or ZeRO)."""
    return meta.get("dtype") in ("fp16", "bf16") or meta["config"]["parallel"]["zero_stage"] > 0


def force_precision(cfg: Config, dtype: str) -> None:
    """Build engines in the checkpoint's dtype even on CPU ('auto' would pick fp32 there)."""
    cfg.precision.dtype = dtype
    if dtype == "fp16":
        cfg.precision.allow_fp16_on_cpu = True


# --------------------------------------------------------------------------------------------------
# Reading and writing one engine's state
# --------------------------------------------------------------------------------------------------
def _named(model: torch.nn.Module, pipeline_layers: PipeNames | None) -> list[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) in a fixed order, pipeline-tied copies left out."""
    names = ckpt.canonical_names(model, pipeline_layers)
    return [(names[n], p) for n, p in model.named_parameters()
            if names[n] is not None and not getattr(p, "ds_pipe_replicated", False)]


def _is_zero(opt) -> bool:
    """Whether ``opt`` keeps fp32 masters and moments in flat partitions over the DP ranks, read and written through
    DeepSpeed's per-parameter accessors: ZeRO-1/2/3, and ``BF16_Optimizer`` (bf16 under pipeline parallelism, whose
    Adam state is keyed by its flat partitions: read per parameter, it would give zeros)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(opt, (DeepSpeedZeroOptimizer, BF16_Optimizer)) or _is_zero3(opt)


def _is_zero3(opt) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return isinstance(opt, DeepSpeedZeroOptimizer_Stage3)


def _zero_flat_partitions(opt) -> list[torch.Tensor]:
    """The fp32 flat partitions the torch optimizer's state is keyed by (ZeRO-1/2's, ZeRO-3's and
    ``BF16_Optimizer``'s names)."""
    if _is_zero3(opt):
        return opt.fp32_partitioned_groups_flat
    return getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition


def _unfused_masters(opt) -> dict[int, torch.Tensor] | None:
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(opt, FP16_UnfusedOptimizer):
        return None
    return {id(p): m for ps, ms in zip(opt.fp16_groups, opt.fp32_groups) for p, m in zip(ps, ms)}


def _zero_link_state(opt) -> None:
    """Make sure ZeRO-1/2's (and ``BF16_Optimizer``'s) per-parameter views into the flat optimizer state exist
    (DeepSpeed links them only after its first ``step()``; ZeRO-3 reads its flat partitions by offset and needs
    none)."""
    if _is_zero3(opt):
        return
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()


def read_state(engine: DeepSpeedEngine, model: torch.nn.Module, pipeline_layers: PipeNames | None) -> dict[str, dict]:
    """{name: {"master", "exp_avg", "exp_avg_sq", "step"}} of this rank's (TP-local) parameters of ``model``
    (``engine``'s module), fp32; ``pipeline_layers`` as in :func:`training.checkpoint.canonical_names`.
    Collective over the DP group under ZeRO: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    out: dict[str, dict] = {}
    if _is_zero(opt):
        _zero_link_state(opt)
        flat = _zero_flat_partitions(opt)[0]
        step = opt.optimizer.state[flat].get("step")
        for name, p in _named(model, pipeline_layers):
            out[name] = {"master": safe_get_full_fp32_param(p).float().clone(), "step": step}
            for k in KEYS:
                out[name][k] = safe_get_full_optimizer_state(p, k).float().clone()
        return out
    masters = _unfused_masters(opt)
    inner = opt.optimizer if masters is not None else opt
    for name, p in _named(model, pipeline_layers):
        m = masters[id(p)] if masters is not None else p
        st = inner.state.get(m, {})
        out[name] = {"master": m.detach().float().clone(), "step": st.get("step")}
        for k in KEYS:
            out[name][k] = st[k].detach().float().clone() if k in st else torch.zeros_like(m, dtype=torch.float32)
    return out


def write_state(engine: DeepSpeedEngine, model: torch.nn.Module, pipeline_layers: PipeNames | None,
                local: dict[str, dict]) -> None:
    """Set masters (and the weights from them) and Adam moments of this rank's parameters from ``local``
    ({name: TP-local fp32 tensors}, as :func:`read_state` returns)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    opt = engine.optimizer
    named = _named(model, pipeline_layers)
    with torch.no_grad():
        with ckpt.gathered_for_write([p for _, p in named]):  # ZeRO-3: whole while written, then partitioned again
            for name, p in named:
                p.copy_(local[name]["master"].to(p.dtype))
        if _is_zero(opt):
            step = next(iter(local.values()))["step"]
            for flat in _zero_flat_partitions(opt):
                opt.optimizer.state[flat] = {
                    "step": _step_tensor(step, flat.device),
                    **{k: torch.zeros_like(flat) for k in KEYS}}
            _zero_link_state(opt)
            for name, p in named:
                safe_set_full_fp32_param(p, local[name]["master"])
                for k in KEYS:
                    safe_set_full_optimizer_state(p, local[name][k], k)
            return
        masters = _unfused_masters(opt)
        inner = opt.optimizer if masters is not None else opt
        for name, p in named:
            m = masters[id(p)] if masters is not None else p
            m.copy_(local[name]["master"].to(m.dtype))
            inner.state[m] = {"step": _step_tensor(local[name]["step"], m.device),
                              **{k: local[name][k].to(m.dtype).clone() for k in KEYS}}


def _step_tensor(step, device) -> torch.Tensor:
    if step is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    return step.detach().clone().to(device) if torch.is_tensor(step) else torch.tensor(float(step), device=device)


# --------------------------------------------------------------------------------------------------
# Extraction from a checkpoint (spawns the source layout)
# --------------------------------------------------------------------------------------------------
def extract(run_dir: Path, tag: str, meta: dict, work_dir: Path) -> dict[str, dict]:
    """Full (TP-merged) fp32 masters and moments of checkpoint ``run_dir``/``tag``, by parameter name."""
    par = meta["parallel"]
    world = par["tp"] * par["pp"] * par["dp"]
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        run_distributed(_extract_worker, world, str(run_dir), tag, str(work_dir), timeout=None)
        shards = [torch.load(work_dir / f"tp_{r}_pp_{s}.pt", map_location="cpu", weights_only=True)
                  for r in range(par["tp"]) for s in range(par["pp"])]
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    by_tp: dict[str, list] = {}
    for (r, s), shard in zip([(r, s) for r in range(par["tp"]) for s in range(par["pp"])], shards):
        for name, st in shard.items():
            by_tp.setdefault(name, [None] * par["tp"])[r] = st
    merged = {}
    for name, parts in by_tp.items():
        tags = meta["partition"].get(name)
        merged[name] = {"step": parts[0]["step"]}
        for key in ("master", *KEYS):
            merged[name][key] = merge_tagged([p[key] for p in parts], tags)
    return merged


def _extract_worker(rank: int, world: int, run_dir: str, tag: str, work_dir: str) -> None:
    from training.resolve import resolve_run
    from training.trainer import Trainer

    meta = read_client_state(run_dir, tag)
    cfg = config_from_dict(meta["config"])
    cfg.run.dir = str(Path(work_dir) / "engine")  # never write into the source run directory
    cfg.train.exit_at = None
    cfg.train.progress_bar = False
    force_precision(cfg, meta["dtype"])
    trainer = Trainer(resolve_run(cfg))
    engine, ps = trainer.engine, trainer.ps
    path, _ = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load {checkpoint_dir(run_dir) / tag}")
    state = read_state(engine, trainer.model, trainer.desc.pipeline_layers)
    if ps.dp_rank == 0:
        out = Path(work_dir) / f"tp_{ps.tp_rank}_pp_{ps.pp_rank}.pt"
        with atomic.atomic_path(out) as tmp:
            torch.save(state, tmp)
